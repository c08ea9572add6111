"""One attempt (workers/attempt.py) on fake parts: no Redis, no servers, no worker process.

The parts an attempt is handed (workers/attempt_parts.py) are replaced by small fakes that
record what the attempt asked of them; the step loop, the port layers and the close policy are
the real ones. The same paths run end to end against real servers in tests/test_runner.py and
tests/test_resume*.py."""

from __future__ import annotations

import dataclasses
import time

import pytest

from broker import errors
from broker.keys import Keys, env_instance_id
from broker.lease import Lease
from broker.records import AttemptRecord, EpisodeSpec, JobSpec, Progress, StepRecord, unpack
from broker.settings import Settings
from broker.states import AttemptStatus, LedgerState, ProgressPhase, ResumeNote
from workers.attempt import Attempt
from workers.attempt_parts import AttemptParts
from workers.breakers import BreakerBoard
from workers.envport import check_prompt_answer, check_reset_answer, check_step_answer
from workers.modelclient import Completion
from workers.port_layers import POLICY_LAYERS, policy_port

pytestmark = pytest.mark.unit  # needs no server: make check runs it

JOB = "j1"
EP = "j1.e1"


class CountingEnvServer:
    """The env client's methods over instances held in memory: ``steps`` steps, reward 1 for
    the action "ok"; ``fail_step`` raises that error at that step of every instance."""

    def __init__(self, steps: int = 3, fail_step: int = 0, fail: errors.EpisodeError | None = None):
        self.steps, self.fail_step, self.fail = steps, fail_step, fail
        self.instances: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.closed: list[str] = []

    def reset(self, base_url, env_name, env_id, params, seed, *, deadline):
        self.calls.append(("reset", env_id))
        self.instances[env_id] = 0
        return check_reset_answer({}, "reset")

    def get_task_prompt(self, base_url, env_name, env_id, *, deadline):
        self.calls.append(("prompt", env_id))
        if env_id not in self.instances:
            raise errors.EpisodeError(errors.ENV_INSTANCE_LOST, "no such instance")
        return check_prompt_answer([{"role": "user", "content": f"step {self.instances[env_id] + 1}"}], "prompt")

    def step(self, base_url, env_name, env_id, action, *, deadline):
        self.calls.append(("step", env_id))
        self.instances[env_id] += 1
        n = self.instances[env_id]
        if n == self.fail_step and self.fail is not None:
            raise self.fail
        return check_step_answer({"reward": 1.0 if action == "ok" else 0.0, "terminated": n >= self.steps,
                                  "truncated": False, "info": {"n": n}}, "step")

    def close(self, base_url, env_name, env_id, *, deadline=None):
        self.closed.append(env_id)
        self.instances.pop(env_id, None)


class FakeModel:
    def __init__(self, answer: str = "ok"):
        self.answer = answer
        self.requests: list[dict] = []

    def complete(self, base_url, messages, *, model, temperature, params, deadline, api_key, **extra):
        self.requests.append(dict(base_url=base_url, messages=messages, params=params, api_key=api_key))
        return Completion(content=self.answer, finish_reason="stop", weight_version=None, latency_s=0.001)


class FakeLedger:
    def __init__(self, snapshot: Progress | None = None):
        self.finished: list[tuple[AttemptRecord, str, dict]] = []
        self.snapshot = snapshot
        self.extra_granted = 0
        self.marks: list[Progress] = []  # the snapshots written at once (stepping)

    def finish(self, lease, record, new_state, **kw):
        self.finished.append((record, new_state, kw))
        return not lease.lost.is_set()

    def finished_as(self, lease, new_state):
        return False

    def attempt_limit(self, job_id, episode_id, max_attempts):
        return max_attempts + self.extra_granted

    def grant_extra_attempt(self, job_id, episode_id, max_attempts):
        self.extra_granted += 1

    def progress(self, job_id, episode_id):
        return self.snapshot

    def mark(self, lease, snapshot):
        self.marks.append(snapshot)
        return not lease.lost.is_set()


class FakePublisher:
    def __init__(self):
        self.records: list[StepRecord] = []
        self.marks: list[Progress] = []

    def publish(self, lease, packed, *, check, waited, progress=None):
        check()
        self.records.append(unpack(packed))

    def mark(self, lease, snapshot):
        self.marks.append(snapshot)

    def flush(self, lease, timeout=None):
        return True


class FakePauseWatch:
    def __init__(self):
        self.failures: list[str] = []
        self.successes = 0

    def failed(self, job, episode_id, reason, detail):
        self.failures.append(reason)

    def succeeded(self, job):
        self.successes += 1


class FakeTrust:
    def __init__(self, refuse: str = ""):
        self.refuse = refuse

    def refused(self, job, spec):
        return self.refuse

    def api_key_for(self, job):
        return "sk-fake"


class NoJitter:
    def wait(self, check):
        check()


class NoVersions:
    def wrap(self, policy, job_id):
        return policy


class Nothing:
    def nudge(self):
        pass


