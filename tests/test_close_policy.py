"""The close policy (broker/closing.py) without Redis: what the runner and the sweeper do with an
attempt that did not complete, and the dead letter a failed episode leaves."""

from __future__ import annotations

import pytest

from broker import errors
from broker.closing import OUTAGE_EXTRA_ATTEMPTS, OUTAGE_NOTE, decide, dead_letter, limit_matters
from broker.records import AttemptRecord, EpisodeSpec, JobSpec
from broker.states import AttemptStatus, CloseAction

pytestmark = pytest.mark.unit  # needs no server: make check runs it


def err(reason: str, transient: bool | None = None) -> errors.EpisodeError:
    return errors.EpisodeError(reason, "boom", transient=transient)


def test_a_lost_lease_is_abandoned_and_needs_no_limit():
    exc = err(errors.LEASE_LOST)
    assert not limit_matters(exc)
    close = decide(exc, 3, 3, True, max_attempts=3)
    assert (close.action, close.uncounted) == (CloseAction.ABANDON, False)


def test_a_shutdown_hands_the_episode_back_uncounted():
    exc = err(errors.WORKER_SHUTDOWN, transient=True)
    assert not limit_matters(exc)
    close = decide(exc, 5, 5, False, max_attempts=5)
    assert (close.action, close.uncounted) == (CloseAction.HAND_BACK, True)
    assert close.message(exc, "stopping", 5) == "stopping"


@pytest.mark.parametrize("attempt,limit,action", [(1, 3, CloseAction.RETRY), (2, 3, CloseAction.RETRY), (3, 3, CloseAction.FAIL), (4, 3, CloseAction.FAIL)])
def test_a_transient_error_retries_while_attempts_are_left(attempt, limit, action):
    exc = err(errors.ENV_UNREACHABLE, transient=True)
    assert limit_matters(exc)
    close = decide(exc, attempt, limit, False, max_attempts=3)
    assert (close.action, close.uncounted, close.limit) == (action, False, limit)
    expected = "boom" if action == CloseAction.RETRY else f"boom (after {attempt} attempts)"
    assert close.message(exc, "boom", attempt) == expected


def test_a_permanent_error_fails_at_once():
    exc = err(errors.ENV_BAD_REQUEST, transient=False)
    close = decide(exc, 1, 3, True, max_attempts=3)
    assert (close.action, close.uncounted) == (CloseAction.FAIL, False)
    assert close.message(exc, "bad", 1) == "bad"


def test_an_outage_is_not_counted_and_raises_the_limit():
    exc = err(errors.MODEL_UNAVAILABLE, transient=True)
    close = decide(exc, 3, 3, True, max_attempts=3)
    assert (close.action, close.uncounted, close.limit) == (CloseAction.RETRY, True, 4)
    assert close.message(exc, "down", 3) == "down" + OUTAGE_NOTE


def test_redis_away_counts_as_an_outage_however_it_was_noticed():
    exc = err(errors.BROKER_OUTAGE, transient=True)
    close = decide(exc, 1, 1, False, max_attempts=1)
    assert (close.action, close.uncounted, close.limit) == (CloseAction.RETRY, True, 2)


def test_outages_stop_being_free_past_the_extra_attempts():
    exc = err(errors.MODEL_UNAVAILABLE, transient=True)
    last = 3 + OUTAGE_EXTRA_ATTEMPTS
    close = decide(exc, last, last, True, max_attempts=3)
    assert (close.action, close.uncounted) == (CloseAction.FAIL, False)
    assert close.message(exc, "down", last) == f"down (after {last} attempts)"


def test_a_lost_worker_goes_again_until_its_limit():
    """The sweeper's case: a lease that expired is a transient failure, never an outage."""
    exc = err(errors.WORKER_LOST, transient=True)
    assert decide(exc, 1, 2, False, max_attempts=2).action == CloseAction.RETRY
    assert decide(exc, 2, 2, False, max_attempts=2).action == CloseAction.FAIL


