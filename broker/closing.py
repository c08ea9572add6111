"""How an attempt that did not complete is closed: one pure rule, shared by the worker that ran
it (workers/attempt.py) and the sweeper that reclaims it from a lost worker (broker/recovery.py),
and the dead letter a failed episode leaves, built in one place.

:func:`decide` reads no Redis: it takes the error, the attempt number, the attempt limit as the
ledger holds it and whether the attempt lived through an outage, and says what to do. The caller
does it (records the attempt, grants the uncounted attempt, enqueues again), so the rule is
tested without Redis (tests/test_close_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from broker import errors
from broker.keys import env_instance_id
from broker.records import AttemptRecord, DeadLetter, EpisodeSpec, OrphanInstance
from broker.states import CloseAction, EnvProtocol

# Attempts ended by an outage are not counted, up to this many beyond max_attempts (a server
# that flaps forever must still let its episodes end).
OUTAGE_EXTRA_ATTEMPTS = 20


OUTAGE_NOTE = " [after an outage; this attempt is not counted]"


@dataclass(frozen=True)
class Close:
    """What :func:`decide` says: ``action``; ``uncounted``: grant one attempt beyond the limit
    first (the attempt is not the episode's fault); ``limit``: the limit that then applies."""

    action: str
    uncounted: bool = False
    limit: int = 0
    # the job's --retry-on (JobSpec.retry_on) left this failure out: "" when it did not
    not_retried: str = ""

    def message(self, exc: errors.EpisodeError, message: str, attempt: int) -> str:
        """The error message recorded for the attempt: said in it, that it was not counted, after
        how many attempts a transient error failed the episode for good, or that the job's
        --retry-on did not name its class."""
        if self.uncounted and self.action in (CloseAction.RETRY, CloseAction.FAIL):
            message += OUTAGE_NOTE
        if self.action == CloseAction.FAIL and self.not_retried:
            message = f"{message} ({self.not_retried})"
        elif self.action == CloseAction.FAIL and exc.transient:
            message = f"{message} (after {attempt} attempts)"
        return message


def limit_matters(exc: errors.EpisodeError) -> bool:
    """Whether :func:`decide` needs the attempt limit for ``exc`` (a lost lease and a shutdown
    are closed without it: the caller need not read it)."""
    return exc.reason not in (errors.LEASE_LOST, errors.WORKER_SHUTDOWN, errors.CANCELLED)


def decide(exc: errors.EpisodeError, attempt: int, limit: int, outage_seen: bool, *, max_attempts: int,
           retry_on: list[str] | tuple[str, ...] = ()) -> Close:
    """How to close attempt ``attempt`` that ended with ``exc``.

    ``limit``: the last attempt number the ledger allows (``Ledger.attempt_limit``, before this
    close); ``outage_seen``: the attempt lived through a server's outage (workers/ports.py's
    ``Guard``). Redis away (``BROKER_OUTAGE``) is our own outage however the attempt noticed it,
    and is never counted against the episode either; an outage is not counted up to
    ``OUTAGE_EXTRA_ATTEMPTS`` beyond ``max_attempts``. A transient error retries while attempts
    are left; a permanent one, or a transient one past the limit, fails the episode. An attempt
    stopped because its job was cancelled ends the episode cancelled. ``retry_on``: the job's
    --retry-on classes (broker/errors.py RETRY_CLASSES); when given, they alone say what is
    retried, and a failure of any other class fails the episode on its first attempt, the
    message saying so.
    """
    if exc.reason == errors.LEASE_LOST:
        return Close(CloseAction.ABANDON, limit=limit)
    if exc.reason == errors.WORKER_SHUTDOWN:
        return Close(CloseAction.HAND_BACK, uncounted=True, limit=limit)
    if exc.reason == errors.CANCELLED:  # its job was cancelled (broker/cancel.py): not the episode's failure
        return Close(CloseAction.CANCEL, limit=limit)
    outage_seen = outage_seen or exc.reason == errors.BROKER_OUTAGE
    transient = errors.retryable(exc.reason, exc.transient, retry_on)
    not_retried = ""
    if retry_on and not transient and exc.reason not in errors.NOT_FAILURES:
        not_retried = (f"not retried: --retry-on {','.join(retry_on)} does not name its class "
                       f"{errors.retry_class(exc.reason) or '(none)'}")
    uncounted = bool(transient and outage_seen and attempt < max_attempts + OUTAGE_EXTRA_ATTEMPTS)
    if uncounted:
        limit += 1
    if transient and attempt < limit:
        return Close(CloseAction.RETRY, uncounted=uncounted, limit=limit)
    return Close(CloseAction.FAIL, uncounted=uncounted, limit=limit, not_retried=not_retried)


def dead_letter(record: AttemptRecord, spec: EpisodeSpec | None, *, traceback: str = "") -> DeadLetter:
    """The dead letter of an episode whose attempt ``record`` failed it for good."""
    return DeadLetter(job_id=record.job_id, episode_id=record.episode_id, group_id=record.group_id,
                      env_name=record.env_name, reason=record.reason, error_class=record.error_class,
                      error=record.error, traceback=traceback, attempts=record.attempt,
                      spec=spec.shown() if spec else {}, first_attempt_at=record.started_at)


def orphans(spec: EpisodeSpec | None, trajectories: Iterable[tuple[int, str]]) -> list[bytes]:
    """The ``<prefix>:orphans`` entries (packed OrphanInstance) for the env instances of an
    episode's trajectories that nobody will continue or close: whoever ends a trajectory without
    closing its instance (a cancel of a waiting episode, a dead letter, a close before any call)
    queues them for a worker's orphan closer (workers/orphans.py). ``trajectories``: (number,
    attempt_id) of the attempts that reset them; a number 0 names none. Closing one that is gone
    is a no-op on the env server."""
    if spec is None or spec.transport == "inproc" or not spec.base_url or spec.protocol == EnvProtocol.OPENENV:
        return []  # an inproc env, or an OpenEnv session, ended with its worker's process or socket
    return [OrphanInstance(base_url=spec.base_url, env_name=spec.env_name, protocol=spec.protocol,
                           instance_id=env_instance_id(spec.episode_id, number, attempt_id)).pack()
            for number, attempt_id in dict.fromkeys(trajectories) if number > 0]
