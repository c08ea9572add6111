"""The consumer's ingest rate: records/s through real ``interactor consumer`` processes from a
stream filled as fast as a pipeline can, into SQLite or a PostgreSQL server the run starts."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.benchlog import log
from bench.cluster import ROOT, child_env
from bench.measures import cpu_delta, cpu_snapshot, procs
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.redisconn import client_for
from broker.settings import Settings
from broker.states import AttemptStatus
from interactor.children import spawn_role
from interactor.children import stop as stop_process


def realistic_records(n: int, *, concurrency: int = 256, steps: int = 20, job_id: str = "bench-ingest"):
    """``n`` records as a stream at this concurrency carries them: steps of ``concurrency``
    episodes interleaved, each episode closed by an AttemptRecord; prompts of a few KB."""
    import orjson

    from bench.standins import _filler
    from broker.records import AttemptRecord, StepRecord

    system = {"role": "system", "content": "You are an agent in a text world. " + _filler(1500, "system")}
    turn = _filler(300, "turn")
    reply = _filler(200, "reply")
    out = []
    ep = 0
    live: list[list] = []  # [episode_id, step]
    now = time.time()
    while len(out) < n:
        while len(live) < concurrency:
            live.append([f"ep{ep:07d}", 0])
            ep += 1
        for slot in live:
            if len(out) >= n:
                break
            eid = slot[0]
            slot[1] += 1
            k = slot[1]
            msgs = [system]
            for j in range(max(1, k - 2), k + 1):
                if j > 1:
                    msgs.append({"role": "assistant", "content": f"Action {j - 1}: {reply}"})
                msgs.append({"role": "user", "content": f"Turn {j} of {steps}. {turn}"})
            last = k == steps
            out.append(StepRecord(
                job_id=job_id, env_id=eid, attempt=1, step_id=k, env_name="countdown", llm_model="stand-in",
                group_id=f"g{int(eid[2:]) // 4}", messages_json=orjson.dumps(msgs), response=f"Action {k}: {reply}",
                step_reward=1 / steps, cumulative_reward=k / steps, terminated=last, truncated=False,
                episode_finished=last, is_trainable=True, weight_version="v1", env_latency_s=0.04,
                model_latency_s=1.0, created_at=now))
            if last and len(out) < n:
                out.append(AttemptRecord(
                    job_id=job_id, episode_id=eid, attempt=1, status=AttemptStatus.COMPLETED,
                    group_id=f"g{int(eid[2:]) // 4}",
                    group_size=4, env_name="countdown", llm_model="stand-in", total_reward=1.0, steps=steps,
                    started_at=now - 20, finished_at=now, worker="w1"))
        live = [s for s in live if s[1] < steps]
    return out[:n]


@dataclass
class FleetIngestResult:
    backend: str = "sqlite"
    consumers: int = 1
    records: int = 0
    seconds: float = 0.0
    rate: float = 0.0
    cpu_consumers_s: float = 0.0
    cpu_redis_s: float = 0.0
    cpu_database_s: float = 0.0  # the PostgreSQL server's processes (0 for SQLite)
    errors: list[str] = field(default_factory=list)


def run_fleet_ingest(n: int, work: Path, *, backend: str, consumers: int,
                     base: Settings | None = None) -> FleetIngestResult:
    """Records/s through ``consumers`` real ``interactor consumer`` processes (one consumer
    group) into one store: they start idle on an empty stream, then ``n`` step records are
    added as fast as a pipeline can; the clock runs until every record is acknowledged and in
    the database."""
    folder = Path(tempfile.mkdtemp(prefix=f"ingest-{backend}-{consumers}-", dir=work)).resolve()
    res = FleetIngestResult(backend=backend, consumers=consumers, records=n)
    log(f"ingest: {n} records through {consumers} consumer process(es) into {backend}")
    pg = None
    consumer_ps: list[subprocess.Popen] = []
    try:
        with EmbeddedRedis(folder / "redis") as srv:
            store_url = str(folder / "results.sqlite")
            if backend == "postgres":
                from broker.embedded_postgres import EmbeddedPostgres

                pg = EmbeddedPostgres(folder / "pg").start()
                store_url = pg.create_database("bench")
            settings = (base or Settings.from_env({})).replace(redis_url=srv.url, store_url=store_url,
                                                               run_dir=str(folder))
            client = client_for(srv.url)
            keys = Keys(settings.key_prefix)
            _start_consumers(consumer_ps, consumers, settings, store_url, client, keys, folder)
            packed = [r.pack() for r in realistic_records(n)]
            roles = {"consumers": [pr for p in consumer_ps for pr in procs(p)],
                     "redis": procs(srv.proc),
                     "database": procs(pg.proc) if pg else []}
            cpu0 = {r: cpu_snapshot(p) for r, p in roles.items()}
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for i, raw in enumerate(packed):
                pipe.xadd(keys.results, {"r": raw})
                if i % 2000 == 1999:
                    pipe.execute()
            pipe.execute()
            _wait_drained(res, client, keys, n)
            res.seconds = time.perf_counter() - t0
            cpu1 = {r: cpu_snapshot(p) for r, p in roles.items()}
            res.cpu_consumers_s = cpu_delta(cpu0["consumers"], cpu1["consumers"])
            res.cpu_redis_s = cpu_delta(cpu0["redis"], cpu1["redis"])
            res.cpu_database_s = cpu_delta(cpu0["database"], cpu1["database"])
            _check_stored(res, store_url, n)
            res.rate = n / res.seconds
            client.close()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for p in consumer_ps:
            stop_process(p, 30, signal.SIGTERM)
        if pg is not None:
            pg.stop()
    shutil.rmtree(folder, ignore_errors=True)
    log(f"  {res.rate:.0f} records/s" + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _start_consumers(started: list[subprocess.Popen], consumers: int, settings: Settings, store_url: str,
                     client: redis.Redis, keys: Keys, folder: Path) -> None:
    """The store's schema and the consumer group made before the clock, then ``consumers``
    processes started (appended to ``started`` as they start, so a failure still stops them)
    and waited for until each reads the stream."""
    from consumer.ingest import GROUP
    from consumer.storage import open_store

    open_store(store_url).close()  # schema made once, before the clock
    client.xgroup_create(keys.results, GROUP, id="0", mkstream=True)
    env = child_env(settings, None)
    for i in range(consumers):
        started.append(spawn_role("consumer", f"bench-c{i + 1}", env=env, cwd=str(ROOT),
                                  log_path=folder / f"consumer{i + 1}.log"))
    deadline = time.monotonic() + 60
    while sum(1 for i in range(consumers) if "reading" in (folder / f"consumer{i + 1}.log").read_text(
            errors="replace")) < consumers:
        if time.monotonic() > deadline or any(p.poll() is not None for p in started):
            raise RuntimeError("consumers did not start; see " + str(folder))
        time.sleep(0.1)
    time.sleep(0.5)


def _wait_drained(res: FleetIngestResult, client: redis.Redis, keys: Keys, n: int) -> None:
    """Until the consumer group has read every entry and acknowledged them all (or the time is up)."""
    deadline = time.monotonic() + max(120.0, n / 1000)
    while True:
        info = client.xinfo_groups(keys.results)[0]
        last = _s(info["last-delivered-id"])
        tail = _s(client.xinfo_stream(keys.results)["last-generated-id"])
        if int(info["pending"]) == 0 and last == tail:
            break
        if time.monotonic() > deadline:
            res.errors.append(f"not drained after {deadline:.0f}s")
            break
        time.sleep(0.02)


def _check_stored(res: FleetIngestResult, store_url: str, n: int) -> None:
    """Every record added is in the database, as a step or an attempt row."""
    from consumer.storage import open_store

    store = open_store(store_url, readonly=True)
    stored = store.sql("SELECT COUNT(*) FROM session_steps")[0][0] + store.sql(
        "SELECT COUNT(*) FROM attempts")[0][0]
    store.close()
    if stored != n:
        res.errors.append(f"{stored} of {n} records in the database")


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
