"""Fleet-wide limits (issue 25): jobs that pause when everything fails, caps on calls in flight
and on live env instances that hold across worker processes.

Real Redis, real worker processes, real HTTP servers on loopback. Nothing asserts on speed:
waits are generous and every figure checked is a count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from broker.caps import CAP_ENV_INSTANCES, CAP_MODEL, Limits
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.pause import JobPause
from broker.redisconn import connect
from producer.enqueue import plan, submit
from producer.taskfile import TaskFileError
from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.integration]


def arith_job(tmp_path, env_url: str, rows: int, extra: str = "", name: str = "job.yaml") -> str:
    data = [{"question": f"What is {i} + {i}?", "answer": 2 * i} for i in range(rows)]
    (tmp_path / "rows.json").write_text(json.dumps(data))
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: arithmetic
            base_url: {env_url}
            dataset: rows.json
        """) + textwrap.dedent(extra))
    return str(path)


def cli(settings, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)


# --- jobs that stop burning ----------------------------------------------------------------------
def test_job_pauses_when_every_attempt_fails_alike_and_resumes_once_fixed(settings, procs, env_server,
                                                                          model_server, tmp_path):
    """An env server that answers every reset 500: the job pauses after 5 episodes in a row
    failed, most of its episodes untouched (queued, not dead-lettered); status says why. With the
    server fixed, `interactor resume` and a re-drive of the dead letters finish every episode."""
    env_srv, env_url = env_server
    _, model_url = model_server
    env_srv.error_rate = 1.0  # every reset, prompt and step: 500
    settings = settings.replace(llm_base_url=model_url + "/v1", pause_after_failures=5, concurrency=3)
    procs.settings = settings
    rows = 60
    client = connect(settings)
    job = submit(client, settings, [arith_job(tmp_path, env_url, rows)]).job
    assert job.pause_after_failures == 5
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    pause = JobPause(client, Keys(settings.key_prefix))

    state = wait_for(lambda: pause.state(job.job_id), timeout=120, what="the job to pause")
    assert state.reason == "env_bad_request" and state.streak >= 5
    # the attempts running when it paused finish; nothing new starts
    wait_for(lambda: ledger.counts(job.job_id)["running"] == 0, timeout=60, what="running attempts to end")
    time.sleep(3 * settings.sweep_interval_s + 1)  # a sweep or two: nothing is re-sent while paused
    counts = ledger.counts(job.job_id)
    dead = len(DeadLetterQueue(client, settings).list(job_id=job.job_id))
    assert counts["running"] == 0 and counts["done"] == 0
    print(f"\n[pause] paused after {state.streak} failures alike; {counts['failed']} of {rows} dead-lettered, "
          f"{counts['queued']} waiting")
    # 5 to pause it, and those already started then: a few per worker slot at most
    assert counts["failed"] == dead <= 5 + 2 * 2 * 3, counts
    assert counts["queued"] + counts["retrying"] >= rows - 17, counts
    resets_when_paused = env_srv.stats()["faults"]["error"]
    time.sleep(2)
    assert env_srv.stats()["faults"]["error"] == resets_when_paused, "paused, yet episodes still start"

    status = cli(settings, "status", job.job_id)
    assert status.returncode == 0, status.stderr
    assert "PAUSED" in status.stdout and "env_bad_request" in status.stdout and "interactor resume" in status.stdout
    metrics = cli(settings, "metrics", "--once")
    assert f'interactor_job_paused{{job_id="{job.job_id}",reason="env_bad_request"}} 1.0' in metrics.stdout

    # the browser's job page says so too
    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import LiveState, Source

    wait_for(lambda: os.path.exists(settings.results_store), timeout=30, what="the results store")
    source = Source(open_store(settings.results_store, readonly=True), store_shown="s", live=LiveState(settings))
    page = create_app(source).test_client().get(f"/jobs/{job.job_id}").get_data(as_text=True)
    assert 'id="paused"' in page and "env_bad_request" in page and "interactor resume" in page

    env_srv.error_rate = 0.0  # fixed
    out = cli(settings, "resume", job.job_id)
    assert out.returncode == 0 and "resumed job" in out.stdout, out.stdout + out.stderr
    assert pause.state(job.job_id) is None
    out = cli(settings, "dlq", "redrive", "--job", job.job_id)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: ledger.counts(job.job_id)["done"] == rows, timeout=180,
             what=f"every episode done after the resume ({ledger.counts(job.job_id)})")
    assert ledger.counts(job.job_id)["failed"] == 0
    assert not pause.parked(job.job_id)
    # a job that sets no caps and no rate limits touched none: its calls cost no round trip for them
    prefix = settings.key_prefix
    assert not client.keys(f"{prefix}:cap:*") and not client.keys(f"{prefix}:rate*") and not client.exists(
        f"{prefix}:caps")