def test_the_dead_letter_is_the_failed_attempt_with_its_spec():
    spec = EpisodeSpec(job_id="j", episode_id="j.e1", group_id="g1", group_size=2, env_name="arith",
                       base_url="http://env:1", env_params={})
    record = AttemptRecord(job_id="j", episode_id="j.e1", attempt=2, group_id="g1", group_size=2,
                           env_name="arith", llm_model="m", status=AttemptStatus.FAILED, reason=errors.ENV_BAD_REQUEST,
                           error_class="EpisodeError", error="bad", started_at=12.5)
    letter = dead_letter(record, spec, traceback="tb")
    assert (letter.job_id, letter.episode_id, letter.group_id, letter.env_name) == ("j", "j.e1", "g1", "arith")
    assert (letter.reason, letter.error_class, letter.error, letter.traceback) == (
        errors.ENV_BAD_REQUEST, "EpisodeError", "bad", "tb")
    assert (letter.attempts, letter.first_attempt_at, letter.spec) == (2, 12.5, spec.shown())
    assert dead_letter(record, None).spec == {}


# --- --retry-on (JobSpec.retry_on, broker/errors.py RETRY_CLASSES) ------------------------------
def test_retry_on_retries_the_named_classes_only():
    infra = errors.parse_retry_on("infra")
    assert infra == ["env_outage", "model_timeout", "worker_lost"]
    close = decide(err(errors.ENV_SERVER_ERROR), 1, 3, False, max_attempts=3, retry_on=infra)
    assert (close.action, close.not_retried) == (CloseAction.RETRY, "")
    # an agent's failure is transient, but not infrastructure: dead-lettered on its first attempt
    exc = err(errors.AGENT_ERROR)
    close = decide(exc, 1, 3, False, max_attempts=3, retry_on=infra)
    assert close.action == CloseAction.FAIL
    assert close.message(exc, "boom", 1) == ("boom (not retried: --retry-on env_outage,model_timeout,worker_lost "
                                             "does not name its class agent_failure)")


def test_retry_on_can_retry_a_malformed_answer_and_leaves_hand_backs_alone():
    exc = err(errors.MODEL_MALFORMED)
    assert decide(exc, 1, 3, False, max_attempts=3).action == CloseAction.FAIL  # as before the option
    assert decide(exc, 1, 3, False, max_attempts=3, retry_on=["malformed_answer"]).action == CloseAction.RETRY
    assert decide(exc, 3, 3, False, max_attempts=3, retry_on=["malformed_answer"]).action == CloseAction.FAIL
    shutdown = decide(err(errors.WORKER_SHUTDOWN, transient=True), 1, 3, False, max_attempts=3, retry_on=["env_outage"])
    assert (shutdown.action, shutdown.uncounted) == (CloseAction.HAND_BACK, True)
    broker_away = decide(err(errors.BROKER_OUTAGE, transient=True), 1, 3, True, max_attempts=3, retry_on=["env_outage"])
    assert (broker_away.action, broker_away.uncounted) == (CloseAction.RETRY, True)


def test_retry_on_names_its_classes():
    assert errors.parse_retry_on("") == [] and errors.parse_retry_on(" model_timeout, env_outage ") == [
        "env_outage", "model_timeout"]
    with pytest.raises(ValueError, match="unknown --retry-on class 'env'"):
        errors.parse_retry_on("env")
    every = {r for reasons in errors.RETRY_CLASSES.values() for r in reasons}
    assert errors.TRANSIENT_REASONS - errors.NOT_FAILURES <= every  # every transient failure has a class


def test_run_resume_can_correct_a_jobs_retry_classes():
    from broker.settings import Settings, SettingsError
    from interactor.job_corrections import corrected

    spec = corrected(JobSpec(job_id="j", llm_base_url="http://llm/v1", model="m"), {"retry_on": "infra"})
    assert spec.retry_on == ["env_outage", "model_timeout", "worker_lost"]
    assert corrected(spec, {"retry_on": ""}).retry_on == []  # back to every transient failure
    # a correction's value is read as a setting first (correction_flags), which names a bad class
    with pytest.raises(SettingsError, match="unknown --retry-on class"):
        Settings.from_env({}, retry_on="everything")
