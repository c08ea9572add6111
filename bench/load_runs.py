"""Load runs: the real system under load, measured over a steady-state window (see
docs/benchmarks.md for what and why). The load levels, the single-turn levels, the worker
process and pool comparisons and the cost runs are all load runs of different shapes.

One load run starts a cluster in a fresh folder (bench/cluster.py). It submits a job of
``countdown`` episodes (more than can finish in the window, so every worker slot stays busy),
waits until all C slots run an episode, then measures a steady-state window:

* steps/s from the env stand-in's step counter at both ends of the window;
* CPU seconds per role (psutil, children included) over the window;
* worker memory (PSS, so prefork children are not counted once per shared page) when idle
  and in the middle of the window;
* step-done-to-committed latency of the steps made in the window, from the consumer.

Ideal steps/s = C / (model + 2 env + 2 env / steps): each step is get_task_prompt, the
model, step; reset and close are two more env calls per episode, spread over its steps.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.benchlog import log
from bench.cluster import Cluster, LoadSpec, Standins
from bench.measures import command_calls, cpu_delta, cpu_snapshot, http_json, percentiles, pss_mb
from broker.keys import Keys
from broker.ledger import Ledger
from broker.redisconn import client_for
from broker.settings import Settings
from broker.states import LedgerState


@dataclass
class LoadResult:
    spec: LoadSpec
    steps: int = 0
    window_s: float = 0.0
    rate: float = 0.0
    efficiency: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds in the window
    machine_busy: float = 0.0  # fraction of all cores busy (everything on the machine)
    worker_pss_idle_mb: float = 0.0
    worker_pss_load_mb: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p90, p99, max
    latency_n: int = 0
    step_time_ms: dict[str, float] = field(default_factory=dict)  # mean per step: interval, model, env, own
    running_reached: int = 0
    ramp_s: float = 0.0
    backlog_end: int = 0
    episodes: int = 0  # episodes closed in the window (the env stand-in's close counter)
    redis_calls: dict[str, int] = field(default_factory=dict)  # command -> calls in the window (commandstats)
    redis_usec: dict[str, int] = field(default_factory=dict)  # command -> Redis' microseconds in it, the same way
    errors: list[str] = field(default_factory=list)

    @property
    def orch_cpu_ms_per_step(self) -> float:
        c = self.cpu_s
        return 1000 * (c.get("workers", 0) + c.get("consumer", 0) + c.get("redis", 0)) / max(1, self.steps)

    @property
    def orch_cpu_ms_per_episode(self) -> float:
        c = self.cpu_s
        return 1000 * (c.get("workers", 0) + c.get("consumer", 0) + c.get("redis", 0)) / max(1, self.episodes)

    def cpu_ms_per_step(self, role: str) -> float:
        return 1000 * self.cpu_s.get(role, 0.0) / max(1, self.steps)

    @property
    def mem_mb_per_episode(self) -> float:
        return (self.worker_pss_load_mb - self.worker_pss_idle_mb) / self.spec.concurrency

    @property
    def mem_total_mb_per_episode(self) -> float:
        return self.worker_pss_load_mb / self.spec.concurrency


def write_countdown_tasks(folder: Path, env_url: str, episodes: int, steps: int, group: int = 4,
                          limits: dict[str, Any] | None = None, resume: bool = True) -> str:
    """The task file of a run's job: ``countdown`` episodes of ``steps`` steps in groups of
    ``group``, with the run's ``limits:`` and ``resume:``; returns its path."""
    rows = max(1, episodes // group)
    data = folder / "countdown.jsonl"
    data.write_text("".join(json.dumps({"steps": steps, "task": i}) + "\n" for i in range(rows)))
    path = folder / "tasks.yaml"
    path.write_text(
        "environments:\n"
        "  - env_name: countdown\n"
        f"    base_url: {env_url}\n"
        "    env_params: {system_bytes: 1500, turn_bytes: 300, keep_turns: 3}\n"
        f"    dataset: {data.name}\n"
        f"    env_num: {group}\n"
        + (f"limits: {json.dumps(limits)}\n" if limits else "")  # JSON is YAML's flow style
        + ("" if resume else "resume: false\n")
    )
    return str(path)


def _step_times(db: str, t0: float, t1: float) -> dict[str, float]:
    """Where a step's wall time goes, from the stored steps of the window: the interval between
    consecutive steps of an episode, the model and env waits the worker measured, and the rest
    (the worker's own time: loop, records, publish, waiting for the GIL or a core)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        rows = con.execute("SELECT session_id, step_id, created_ts, env_latency_s, model_latency_s FROM session_steps "
                           "WHERE created_ts BETWEEN ? AND ? ORDER BY session_id, step_id", (t0 - 5, t1)).fetchall()
        con.close()
    except sqlite3.Error:
        return {}
    intervals, model, env = [], [], []
    prev = None
    for row in rows:
        if prev is not None and prev[0] == row[0] and prev[1] == row[1] - 1 and row[2] >= t0:
            intervals.append(row[2] - prev[2])
            model.append(row[4] or 0.0)
            env.append(row[3] or 0.0)
        prev = row
    if not intervals:
        return {}
    n = len(intervals)
    out = {"interval": 1000 * sum(intervals) / n, "model": 1000 * sum(model) / n, "env": 1000 * sum(env) / n}
    out["own"] = out["interval"] - out["model"] - out["env"]
    out["n"] = n
    return out


def run_load(spec: LoadSpec, work: Path, *, src: str | None = None, base: Settings | None = None,
             standins: Standins | None = None) -> LoadResult:
    """One load run; on ``standins`` when given (they outlive it), else on stand-ins of its own."""
    folder = Path(tempfile.mkdtemp(prefix=f"load-{spec.pool}-{spec.concurrency}-", dir=work)).resolve()
    res = LoadResult(spec)
    cluster = Cluster(folder, spec, src=src, base=base, standins=standins)
    log(f"load run: concurrency {spec.concurrency}, pool {spec.pool}, {spec.workers} worker processes"
        + (f", model and env-server caps at {spec.caps_factor:g}x concurrency" if spec.caps_factor > 0 else "")
        + (f", code from {src}" if src else ""))
    try:
        settings = cluster.start()
        client = client_for(settings.redis_url)
        keys = Keys(settings.key_prefix)
        cluster.wait_workers_ready()
        time.sleep(1.0)
        res.worker_pss_idle_mb = pss_mb(cluster.roles()["workers"])

        ramp_limit = max(30.0, spec.concurrency * 0.02)
        job_id = _submit_load_job(client, settings, cluster, folder, ramp_limit)
        ledger = Ledger(client, keys, settings.lease_ttl_s)
        _ramp(res, cluster, ledger, job_id, ramp_limit)
        time.sleep(spec.warmup_s)

        t0w, t1w = _measure_window(res, cluster, client)
        res.errors += cluster.exit_problems()
        if ledger.counts(job_id)[LedgerState.QUEUED] == 0:
            res.errors.append("the queue ran dry during the window: raise episodes_factor")

        # Drain what the window produced, then read the latencies.
        res.backlog_end = cluster.kill_workers_and_drain(client, keys)
        _read_latencies(res, cluster, settings, t0w, t1w)
        client.close()
    except Exception as exc:
        res.errors.append(f"{type(exc).__name__}: {exc}")
        log(f"load run failed: {exc}")
    finally:
        cluster.stop()
    log(f"  {res.rate:.1f} steps/s of ideal {spec.ideal_rate:.1f} (efficiency {res.efficiency:.3f}); "
        f"orchestration CPU {res.orch_cpu_ms_per_step:.3f} ms/step, {res.orch_cpu_ms_per_episode:.3f} ms/episode; "
        f"Redis {sum(res.redis_calls.values()) / max(1, res.episodes):.1f} commands/episode; p99 record latency "
        f"{res.latency_ms.get('p99', float('nan')):.0f} ms; worker memory {res.mem_mb_per_episode:.3f} MB/episode"
        + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _submit_load_job(client: redis.Redis, settings: Settings, cluster: Cluster, folder: Path,
                     ramp_limit: float) -> str:
    """Submit the run's job: enough episodes that the queue outlasts ramp, warm-up and window."""
    from producer.enqueue import plan, submit_plan

    spec = cluster.spec
    factor = spec.episodes_factor or 1.5 * (1 + (ramp_limit + spec.window_s + spec.warmup_s + 15)
                                           / (spec.steps * spec.step_latency_s))
    episodes = max(spec.concurrency, int(spec.concurrency * factor))
    tasks = write_countdown_tasks(folder, cluster.env_url, episodes, spec.steps,
                                  limits=spec.limits(cluster.env_url), resume=spec.resume)
    sub = submit_plan(client, settings, plan(settings, [tasks], f"bench-{uuid.uuid4().hex[:6]}"))
    if spec.caps_factor > 0 and not sub.job.limits:
        raise RuntimeError("the job was submitted without the caps its task file sets")
    return sub.job.job_id


def _ramp(res: LoadResult, cluster: Cluster, ledger: Ledger, job_id: str, ramp_limit: float) -> None:
    """Until every slot runs an episode (or the machine shows it cannot: then the window is
    measured all the same, and the table says how many ran)."""
    spec = cluster.spec
    t_ramp = time.monotonic()
    deadline = t_ramp + ramp_limit
    best = 0
    while time.monotonic() < deadline:
        running = ledger.counts(job_id)[LedgerState.RUNNING]
        best = max(best, running)
        if running >= spec.concurrency:
            break
        if any(w.poll() is not None for w in cluster.workers):
            raise RuntimeError("a worker process died during ramp-up; see " + str(cluster.logs))
        time.sleep(0.2)
    res.running_reached = best
    res.ramp_s = time.monotonic() - t_ramp
    if best < spec.concurrency:
        res.errors.append(f"only {best} of {spec.concurrency} episodes ran at once")


def _measure_window(res: LoadResult, cluster: Cluster, client: redis.Redis) -> tuple[float, float]:
    """The window: counters, CPU and Redis's command counts at both ends, worker memory in the
    middle; fills ``res`` and returns the window's wall-clock ends."""
    spec = cluster.spec
    snap0 = {r: cpu_snapshot(p) for r, p in cluster.roles().items()}
    mach0 = psutil.cpu_times()
    env0 = http_json(cluster.env_url + "/stats")
    redis0, usec0 = command_calls(client), command_calls(client, "usec")
    t0w, t0 = time.time(), time.monotonic()
    time.sleep(spec.window_s / 2)
    res.worker_pss_load_mb = pss_mb(cluster.roles()["workers"])
    time.sleep(max(0.0, spec.window_s / 2 - (time.monotonic() - t0 - spec.window_s / 2)))
    env1 = http_json(cluster.env_url + "/stats")
    redis1, usec1 = command_calls(client), command_calls(client, "usec")
    t1w, t1 = time.time(), time.monotonic()
    snap1 = {r: cpu_snapshot(p) for r, p in cluster.roles().items()}
    mach1 = psutil.cpu_times()

    res.steps = env1["steps"] - env0["steps"]
    res.episodes = env1.get("closes", 0) - env0.get("closes", 0)
    res.redis_calls = {cmd: n - redis0.get(cmd, 0) for cmd, n in redis1.items() if n > redis0.get(cmd, 0)}
    res.redis_calls.pop("info", None)  # this harness's own two reads
    res.redis_usec = {cmd: n - usec0.get(cmd, 0) for cmd, n in usec1.items() if n > usec0.get(cmd, 0) and cmd != "info"}
    res.window_s = t1 - t0
    res.rate = res.steps / res.window_s
    res.efficiency = res.rate / spec.ideal_rate
    res.cpu_s = {r: cpu_delta(snap0[r], snap1[r]) for r in snap0}
    busy = (sum(mach1) - mach1.idle - getattr(mach1, "iowait", 0)) - (sum(mach0) - mach0.idle - getattr(mach0, "iowait", 0))
    res.machine_busy = busy / (sum(mach1) - sum(mach0))
    return t0w, t1w


def _read_latencies(res: LoadResult, cluster: Cluster, settings: Settings, t0w: float, t1w: float) -> None:
    """The record latencies of the steps made in the window (the consumer's observer wrote
    (done, committed) pairs) and where the steps' time went (the store)."""
    pairs = array("d")
    if cluster.latency_file.exists():
        with open(cluster.latency_file, "rb") as f:
            pairs.frombytes(f.read())
    lat = [(pairs[i + 1] - pairs[i]) * 1000 for i in range(0, len(pairs) - 1, 2) if t0w <= pairs[i] <= t1w]
    res.latency_ms = percentiles(lat)
    res.latency_n = len(lat)
    res.step_time_ms = _step_times(settings.results_db, t0w, t1w)