def test_resume_of_unknown_job_is_a_clear_error(settings):
    out = cli(settings, "resume", "no-such-job")
    assert out.returncode == 2 and "no job 'no-such-job'" in out.stderr


def test_success_ends_a_streak_and_only_the_same_reason_counts(settings, redis_client):
    pause = JobPause(connect(settings), Keys(settings.key_prefix))
    for i in range(4):
        assert not pause.record("j", "env_server_error", 5, episode_id=f"e{i}")
    pause.record("j", "", 5)  # a success: the streak starts over
    for i in range(4):
        assert not pause.record("j", "env_server_error", 5, episode_id=f"e{i}")
    assert not pause.record("j", "model_bad_request", 5, episode_id="e9")  # another reason: starts over too
    for i in range(3):
        assert not pause.record("j", "model_bad_request", 5, episode_id=f"e{i}")
    # an episode counts once, however many of its attempts failed
    for _ in range(5):
        assert not pause.record("j", "model_bad_request", 5, episode_id="e0")
    assert pause.record("j", "model_bad_request", 5, episode_id="e5")  # the fifth episode alike pauses
    assert not pause.record("j", "model_bad_request", 5, episode_id="e6")  # once
    assert not pause.record("j", "worker_shutdown", 5, episode_id="e7")  # not the job's doing: not counted
    assert pause.state("j").streak == 5
    assert "5 episodes in a row failed with model_bad_request" in pause.state("j").describe()


# --- task files and settings: caps checked at submit ----------------------------------------------
def test_limits_in_task_file_are_checked_at_submit(settings, tmp_path):
    url = "http://127.0.0.1:9"
    ok = arith_job(tmp_path, url, 3, extra=f"""\
        pause_after_failures: 7
        limits:
          model: {{max_concurrency: 4}}
          env_servers:
            "{url}/": {{max_concurrency: 8, max_instances: 2}}
          env_names:
            arithmetic: {{max_concurrency: 3}}
        """)
    planned = plan(settings, [ok])
    from producer.enqueue import job_spec

    spec = job_spec(settings.replace(llm_fleet_max_concurrency=99), "j1", planned)
    assert spec.pause_after_failures == 7
    lim = Limits.from_dict(spec.limits)
    assert lim.model == 4 and lim.env_servers == {url: {"max_concurrency": 8, "max_instances": 2}}
    assert lim.env_names == {"arithmetic": 3}
    # the settings fill in what the task file leaves out
    plain = plan(settings, [arith_job(tmp_path, url, 3, name="plain.yaml")])
    lim = Limits.from_dict(job_spec(settings.replace(llm_fleet_max_concurrency=5, env_fleet_max_instances=6),
                                    "j2", plain).limits)
    assert lim.model == 5 and lim.env_servers == {url: {"max_instances": 6}}

    bad = {
        "model: {max_concurrency: 0}": "max_concurrency must be an integer >= 1, got 0",
        "model: {max_concurrency: -3}": "must be an integer >= 1",
        "env_servers: {'http://127.0.0.1:10': {max_concurrency: 2}}": "matches no entry's base_url",
        "env_names: {sokoban: {max_concurrency: 2}}": "env_names 'sokoban' matches no entry's env_name",
        "model: {max_calls: 2}": "unknown key 'max_calls'",
        "judges: {}": "unknown key 'judges'",
    }
    for i, (text, message) in enumerate(bad.items()):
        path = arith_job(tmp_path, url, 2, extra="limits:\n  " + text + "\n", name=f"bad{i}.yaml")
        with pytest.raises(TaskFileError, match=message):
            plan(settings, [path])
    # at the command line: exit 2, one line naming the problem
    path = arith_job(tmp_path, url, 2, extra="limits:\n  model: {max_concurrency: 0}\n", name="cli.yaml")
    out = cli(settings, "submit", "--no-preflight", path)
    assert out.returncode == 2 and "max_concurrency must be an integer >= 1" in out.stderr, out.stderr
    out = cli(settings.replace(), "submit", "--no-preflight", "--llm-fleet-max-concurrency", "-1", path)
    assert out.returncode == 2 and "llm_fleet_max_concurrency must be >= 0" in out.stderr, out.stderr


