"""Faults that the first fault suite could not see (tests/test_faults.py's Scenario, same checks):

* a worker frozen (SIGSTOP) past its lease, then thawed: its attempts stop driving their env
  instances at once, and the successors' instances are their own; once on an idle machine and
  once with every core kept busy by other processes (a CPU hog), where the healthy worker must
  not lose a lease either;
* Redis losing the last second of its append-only file (a host crash under
  ``appendfsync everysec``): the ledger rolls back under a database that is ahead of it;
* an env server and a model server down for longer than any retry: breakers hold the
  episodes, nothing is dead-lettered, the outage is visible;
* the results store refusing writes (a full disk for SQLite, a read-only PostgreSQL): the
  consumer waits, workers are held by backpressure, nothing is parked or lost.

Each runs one store backend (SQLite unless the fault is PostgreSQL's): they take minutes.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time

import pytest

from broker.keys import env_instance_id
from consumer.storage import open_store
from tests.conftest import wait_for
from tests.test_faults import EPISODES, Scenario

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture
def sqlite_scenario(settings, tmp_path):
    made = []

    def make(name, **kw):
        s = Scenario(name, tmp_path, settings.replace(store_url=str(tmp_path / "results.sqlite")), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def winning_instances(s: Scenario) -> dict[str, str]:
    """episode id -> the env instance its completed attempt drove."""
    store = open_store(s.settings.results_store, readonly=True)
    try:
        rows = store.sql("SELECT episode_id, attempt, completed_attempt_id FROM episodes WHERE job_id = ?",
                         (s.job_id,))
    finally:
        store.close()
    return {ep: env_instance_id(ep, attempt, aid) for ep, attempt, aid in rows if aid}


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def attempt_lines(s: Scenario, env_id: str) -> list[str]:
    """What the workers logged about the attempt that drove ``env_id``."""
    episode, rest = env_id.split("~", 1)
    attempt = rest.split("-", 1)[0]
    needle = f"episode {episode} attempt {attempt}"
    return [f"{name}: {line}" for name in s.procs.procs for line in s.procs.log(name).splitlines()
            if needle in line or (episode in line and "lease" in line)]


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_worker_frozen_past_its_lease_stops_driving_its_instances(sqlite_scenario, cpu_hog, load):
    # Resume off: a successor resets an instance of its own, so that every call the frozen
    # worker makes after the thaw is on an instance of its own, told apart in the env's log.
    # (With resume on, the successor continues the frozen attempt's instance; that the stalled
    # worker then calls nothing on it is tests/test_resume.py's.)
    s = sqlite_scenario("worker-sigstop", env_knobs={"log_requests": True}, model_latency_ms=400, max_attempts=5,
                        no_resume=True)
    if load == "busy":
        cpu_hog.start()
    s.start()
    wait_for(lambda: s.counts()["done"] >= 10, 120, what="the job under way")
    # The supervisor and the Celery worker it runs in a session of its own.
    frozen = [s.procs.procs["w1"].pid, *children(s.procs.procs["w1"].pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    t_stop = time.time()
    time.sleep(s.settings.lease_ttl_s * 3)  # the sweeper hands w1's episodes to w2 meanwhile
    t_cont = time.time()
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    s.faults["frozen_s"] = round(t_cont - t_stop, 1)
    s.wait(timeout=300)
    if load == "busy":
        assert cpu_hog.running  # the cores were taken until the job was done
        cpu_hog.stop()
    f = s.check()
    assert f.completed == EPISODES and f.dead_lettered == 0
    assert f.attempts > EPISODES  # the freeze did cost attempts

    won = winning_instances(s)
    superseded: dict[str, list[tuple[float, str]]] = {}
    for t, op, _env_name, env_id in list(s.env.request_log):
        episode = env_id.split("~", 1)[0]
        if env_id != won.get(episode):
            superseded.setdefault(env_id, []).append((t, op))
    assert superseded, "no attempt was superseded: the freeze did not land mid-episode"
    # Only the frozen worker's attempts lost their leases: the healthy one, busy machine or not,
    # kept every lease it took (its runner logs an attempt that stopped for a lost lease, or
    # whose end it could not record for one).
    healthy = [line for line in s.procs.log("w2").splitlines()
               if " abandoned: " in line or "lease lost before completion" in line]
    assert not healthy, healthy
    s.faults["healthy_late_renewal_rounds"] = s.procs.log("w2").count("lease renewal round")
    # After the thaw a superseded instance saw nothing but its close, bar one call: the one its
    # attempt was already past its last lease check for when the process stopped (sent as the
    # process resumed). Its next check waits for the renewer, which finds the lease lost.
    late: dict[str, list[tuple[str, float]]] = {}
    for env_id, calls in superseded.items():
        for t, op in calls:
            if op != "close" and t > t_cont:
                late.setdefault(env_id, []).append((op, round(t - t_cont, 2)))
    assert all(len(calls) == 1 and calls[0][1] < 1.0 for calls in late.values()), (late, [
        line for env_id in late for line in attempt_lines(s, env_id)])
    # And every superseded instance was opened before the freeze, or by that one late call (an
    # attempt stopped between its check and its reset). A request the process sent just before
    # it stopped may be logged by this (busy) test process a little after t_stop.
    # (Closes do not count: a successor closes its predecessor's instance, opened or not.)
    in_flight_s = 0.5
    opened_late = {env_id: [(op, round(t - t_stop, 2)) for t, op in calls]
                   for env_id, calls in superseded.items()
                   if env_id not in late and min((t for t, op in calls if op != "close"), default=0) >= t_stop + in_flight_s}
    assert not opened_late, (t_stop, t_cont, opened_late,
                             [line for env_id in opened_late for line in attempt_lines(s, env_id)])
    s.faults["superseded_instances"] = len(superseded)
    s.faults["calls_after_thaw"] = sum(len(calls) for calls in late.values())
    f.print()


class AofWatch(threading.Thread):
    """Samples the size of Redis's append-only file, to cut it back to where it was a second
    ago: what a host crash under ``appendfsync everysec`` leaves on disk."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path = path
        self.sizes: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            try:
                self.sizes.append((time.monotonic(), os.path.getsize(self.path)))
            except OSError:
                pass

    def size_ago(self, seconds: float) -> int:
        cutoff = time.monotonic() - seconds
        return max(size for t, size in self.sizes if t <= cutoff)