@dataclasses.dataclass
class Fakes:
    env: CountingEnvServer = dataclasses.field(default_factory=CountingEnvServer)
    model: FakeModel = dataclasses.field(default_factory=FakeModel)
    ledger: FakeLedger = dataclasses.field(default_factory=FakeLedger)
    publisher: FakePublisher = dataclasses.field(default_factory=FakePublisher)
    pause_watch: FakePauseWatch = dataclasses.field(default_factory=FakePauseWatch)
    trust: FakeTrust = dataclasses.field(default_factory=FakeTrust)
    orphans: list[str] = dataclasses.field(default_factory=list)
    requeued: list[tuple] = dataclasses.field(default_factory=list)
    shutdown: bool = False

    def shut_down_after_first_step(self) -> None:
        """The worker's shutdown grace runs out as the first step's record is queued."""
        publish = self.publisher.publish

        def publish_then_shut_down(lease, packed, *, check, waited, progress=None):
            publish(lease, packed, check=check, waited=waited, progress=progress)
            self.shutdown = True
        self.publisher.publish = publish_then_shut_down

    def parts(self) -> AttemptParts:
        settings = Settings(redis_url="redis://unused:6379/0", outage_budget_s=1.0)
        return AttemptParts(
            settings=settings, worker="w1", ledger=self.ledger, publisher=self.publisher, renewer=Nothing(),
            pause_watch=self.pause_watch, trust=self.trust, breakers=BreakerBoard(None, None),
            env=self.env, model=self.model, model_gate=None, jitter=NoJitter(), pacing=None, fleet=None,
            versions=NoVersions(), keys=Keys("t"), queue_orphans=self.orphans.extend,
            requeue=self.requeued.extend, fault=lambda point, step: None,
            shutting_down=lambda: self.shutdown, unhealthy=lambda reason: None, redact=lambda t: t.replace("sk-fake", "***"))


def job_and_spec(**job_kw) -> tuple[JobSpec, EpisodeSpec]:
    job = JobSpec(job_id=JOB, llm_base_url="http://llm/v1", model="m", episodes=1, groups=1,
                  created_at=time.time(), **job_kw)
    spec = EpisodeSpec(job_id=JOB, episode_id=EP, group_id="g1", group_size=1, env_name="count",
                       base_url="http://env:1", env_params={})
    return job, spec


def lease(attempt: int = 1, attempt_id: str = "a1") -> Lease:
    return Lease(job_id=JOB, episode_id=EP, attempt=attempt, token=f"tok-{attempt}", attempt_id=attempt_id)


def attempt(fakes: Fakes, *, at: int = 1, earlier=(), progress=None, **job_kw) -> Attempt:
    job, spec = job_and_spec(**job_kw)
    return Attempt(fakes.parts(), lease(at, f"a{at}"), spec, job, earlier=earlier, progress=progress)


def test_a_completed_attempt_records_every_step_in_order_then_finishes_done():
    fakes = Fakes()
    assert attempt(fakes).run() == AttemptStatus.COMPLETED
    assert [r.step_id for r in fakes.publisher.records] == [1, 2, 3]
    assert all(r.attempt_id == "a1" for r in fakes.publisher.records)
    [(record, state, _)] = fakes.ledger.finished
    assert (state, record.status, record.total_reward, record.steps) == (LedgerState.DONE, AttemptStatus.COMPLETED, 3.0, 3)
    assert record.worker == "w1"
    # from the second step: prompted queued with the records, stepping written at once by the attempt
    assert [(m.phase, m.step) for m in fakes.publisher.marks] == [("prompted", 2), ("prompted", 3)]
    assert [(m.phase, m.step) for m in fakes.ledger.marks] == [("stepping", 2), ("stepping", 3)]
    assert fakes.env.closed == [env_instance_id(EP, 1, "a1")]  # the loop closed the instance it reset
    assert fakes.pause_watch.successes >= 1
    # the job's key went to its endpoint (the trust fake allows it), never into a record
    assert {r["api_key"] for r in fakes.model.requests} == {"sk-fake"}


def test_a_job_the_worker_refuses_is_dead_lettered_without_a_call_and_its_earlier_instances_queued():
    fakes = Fakes(trust=FakeTrust(refuse="env class os:abort is not allowed"))
    status = attempt(fakes, at=2, earlier=((1, "a0"),)).run()
    assert status == AttemptStatus.FAILED
    assert fakes.env.calls == [] and fakes.model.requests == []
    [(record, state, kw)] = fakes.ledger.finished
    assert state == LedgerState.FAILED and record.reason == errors.BAD_TASK and "os:abort" in record.error
    assert kw["dead_letter"] is not None
    [orphan] = [unpack(entry) for entry in fakes.orphans]
    assert orphan.instance_id == env_instance_id(EP, 1, "a0")


def test_a_transient_env_failure_with_attempts_left_is_retried_and_closes_its_instance():
    fakes = Fakes(env=CountingEnvServer(fail_step=2, fail=errors.EpisodeError(errors.ENV_SERVER_ERROR, "boom", transient=True)))
    assert attempt(fakes, max_attempts=3).run() == AttemptStatus.RETRYING
    [(record, state, kw)] = fakes.ledger.finished
    assert state == LedgerState.RETRYING and record.reason == errors.ENV_SERVER_ERROR and kw["retry_at"] > time.time()
    assert len(fakes.env.closed) == 1 and fakes.env.instances == {}