# --- caps across worker processes -------------------------------------------------------------------
class _ConcurrencyProbe:
    """Wraps a stand-in server's request handling: counts requests in flight, keeps the peak."""

    def __init__(self, server, delay_s: float):
        self.now = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.delay_s = delay_s
        self.server = server

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.delay_s)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def _probe_model(server, delay_s: float) -> _ConcurrencyProbe:
    probe = _ConcurrencyProbe(server, delay_s)
    base = server.RequestHandlerClass

    class Probed(base):  # type: ignore[misc, valid-type]
        def chat(self, session, body):
            probe.enter()
            try:
                return super().chat(session, body)
            finally:
                probe.leave()

    server.RequestHandlerClass = Probed
    return probe


def test_model_cap_holds_across_four_workers_and_a_killed_workers_slots_come_back(settings, procs, env_server,
                                                                               model_server, tmp_path):
    """4 worker processes x 50 episodes each against a model that takes 0.2 s per answer, with
    a fleet cap of 6: the model never sees more than 6 requests at once. A worker SIGKILLed
    while holding slots: its slots lapse within the lease TTL and the job still finishes."""
    _, env_url = env_server
    model_srv, model_url = model_server
    probe = _probe_model(model_srv, 0.2)
    cap = 6
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=50, llm_fleet_max_concurrency=cap)
    procs.settings = settings
    rows = 240
    client = connect(settings)
    job = submit(client, settings, [arith_job(tmp_path, env_url, rows)]).job
    assert Limits.from_dict(job.limits).model == cap
    for i in range(4):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    cap_key = Keys(settings.key_prefix).cap(CAP_MODEL, model_url + "/v1")

    # a worker holding slots: its holder names start with its runtime name (host-pid)
    victim = procs.procs["w2"]
    import psutil

    pids: set[str] = set()

    def victim_holders() -> list[str]:
        if victim.poll() is None:  # its Celery process is a child the supervisor starts
            pids.update(str(p.pid) for p in psutil.Process(victim.pid).children(recursive=True))
        return [m.decode() for m in client.zrange(cap_key, 0, -1)
                if m.decode().rsplit(":", 1)[0].rsplit("-", 1)[-1] in pids]

    wait_for(victim_holders, timeout=120, interval=0.05, what="the victim worker to hold a model slot")
    procs.kill("w2")
    # lapsed slots are swept by the next acquire anyone makes: the victim's go within the TTL
    # (plus slack for a busy machine)
    wait_for(lambda: not victim_holders(), timeout=settings.lease_ttl_s + 15, interval=0.1,
             what="the killed worker's slots to lapse")
    wait_for(lambda: ledger.counts(job.job_id)["done"] == rows, timeout=300,
             what=f"every episode done ({ledger.counts(job.job_id)})")
    assert 1 <= probe.peak <= cap, probe.peak
    print(f"\n[fleet cap] peak model requests in flight {probe.peak} (cap {cap}), {rows} episodes")
    status = cli(settings, "status")
    assert f"cap        model {model_url}/v1:" in status.stdout and f"/{cap} in use" in status.stdout, status.stdout


def _refuse_above(server, k: int) -> dict:
    """Makes an env server refuse (429) a reset that would take it above ``k`` live instances,
    as a sandbox-backed server at capacity does; counts refusals and the peak of live ones."""
    seen = {"refused": 0, "peak": 0}
    gate = threading.Lock()
    base = server.RequestHandlerClass

    class Refusing(base):  # type: ignore[misc, valid-type]
        def reset(self, env_name, env_id, payload):
            with gate:  # one reset at a time: the count and the creation go together
                with server.lock:
                    live, known = len(server.instances), (env_name, env_id) in server.instances
                if live >= k and not known:
                    seen["refused"] += 1
                    return self.send_json(429, {"error": f"at capacity: {live} live instances"})
                super().reset(env_name, env_id, payload)
                with server.lock:
                    seen["peak"] = max(seen["peak"], len(server.instances))

    server.RequestHandlerClass = Refusing
    return seen