def test_redis_loses_the_last_second_of_its_log(sqlite_scenario):
    s = sqlite_scenario("redis-aof-tail-lost", model_latency_ms=100, max_attempts=6)
    s.start()
    aof = s.redis.folder / "appendonly.aof"
    watch = AofWatch(aof)
    watch.start()
    losses = []
    for target in (40, 120):
        wait_for(lambda: s.counts()["done"] >= target, 180, what=f"{target} episodes done")
        cut = watch.size_ago(1.0)
        s.redis.stop(kill=True)
        before = aof.stat().st_size
        os.truncate(aof, cut)
        losses.append(before - cut)
        s.redis.start()
    watch.stopped.set()
    s.faults["aof_bytes_lost"] = losses
    assert all(n > 0 for n in losses)  # writes were lost each time
    s.wait(timeout=400)
    f = s.check()
    # The database may have been ahead of the rolled-back ledger: an episode the consumer stored
    # as completed can be re-run, but it is completed once, with one attempt's trajectory.
    assert f.completed == EPISODES and f.dead_lettered == 0


def breaker_seen(s: Scenario, kind: str) -> bool:
    from interactor.fleet_reader import FleetReader

    return any(b["kind"] == kind for b in FleetReader(s.client, s.settings).breakers())


def test_env_server_down_for_longer_than_any_retry(sqlite_scenario):
    from examples.envserver import EnvServer

    s = sqlite_scenario("env-server-down", model_latency_ms=100, outage_budget_s=300, max_attempts=3)
    s.start()
    wait_for(lambda: s.counts()["done"] >= 30, 120, what="30 episodes done")
    port = s.env.server_address[1]
    s.env.shutdown()
    s.env.server_close()
    down_s = 25
    seen = wait_for(lambda: breaker_seen(s, "env"), 20, what="the env breaker open in Redis")
    time.sleep(down_s)
    # Back on the same address, without the instances the old process held (a restart).
    s.env, _ = EnvServer("127.0.0.1", port, latency_ms=5).serve_in_thread("envserver")
    s.faults["env_down_s"] = down_s
    s.wait(timeout=300)
    wait_for(lambda: not breaker_seen(s, "env"), 30, what="the env breaker closed")
    f = s.check()
    assert seen and f.completed == EPISODES and f.dead_lettered == 0