def test_the_last_attempt_failing_is_dead_lettered_with_the_key_starred_out():
    fakes = Fakes(env=CountingEnvServer(fail_step=1, fail=errors.EpisodeError(
        errors.ENV_SERVER_ERROR, "server said: bad key sk-fake", transient=True)))
    assert attempt(fakes, at=3, max_attempts=3).run() == AttemptStatus.FAILED
    [(record, state, kw)] = fakes.ledger.finished
    assert state == LedgerState.FAILED and "sk-fake" not in record.error and "***" in record.error
    assert kw["dead_letter"] is not None


def test_a_shutdown_hands_the_episode_back_keeping_its_instance_for_the_successor():
    fakes = Fakes()
    a = attempt(fakes)
    fakes.shut_down_after_first_step()
    assert a.run() == errors.WORKER_SHUTDOWN
    [(record, state, kw)] = fakes.ledger.finished
    assert state == LedgerState.QUEUED and record.status == AttemptStatus.ABANDONED
    assert kw["keep_progress"] is True and kw["progress"].step == 2
    assert fakes.requeued == [(JOB, EP, a.parts.settings.queue_for(a.spec))]
    assert fakes.env.closed == [] and len(fakes.env.instances) == 1  # kept for the successor
    assert fakes.ledger.extra_granted == 1  # a hand-back is not the episode's failure


def test_a_successor_continues_its_predecessors_instance_from_the_snapshot():
    fakes = Fakes()
    first = attempt(fakes)
    fakes.shut_down_after_first_step()
    first.run()
    snapshot = fakes.ledger.finished[0][2]["progress"]
    fakes.publisher = FakePublisher()
    fakes.ledger = FakeLedger(snapshot=snapshot)
    fakes.shutdown = False
    second = attempt(fakes, at=2, earlier=((1, "a1"),), progress=snapshot)
    assert second.run() == AttemptStatus.COMPLETED
    [(record, state, _)] = fakes.ledger.finished
    assert (record.trajectory, record.resumed_at, record.steps) == ("1:a1", 2, 3)
    assert [r.step_id for r in fakes.publisher.records] == [2, 3]
    assert [c for c in fakes.env.calls if c[0] == "reset"] == [("reset", fakes.env.calls[0][1])]  # one reset in all


def test_a_successor_whose_instance_is_gone_starts_afresh_in_the_same_attempt():
    fakes = Fakes()
    snapshot = Progress(trajectory="1:a1", writer="a1", step=2, phase=ProgressPhase.READY)
    fakes.ledger = FakeLedger(snapshot=snapshot)
    status = attempt(fakes, at=2, earlier=((1, "a1"),), progress=snapshot).run()
    assert status == AttemptStatus.COMPLETED
    [(record, _, _)] = fakes.ledger.finished
    assert (record.trajectory, record.resumed_at, record.resume_note) == ("", 0, ResumeNote.INSTANCE_GONE)


def test_a_lost_lease_ends_the_attempt_without_closing_the_episode():
    fakes = Fakes()
    a = attempt(fakes)
    a.lease.lost.set()
    assert a.run() == errors.LEASE_LOST
    assert fakes.ledger.finished == []


def test_the_policy_layers_are_applied_innermost_first_and_pass_the_request_through():
    fakes = Fakes()
    a = attempt(fakes)
    order = []

    class Tag:
        def __init__(self, name):
            self.name = name

        def wrap(self, inner, c):
            tag = self.name

            class Wrapped:
                def complete(self, messages, **request):
                    order.append(tag)
                    return inner.complete(messages, **request)
            return Wrapped()

    layers = (POLICY_LAYERS[0], Tag("inner"), Tag("outer"))
    port = policy_port(a.ports, layers)
    port.complete([{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    assert order == ["outer", "inner"]
    assert fakes.model.requests[-1]["params"]["tools"] == [{"type": "function"}]
    # the declared chain itself, as the docs name it
    assert [type(layer).__name__ for layer in POLICY_LAYERS] == ["Endpoint", "EntrySampling", "Paced", "Adaptive",
                                                                 "Versioned", "ProcessGate", "FleetCaps", "Cached"]


def test_the_response_cache_layer_is_outermost_and_only_there_for_a_job_with_cache():
    import dataclasses

    from workers.response_cache import CachedPolicy

    a = attempt(Fakes())
    c = a.ports
    assert not isinstance(policy_port(c), CachedPolicy)  # no --cache: not in the chain at all
    on = dataclasses.replace(c, job=dataclasses.replace(c.job, cache="on"))
    assert not isinstance(policy_port(on), CachedPolicy)  # a worker without a cache (this fake's parts)
    with_cache = dataclasses.replace(on, parts=dataclasses.replace(c.parts, cache=object()))
    port = policy_port(with_cache)
    assert isinstance(port, CachedPolicy) and not isinstance(port.inner, CachedPolicy)