def test_env_instance_cap_keeps_a_sandbox_server_within_its_capacity(settings, procs, env_server, model_server,
                                                                     tmp_path):
    """An env server that holds at most 4 live instances (reset, not yet closed), 2 worker
    processes x 20 multi-turn episodes, the task file capping the server's instances at 4:
    not one reset is refused, and every episode completes."""
    env_srv, env_url = env_server
    _, model_url = model_server
    k = 4
    seen = _refuse_above(env_srv, k)
    env_srv.latency_ms = 20  # instances live a while: several turns of 20 ms calls each
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=20)
    procs.settings = settings
    path = tmp_path / "guess.yaml"
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{max_turns: 4, high: 64}}
            env_num: 40
        limits:
          env_servers:
            {env_url}: {{max_instances: {k}}}
        """))
    client = connect(settings)
    job = submit(client, settings, [str(path)]).job
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    wait_for(lambda: ledger.counts(job.job_id)["done"] == 40, timeout=300,
             what=f"every episode done ({ledger.counts(job.job_id)})")
    print(f"\n[instance cap] peak live instances {seen['peak']} (cap {k}), refused {seen['refused']}")
    assert seen["refused"] == 0
    assert 1 <= seen["peak"] <= k
    key = Keys(settings.key_prefix).cap(CAP_ENV_INSTANCES, env_url)
    wait_for(lambda: client.zcard(key) == 0, timeout=30, what="every instance slot released")
    # every attempt's phases reach the metrics (records v5) and the status line
    def phase_count() -> float:
        out = cli(settings, "metrics", "--once").stdout
        lines = [ln for ln in out.splitlines() if ln.startswith("interactor_phase_seconds_count")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'phase="reset"' in ln)

    wait_for(lambda: phase_count() >= 40, timeout=60, what="phase timings in the metrics")
    status = cli(settings, "status").stdout
    assert "phases     per attempt, mean: queue_wait" in status and "env_step" in status, status
    assert f"cap        env_instances {env_url}: 0/{k} in use" in status, status
    snap = json.loads(cli(settings, "status", "--json").stdout)
    assert {"kind": "env_instances", "name": env_url, "limit": k, "in_use": 0} in snap["caps"]


# --- rate limits --------------------------------------------------------------------------------------
class _RpmLimiter:
    """A model server's requests-per-minute limit, as hosted APIs enforce it: a bucket refilled
    continuously (``rpm / 60`` a second, holding one second's worth), a 429 with Retry-After and
    the x-ratelimit headers past it. It starts empty (another client just used it up), so the
    fleet's first request is refused."""

    def __init__(self, server, rpm: int):
        self.rate = rpm / 60.0
        self.cap = self.rate
        self.tokens = 0.0
        self.t: float | None = None  # empty when the first request comes
        self.lock = threading.Lock()
        self.refused = 0
        self.served: list[float] = []
        self.answers: list[int] = []  # statuses, in order
        self.refused_at: list[float] = []  # when each 429 was answered (monotonic)
        limiter = self
        base = server.RequestHandlerClass

        class Limited(base):  # type: ignore[misc, valid-type]
            def chat(self, session, body):
                with limiter.lock:
                    now = time.monotonic()
                    limiter.t = limiter.t or now
                    limiter.tokens = min(limiter.cap, limiter.tokens + (now - limiter.t) * limiter.rate)
                    limiter.t = now
                    ok = limiter.tokens >= 1
                    limiter.answers.append(200 if ok else 429)
                    if ok:
                        limiter.tokens -= 1
                        limiter.served.append(now)
                    else:
                        limiter.refused += 1
                        limiter.refused_at.append(now)
                        wait = (1 - limiter.tokens) / limiter.rate
                if not ok:
                    return self.send_json(429, {"error": {"message": "Rate limit reached for requests",
                                                          "type": "requests", "code": "rate_limit_exceeded"}},
                                          headers={"Retry-After": f"{wait:.3f}",
                                                   "x-ratelimit-remaining-requests": "0",
                                                   "x-ratelimit-reset-requests": f"{int(wait * 1000)}ms"})
                return super().chat(session, body)

        server.RequestHandlerClass = Limited


def test_fleet_stays_under_the_model_rpm_limit(settings, procs, env_server, model_server, tmp_path):
    """A model server allowing 240 requests a minute, 2 worker processes x 20 single-turn
    episodes, the job's requests_per_minute at 240: after the first 429 (the server's bucket
    starts empty) the fleet stays under the limit (429s only for what was already on its way),
    no attempt fails,
    and the server serves at least 90% of its limit."""
    _, env_url = env_server
    model_srv, model_url = model_server
    rpm, rows = 240, 100
    limiter = _RpmLimiter(model_srv, rpm)
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=20, llm_backoff_max_s=5)
    procs.settings = settings
    client = connect(settings)
    path = arith_job(tmp_path, env_url, rows, extra=f"limits:\n  model: {{requests_per_minute: {rpm}}}\n")
    job = submit(client, settings, [path]).job
    assert Limits.from_dict(job.limits).model_rpm == rpm
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    status_seen = wait_for(lambda: (lambda out: out if "rate       model" in out else "")(cli(settings, "status").stdout),
                           timeout=60, what="status showing the rate bucket")
    assert f"({rpm}/min)" in status_seen
    wait_for(lambda: ledger.counts(job.job_id)["done"] == rows, timeout=300,
             what=f"every episode done ({ledger.counts(job.job_id)})")
    served = limiter.served
    achieved = (len(served) - 1) / (served[-1] - served[0]) * 60
    print(f"\n[rpm] limit {rpm}/min, achieved {achieved:.0f}/min over {len(served)} requests, "
          f"429s {limiter.refused}")
    # The first (the bucket started empty) and those already on their way with it; none once
    # the fleet knew. "On their way" is what the fleet's own bucket let through before the
    # first 429 came back: at most about a second's worth, arriving within a second of it
    # (more on a loaded machine, where an answer takes longer to be read).
    assert 1 <= limiter.refused <= 1 + 2 * rpm // 60, (limiter.refused, limiter.answers[:20])
    first = limiter.refused_at[0]
    assert all(t - first <= 1.5 for t in limiter.refused_at), [round(t - first, 3) for t in limiter.refused_at]
    assert ledger.counts(job.job_id)["failed"] == 0
    attempts = [ledger.attempts(job.job_id, e) for e in ledger.states(job.job_id)]
    assert max(attempts) == 1, "an attempt failed"
    assert achieved >= 0.9 * rpm