def test_model_server_unavailable_for_longer_than_any_retry(sqlite_scenario):
    s = sqlite_scenario("model-unavailable", model_latency_ms=100, outage_budget_s=300, max_attempts=3)
    s.start()
    wait_for(lambda: s.counts()["done"] >= 30, 120, what="30 episodes done")
    s.model.unavailable = True
    seen = wait_for(lambda: breaker_seen(s, "model"), 20, what="the model breaker open in Redis")
    time.sleep(20)
    s.model.unavailable = False
    s.faults["model_unavailable_s"] = 20
    s.wait(timeout=300)
    f = s.check()
    # The model answered 503 without taking anything: no attempt ended for it.
    assert seen and f.completed == EPISODES and f.dead_lettered == 0
    assert f.attempts == EPISODES


def _outage_checks(s: Scenario, consumer_pid: int, f) -> None:
    assert f.completed == EPISODES and f.dead_lettered == 0
    assert s.procs.procs["consumer"].pid == consumer_pid and s.procs.procs["consumer"].poll() is None
    from broker.keys import Keys

    assert s.client.xlen(Keys(s.settings.key_prefix).poison) == 0  # nothing was parked as bad data: the store was down, not the records


def test_consumer_disk_full_waits_and_loses_nothing(sqlite_scenario):
    s = sqlite_scenario("sqlite-disk-full", model_latency_ms=60, stream_backlog_max=300)
    s.start()
    consumer = s.procs.procs["consumer"]
    wait_for(lambda: s.counts()["done"] >= 20, 120, what="20 episodes done")
    soft, hard = resource.prlimit(consumer.pid, resource.RLIMIT_FSIZE)
    # Any write that grows a file past 4 KiB now fails with EFBIG: a full disk to SQLite.
    resource.prlimit(consumer.pid, resource.RLIMIT_FSIZE, (4096, hard))
    time.sleep(12)
    assert "results store unavailable (OperationalError: disk" in s.procs.log("consumer")
    resource.prlimit(consumer.pid, resource.RLIMIT_FSIZE, (soft, hard))
    s.faults["disk_full_s"] = 12
    s.wait(timeout=300)
    f = s.check()
    _outage_checks(s, consumer.pid, f)


@pytest.fixture
def pg_url(request):
    return request.getfixturevalue("pg_server").create_database()


def test_consumer_on_read_only_postgres_waits_and_loses_nothing(settings, tmp_path, pg_url):
    import psycopg

    s = Scenario("postgres-read-only", tmp_path, settings.replace(store_url=pg_url), model_latency_ms=60,
                 stream_backlog_max=300)
    try:
        s.start()
        consumer = s.procs.procs["consumer"]
        wait_for(lambda: s.counts()["done"] >= 20, 120, what="20 episodes done")
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            conn.execute("SELECT pg_reload_conf()")
            # Sessions already open keep their setting until they reconnect or are ended.
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        time.sleep(12)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            conn.execute("SELECT pg_reload_conf()")
        s.faults["read_only_s"] = 12
        assert "results store unavailable (ReadOnlySqlTransaction" in s.procs.log("consumer")
        s.wait(timeout=300)
        f = s.check()
        _outage_checks(s, consumer.pid, f)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:  # the server is shared by the session
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            conn.execute("SELECT pg_reload_conf()")
        s.close()