def test_token_bucket_charges_usage_and_a_hold_stops_everyone(settings):
    from broker.ratelimit import RateLimits, parse_reset

    rates = RateLimits(connect(settings), Keys(settings.key_prefix))
    assert rates.take("m", 0, 6000) == 0  # tokens left: go
    rates.charge("m", 6000, 500)  # the answer used 500: the bucket (100 a second) is ~400 short
    wait = rates.take("m", 0, 6000)
    assert 3.0 < wait <= 4.2, wait
    assert rates.take("other", 600, 0) == 0  # another endpoint is not held up
    rates.hold("other", 0.5)  # a 429 said: wait half a second
    assert 0 < rates.take("other", 600, 0) <= 0.51
    left_r, left_t, hold = rates.levels("other", 600, 0)
    assert left_t == -1 and 0 < hold <= 0.51
    assert parse_reset("6m0s") == 360 and parse_reset("20ms") == 0.02 and parse_reset("1.5") == 1.5
    assert parse_reset("1s500ms") == 1.5 and parse_reset("soon") is None and parse_reset("") is None


# --- per-phase timings (records v5) -------------------------------------------------------------------
def test_timings_tell_each_phase_and_older_records_still_decode():
    import msgpack
    from types import SimpleNamespace

    from broker.records import AttemptRecord, StepRecord, unpack
    from workers.hooks import NullHook
    from workers.loop import LoopConfig, PhaseTimings, run_episode

    class SlowEnv:
        def __init__(self):
            self.turn = 0

        def reset(self):
            time.sleep(0.05)

        def get_task_prompt(self):
            time.sleep(0.02)
            return [{"role": "user", "content": f"turn {self.turn}"}]

        def step(self, action):
            time.sleep(0.03)
            self.turn += 1
            return SimpleNamespace(reward=1.0, terminated=self.turn == 2, truncated=False, info={})

        def close(self):
            time.sleep(0.04)

    class SlowPolicy:
        def complete(self, messages):
            time.sleep(0.06)
            return SimpleNamespace(content="a", finish_reason="stop", weight_version=None)

    steps: list[StepRecord] = []
    tm = PhaseTimings()
    cfg = LoopConfig(job_id="j", episode_id="e", env_name="x", group_id="g", llm_model="m")
    run_episode(cfg, env=SlowEnv(), policy=SlowPolicy(), publish=steps.append, hook=NullHook(), timings=tm)
    assert tm.reset_s >= 0.05 and tm.prompt_s >= 0.04 and tm.model_s >= 0.12 and tm.env_step_s >= 0.06
    assert tm.close_s >= 0.04
    first, second = (unpack(s.pack()) for s in steps)
    assert first.reset_s >= 0.05 and second.reset_s is None
    assert first.prompt_s >= 0.02 and first.env_step_s >= 0.03 and first.model_latency_s >= 0.06
    rec = AttemptRecord(job_id="j", episode_id="e", attempt=1, status="completed", group_id="g", group_size=1,
                        env_name="x", llm_model="m", queue_wait_s=1.5, **tm.record_fields())
    back = unpack(rec.pack())
    assert back.phases()["queue_wait"] == 1.5 and back.phases()["model"] == tm.model_s
    # a v3 attempt record (no timings) still decodes, its timings None
    old = {k: v for k, v in rec.to_dict().items() if k not in ("queue_wait_s", "reset_s", "prompt_s", "model_s",
                                                                "env_step_s", "close_s")}
    old["v"] = 3
    back = unpack(msgpack.packb(old, use_bin_type=True))
    assert back.model_s is None and back.phases() == {}