def test_worker_kills_and_a_redis_restart_on_a_busy_machine(sqlite_scenario, cpu_hog):
    """The two faults a fleet meets most, with every core taken by other work (a shared CI
    runner, a laptop building something): workers SIGKILLed again and again and Redis killed and
    restarted from its log. Every episode completes once; no healthy worker loses a lease to the
    load (the renewer keeps up), and killed workers cost attempts, never episodes."""
    s = sqlite_scenario("busy-kills-and-redis", max_attempts=10, model_latency_ms=150)
    cpu_hog.start()
    s.start()
    starts = {f"w{i + 1}": 1 for i in range(s.n_workers)}
    t0 = time.monotonic()

    def chaos(s: Scenario):
        now = time.monotonic() - t0
        if now > 3 and not s.faults.get("redis_restarts"):
            s.redis.restart(kill=True, down_s=1.0)
            s.faults["redis_restarts"] = 1
        if now > 2 + 3 * s.faults.get("worker_kills", 0) and s.faults.get("worker_kills", 0) < 3:
            name = f"w{1 + s.faults.get('worker_kills', 0) % s.n_workers}"
            if s.procs.log(name).count(" ready.") >= starts[name]:  # up again since its last start
                s.procs.kill(name)
                s.faults["worker_kills"] = s.faults.get("worker_kills", 0) + 1
                s.procs.worker(name)
                starts[name] += 1

    s.wait(chaos, timeout=600)
    assert cpu_hog.running  # the cores were taken until the job was done
    cpu_hog.stop()
    f = s.check()
    assert f.completed == EPISODES and f.duplicate_steps == 0 and f.superseded_in_export == 0
    assert s.faults.get("redis_restarts") == 1 and s.faults.get("worker_kills", 0) >= 1


def test_idle_workers_stop_at_once_after_a_redis_restart(settings, tmp_path, env_server, model_server):
    """Redis restarted (as `docker compose restart redis` does: shut down, its log kept) while
    short episodes run; once the job is done, idle workers asked to stop (SIGTERM) exit 0 at
    once. Celery's remote-control loop, under the gevent pool, could block for good on its
    pub/sub socket after such a restart, and the warm shutdown waited for it: in a quarter to
    half of such rounds, until the hard-exit alarm (exit 242) or a container's kill. Five
    rounds."""
    from broker.embedded import EmbeddedRedis
    from broker.ledger import Ledger
    from broker.redisconn import connect
    from producer.enqueue import submit
    from tests.conftest import Procs
    from tests.taskfiles import write_arith_tasks

    env_srv, env_url = env_server
    _, model_url = model_server
    env_srv.latency_ms = 5
    for i in range(5):
        base = tmp_path / f"round{i}"
        base.mkdir()
        redis_server = EmbeddedRedis(base / "redis", password="pw").start()
        # a hang must show as one: the alarm that would end it comes long after the check
        s = settings.replace(redis_url=redis_server.url, llm_base_url=model_url + "/v1", concurrency=16,
                             store_url=str(base / "results.sqlite"), shutdown_hard_exit_s=600)
        procs = Procs(s, base / "logs")
        try:
            client = connect(s)
            for n in ("w0", "w1"):
                procs.worker(n)
            procs.consumer()
            job = submit(client, s, [write_arith_tasks(base, env_url, rows=40, env_num=1)]).job
            ledger = Ledger.for_settings(client, s)
            wait_for(lambda: ledger.counts(job.job_id)["running"] >= 4, timeout=120, interval=0.01,
                     what="episodes running")
            redis_server.restart(kill=False, down_s=1.0)
            client = connect(s)
            ledger = Ledger.for_settings(client, s)
            wait_for(lambda: ledger.counts(job.job_id)["done"] == 40, timeout=300, what="the job done")
            time.sleep(2)
            t0 = time.monotonic()
            workers = {n: procs.procs[n] for n in ("w0", "w1")}
            for p in workers.values():
                p.send_signal(signal.SIGTERM)
            for name, p in workers.items():
                try:
                    code = p.wait(60)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"round {i}: idle worker {name} still shutting down {time.monotonic() - t0:.0f}s "
                                f"after SIGTERM\n{procs.log(name)[-3000:]}")
                assert code == 0, f"round {i}: worker {name} exited {code}\n{procs.log(name)[-3000:]}"
        finally:
            procs.stop_all()
            redis_server.stop(kill=True)