def test_env_server_and_env_name_caps_hold_together(settings, procs, env_server, model_server, tmp_path):
    """Two env_names on one env server, 2 worker processes x 15 episodes: the server capped at
    4 calls in flight and arithmetic at 2. The server never sees more than 4 calls at once, nor
    more than 2 of arithmetic's."""
    env_srv, env_url = env_server
    _, model_url = model_server
    env_srv.latency_ms = 30
    peaks = {"all": 0, "arithmetic": 0}
    now = {"all": 0, "arithmetic": 0}
    lock = threading.Lock()
    base = env_srv.RequestHandlerClass

    class Probed(base):  # type: ignore[misc, valid-type]
        def env_call(self, op, env_name, env_id, body):
            names = ["all"] + (["arithmetic"] if env_name == "arithmetic" else [])
            with lock:
                for n in names:
                    now[n] += 1
                    peaks[n] = max(peaks[n], now[n])
            try:
                return super().env_call(op, env_name, env_id, body)
            finally:
                with lock:
                    for n in names:
                        now[n] -= 1

    env_srv.RequestHandlerClass = Probed
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=15)
    procs.settings = settings
    data = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(30)]
    (tmp_path / "rows.json").write_text(json.dumps(data))
    path = tmp_path / "two.yaml"
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: arithmetic
            base_url: {env_url}
            dataset: rows.json
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{max_turns: 3, high: 16}}
            env_num: 30
        limits:
          env_servers:
            {env_url}: {{max_concurrency: 4}}
          env_names:
            arithmetic: {{max_concurrency: 2}}
        """))
    client = connect(settings)
    job = submit(client, settings, [str(path)]).job
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    wait_for(lambda: ledger.counts(job.job_id)["done"] == 60, timeout=300,
             what=f"every episode done ({ledger.counts(job.job_id)})")
    print(f"\n[env caps] peak calls in flight {peaks['all']} (cap 4), arithmetic {peaks['arithmetic']} (cap 2)")
    assert 1 <= peaks["all"] <= 4 and 1 <= peaks["arithmetic"] <= 2, peaks


def test_a_job_whose_attempts_fail_now_and_then_does_not_pause(settings, procs, env_server, model_server, tmp_path):
    """An env server failing 8% of calls: attempts fail now and then, between successes, and the
    job (pausing after 8 alike in a row) runs to its end without pausing."""
    env_srv, env_url = env_server
    _, model_url = model_server
    env_srv.error_rate = 0.08
    settings = settings.replace(llm_base_url=model_url + "/v1", pause_after_failures=8, concurrency=4)
    procs.settings = settings
    rows = 80
    client = connect(settings)
    job = submit(client, settings, [arith_job(tmp_path, env_url, rows)]).job
    counts, paused = run_watching_for_a_pause(settings, procs, client, job.job_id, rows)
    faults = env_srv.stats()["faults"]["error"]
    print(f"\n[no pause] {faults} injected 500s, {counts}")
    assert faults > 0 and paused is None


def test_a_frozen_workers_slots_come_back_and_it_carries_on_after(settings, procs, env_server, model_server,
                                                                  tmp_path):
    """A worker frozen (SIGSTOP) while it holds model slots under a fleet cap of 4: its slots
    lapse within the lease TTL, so the other worker goes on using them; thawed, it carries on
    and the job finishes."""
    import signal

    import psutil

    _, env_url = env_server
    model_srv, model_url = model_server
    _probe_model(model_srv, 0.2)
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=20, llm_fleet_max_concurrency=4)
    procs.settings = settings
    rows = 120
    client = connect(settings)
    job = submit(client, settings, [arith_job(tmp_path, env_url, rows)]).job
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    cap_key = Keys(settings.key_prefix).cap(CAP_MODEL, model_url + "/v1")
    victim = procs.procs["w1"]

    def victim_pids() -> set[str]:
        return {str(p.pid) for p in psutil.Process(victim.pid).children(recursive=True)} | {str(victim.pid)}

    def victim_holders() -> list[str]:
        pids = victim_pids()
        return [m.decode() for m in client.zrange(cap_key, 0, -1)
                if m.decode().rsplit(":", 1)[0].rsplit("-", 1)[-1] in pids]

    wait_for(victim_holders, timeout=120, interval=0.05, what="the victim worker to hold a model slot")
    frozen = [psutil.Process(victim.pid)] + psutil.Process(victim.pid).children(recursive=True)
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        done_then = ledger.counts(job.job_id)["done"]
        wait_for(lambda: not victim_holders(), timeout=settings.lease_ttl_s + 15, interval=0.1,
                 what="the frozen worker's slots to lapse")
        # the other worker goes on with the slots
        wait_for(lambda: ledger.counts(job.job_id)["done"] >= done_then + 8, timeout=120,
                 what="the other worker to go on")
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    wait_for(lambda: ledger.counts(job.job_id)["done"] == rows, timeout=300,
             what=f"every episode done ({ledger.counts(job.job_id)})")


def test_a_job_whose_attempts_mostly_fail_but_get_on_does_not_pause(settings, procs, env_server, model_server,
                                                                     tmp_path):
    """An env server failing 30% of calls under multi-turn episodes started afresh at every
    attempt (`resume: false`): almost no attempt completes (each needs a dozen calls to pass), so
    completions alone would leave 20 episodes failing in a row between them and pause the job.
    But most attempts complete a turn before they fail: the servers work, and the job runs to its
    end (its episodes completed or dead-lettered after their attempts) without pausing."""
    env_srv, env_url = env_server
    _, model_url = model_server
    env_srv.error_rate = 0.3
    settings = settings.replace(llm_base_url=model_url + "/v1", concurrency=16)
    procs.settings = settings
    rows = 150
    (tmp_path / "ranges.jsonl").write_text("".join(json.dumps({"low": 1, "high": 64}) + "\n" for _ in range(rows)))
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(f"""\
        resume: false
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{max_turns: 8}}
            dataset: ranges.jsonl
        """))
    client = connect(settings)
    job = submit(client, settings, [str(path)]).job
    assert job.pause_after_failures == 20  # the default
    counts, paused = run_watching_for_a_pause(settings, procs, client, job.job_id, rows)
    faults = env_srv.stats()["faults"]["error"]
    print(f"\n[no pause, mostly failing] {faults} injected 500s, {counts}, paused: {paused}")
    assert paused is None
    assert faults >= 100 and counts["failed"] > counts["done"]  # attempts did mostly fail


def run_watching_for_a_pause(settings, procs, client, job_id: str, rows: int):
    """Two workers and a consumer run the job until its ``rows`` episodes are finished or it
    pauses: (the ledger's counts, the pause state or None)."""
    for i in range(2):
        procs.worker(f"w{i}")
    procs.consumer()
    ledger = Ledger.for_settings(client, settings)
    pause = JobPause(client, Keys(settings.key_prefix))
    seen = []
    wait_for(lambda: seen.append(pause.state(job_id)) or seen[-1] is not None or
             ledger.counts(job_id)["done"] + ledger.counts(job_id)["failed"] == rows,
             timeout=300, what=f"every episode finished ({ledger.counts(job_id)})")
    return ledger.counts(job_id), seen[-1]
