"""Run the real system under load and measure it (see docs/benchmarks.md for what and why).

One *load run* starts, in a fresh folder: an embedded Redis, the two stand-ins (bench/standins.py)
in their own processes, ``interactor worker`` processes and the consumer (bench/consumer.py:
``interactor consumer`` plus a latency observer). It submits a job of ``countdown`` episodes
(more than can finish in the window, so every worker slot stays busy), waits until all C
slots run an episode, then measures a steady-state window:

* steps/s from the env stand-in's step counter at both ends of the window;
* CPU seconds per role (psutil, children included) over the window;
* worker memory (PSS, so prefork children are not counted once per shared page) when idle
  and in the middle of the window;
* step-done-to-committed latency of the steps made in the window, from the consumer.

Ideal steps/s = C / (model + 2 env + 2 env / steps): each step is get_task_prompt, the
model, step; reset and close are two more env calls per episode, spread over its steps.

Besides load runs: the consumer's ingest rate from a pre-filled stream and the producer's
enqueue rate for a large job, both in this process against the same kind of Redis.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from broker.caps import MAX_CONCURRENCY, Limits
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.ledger import Ledger
from broker.settings import Settings
from broker.states import AttemptStatus, LedgerState
from interactor.children import role_command, spawn, spawn_role
from interactor.children import stop as stop_process

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- configuration


@dataclass
class LoadSpec:
    concurrency: int
    pool: str = "gevent"
    workers: int = 4  # worker processes; concurrency is split between them
    model_latency_ms: float = 1000.0
    env_latency_ms: float = 20.0
    steps: int = 20  # steps per episode
    window_s: float = 20.0
    warmup_s: float = 3.0
    episodes_factor: float = 0.0  # episodes submitted = factor * concurrency; 0: enough for the window
    label: str = ""
    # Fleet-wide caps on the model endpoint and the env server at caps_factor * concurrency
    # (the task file's ``limits:``, README "Fleet-wide limits"); 0: none. Above 1 they never
    # bind, so a run measures only what holding them costs (the "caps" part of bench/run.py).
    caps_factor: float = 0.0

    def limits(self, env_url: str) -> dict[str, Any]:
        """The task file's ``limits:`` of this load (empty without caps)."""
        if self.caps_factor <= 0:
            return {}
        n = max(1, math.ceil(self.caps_factor * self.concurrency))
        return Limits(model=n, env_servers={env_url: {MAX_CONCURRENCY: n}}).to_dict()

    @property
    def step_latency_s(self) -> float:
        env = self.env_latency_ms / 1000
        return self.model_latency_ms / 1000 + 2 * env + 2 * env / self.steps

    @property
    def ideal_rate(self) -> float:
        return self.concurrency / self.step_latency_s


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


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- processes


def _start_listening(cmd: list[str], env: dict, log_path: Path, cwd: str) -> tuple[subprocess.Popen, str]:
    logf = open(log_path, "ab")
    p = spawn(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=logf)
    logf.close()
    line = p.stdout.readline().decode()
    if "listening on" not in line:
        p.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r} (see {log_path})")
    return p, line.split("listening on", 1)[1].strip()


def _child_env(settings: Settings, src: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    env["PYTHONUNBUFFERED"] = "1"
    if src:  # run another checkout of the code (before/after comparisons)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _procs(p: subprocess.Popen | None) -> list[psutil.Process]:
    if p is None or p.poll() is not None:
        return []
    try:
        root = psutil.Process(p.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_snapshot(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for pr in procs:
        try:
            t = pr.cpu_times()
            out[pr.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def _cpu_delta(a: dict[int, float], b: dict[int, float]) -> float:
    return sum(v - a.get(pid, 0.0) for pid, v in b.items())


def _pss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for pr in procs:
        try:
            total += pr.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            try:
                total += pr.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return total / 2**20


def _command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``). Commands a Lua script
    runs count under their own names, and the script itself under ``evalsha``."""
    out = {}
    for key, stats in client.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        out[name] = int(stats.get("calls", 0)) if isinstance(stats, dict) else 0
    return out


def _http_json(url: str, timeout: float = 5.0) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Cluster:
    """Redis, stand-ins, workers and consumer of one load run, in ``folder``."""

    def __init__(self, folder: Path, spec: LoadSpec, *, src: str | None = None, base: Settings | None = None):
        self.folder = folder
        self.spec = spec
        self.src = src
        self.cwd = src or str(ROOT)
        self.base = base or Settings.from_env({})
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis: EmbeddedRedis | None = None
        self.env_p = self.model_p = self.consumer_p = None
        self.workers: list[subprocess.Popen] = []
        self.latency_file = folder / "latency.bin"

    def start(self) -> Settings:
        spec = self.spec
        self.redis = EmbeddedRedis(self.folder / "redis").start()
        py = sys.executable
        plain = _child_env(self.base, self.src)
        self.env_p, env_url = _start_listening(
            [py, "-m", "bench.standins", "env", "--port", "0", "--latency-ms", str(spec.env_latency_ms)],
            plain, self.logs / "env.log", self.cwd)
        self.model_p, model_url = _start_listening(
            [py, "-m", "bench.standins", "model", "--port", "0", "--latency-ms", str(spec.model_latency_ms)],
            plain, self.logs / "model.log", self.cwd)
        per_worker = max(1, -(-spec.concurrency // spec.workers))
        # The first wave spread over one model latency (llm_startup_jitter_s, what a fleet
        # starting at once should use): with identical latencies, episodes started together
        # would otherwise step in lockstep for the whole run, and a window would count 19 or 20
        # bursts of C steps depending on where it falls (+-5% at 20 s).
        s = self.base.replace(
            redis_url=self.redis.url, run_dir=str(self.folder), db_path=str(self.folder / "results.sqlite"),
            env_base_url=env_url, llm_base_url=model_url + "/v1", model="stand-in", pool=spec.pool,
            concurrency=per_worker, max_steps=max(spec.steps, 1), llm_startup_jitter_s=spec.model_latency_ms / 1000,
        )
        self.settings = s
        self.env_url, self.model_url = env_url, model_url
        env = _child_env(s, self.src)
        self.consumer_p = self._spawn([py, "-m", "bench.consumer", str(self.latency_file)], env, "consumer")
        for i in range(spec.workers):
            self.workers.append(self._spawn(
                role_command("worker", f"w{i + 1}", "--loglevel", "INFO"), env,
                f"worker{i + 1}"))
        return s

    def _spawn(self, cmd: list[str], env: dict, name: str) -> subprocess.Popen:
        return spawn(cmd, env=env, log_path=self.logs / f"{name}.log", cwd=self.cwd)

    def roles(self) -> dict[str, list[psutil.Process]]:
        return {
            "workers": [pr for w in self.workers for pr in _procs(w)],
            "consumer": _procs(self.consumer_p),
            "redis": _procs(self.redis.proc if self.redis else None),
            "env": _procs(self.env_p),
            "model": _procs(self.model_p),
        }

    def wait_workers_ready(self, timeout: float = 120.0) -> None:
        """Until every worker process logs that it is ready (and prefork children exist)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = 0
            for i, w in enumerate(self.workers):
                if w.poll() is not None:
                    raise RuntimeError(f"worker{i + 1} exited with {w.returncode}: "
                                       f"{(self.logs / f'worker{i + 1}.log').read_text()[-2000:]}")
                if "ready." in (self.logs / f"worker{i + 1}.log").read_text(errors="replace"):
                    ready += 1
            if ready == len(self.workers):
                return
            time.sleep(0.2)
        raise RuntimeError("workers did not become ready")

    def stop(self) -> None:
        for w in self.workers:
            stop_process(w, 10, signal.SIGKILL)
        for p in (self.env_p, self.model_p):
            stop_process(p, 10, signal.SIGTERM)
        stop_process(self.consumer_p, 60, signal.SIGTERM)
        if self.redis:
            self.redis.stop()

    def kill_workers_and_drain(self, client: redis.Redis, keys: Keys, timeout: float = 60.0) -> int:
        for w in self.workers:
            stop_process(w, 10, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        backlog = -1
        while time.monotonic() < deadline:
            try:
                info = client.xinfo_groups(keys.results)
                backlog = sum(int(g.get("pending", 0)) + int(g.get("lag") or 0) for g in info)
            except redis.ResponseError:
                backlog = 0
            if backlog == 0:
                break
            time.sleep(0.2)
        stop_process(self.consumer_p, 60, signal.SIGTERM)
        return backlog


def _write_countdown_tasks(folder: Path, env_url: str, episodes: int, steps: int, group: int = 4,
                           limits: dict[str, Any] | None = None) -> str:
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
    )
    return str(path)


def _percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    out = {f"p{p}": v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))] for p in ps}
    out["max"] = v[-1]
    return out


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


def run_load(spec: LoadSpec, work: Path, *, src: str | None = None, base: Settings | None = None) -> LoadResult:
    from producer.enqueue import plan, submit_plan

    folder = Path(tempfile.mkdtemp(prefix=f"load-{spec.pool}-{spec.concurrency}-", dir=work)).resolve()
    res = LoadResult(spec)
    cluster = Cluster(folder, spec, src=src, base=base)
    log(f"load run: concurrency {spec.concurrency}, pool {spec.pool}, {spec.workers} worker processes"
        + (f", model and env-server caps at {spec.caps_factor:g}x concurrency" if spec.caps_factor > 0 else "")
        + (f", code from {src}" if src else ""))
    try:
        settings = cluster.start()
        client = redis.Redis.from_url(settings.redis_url)
        keys = Keys(settings.key_prefix)
        cluster.wait_workers_ready()
        time.sleep(1.0)
        roles = cluster.roles()
        res.worker_pss_idle_mb = _pss_mb(roles["workers"])

        ramp_limit = max(30.0, spec.concurrency * 0.02)
        factor = spec.episodes_factor or 1.5 * (1 + (ramp_limit + spec.window_s + spec.warmup_s + 15)
                                               / (spec.steps * spec.step_latency_s))
        episodes = max(spec.concurrency, int(spec.concurrency * factor))
        tasks = _write_countdown_tasks(folder, cluster.env_url, episodes, spec.steps,
                                       limits=spec.limits(cluster.env_url))
        sub = submit_plan(client, settings, plan(settings, [tasks], f"bench-{uuid.uuid4().hex[:6]}"))
        job_id = sub.job.job_id
        if spec.caps_factor > 0 and not sub.job.limits:
            raise RuntimeError("the job was submitted without the caps its task file sets")
        ledger = Ledger(client, keys, settings.lease_ttl_s)

        # Ramp: until every slot runs an episode (or the machine shows it cannot: then the window
        # is measured all the same, and the table says how many ran).
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
        time.sleep(spec.warmup_s)

        # The window.
        roles = cluster.roles()
        allprocs = [pr for procs in roles.values() for pr in procs]
        snap0 = {r: _cpu_snapshot(p) for r, p in roles.items()}
        mach0 = psutil.cpu_times()
        env0 = _http_json(cluster.env_url + "/stats")
        redis0 = _command_calls(client)
        t0w, t0 = time.time(), time.monotonic()
        time.sleep(spec.window_s / 2)
        res.worker_pss_load_mb = _pss_mb(cluster.roles()["workers"])
        time.sleep(max(0.0, spec.window_s / 2 - (time.monotonic() - t0 - spec.window_s / 2)))
        env1 = _http_json(cluster.env_url + "/stats")
        redis1 = _command_calls(client)
        t1w, t1 = time.time(), time.monotonic()
        roles1 = cluster.roles()
        snap1 = {r: _cpu_snapshot(p) for r, p in roles1.items()}
        mach1 = psutil.cpu_times()
        del allprocs

        res.steps = env1["steps"] - env0["steps"]
        res.episodes = env1.get("closes", 0) - env0.get("closes", 0)
        res.redis_calls = {cmd: n - redis0.get(cmd, 0) for cmd, n in redis1.items() if n > redis0.get(cmd, 0)}
        res.redis_calls.pop("info", None)  # this harness's own two reads
        res.window_s = t1 - t0
        res.rate = res.steps / res.window_s
        res.efficiency = res.rate / spec.ideal_rate
        res.cpu_s = {r: _cpu_delta(snap0[r], snap1[r]) for r in snap0}
        busy = (sum(mach1) - mach1.idle - getattr(mach1, "iowait", 0)) - (sum(mach0) - mach0.idle - getattr(mach0, "iowait", 0))
        res.machine_busy = busy / (sum(mach1) - sum(mach0))
        for name, p in [("consumer", cluster.consumer_p)] + [(f"worker{i + 1}", w) for i, w in enumerate(cluster.workers)]:
            if p.poll() is not None:
                res.errors.append(f"{name} exited with {p.returncode} (see {cluster.logs / (name + '.log')})")
        c = ledger.counts(job_id)
        if c[LedgerState.QUEUED] == 0:
            res.errors.append("the queue ran dry during the window: raise episodes_factor")

        # Drain what the window produced, then read the latencies.
        res.backlog_end = cluster.kill_workers_and_drain(client, keys)
        pairs = array("d")
        if cluster.latency_file.exists():
            with open(cluster.latency_file, "rb") as f:
                pairs.frombytes(f.read())
        lat = [(pairs[i + 1] - pairs[i]) * 1000 for i in range(0, len(pairs) - 1, 2) if t0w <= pairs[i] <= t1w]
        res.latency_ms = _percentiles(lat)
        res.latency_n = len(lat)
        res.step_time_ms = _step_times(settings.results_db, t0w, t1w)
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


def redis_calls_per_step(r: dict) -> float:
    """Redis commands per step of a load run's window (``to_json`` form; NaN without steps)."""
    return sum((r.get("redis_calls") or {}).values()) / r["steps"] if r.get("steps") else float("nan")


def caps_cost(uncapped: dict, capped: dict) -> dict[str, float]:
    """What caps that never bind cost per step (issue 25: "the cost of the caps per step (Redis
    round trips)"), from two load runs of the same shape, without and with caps (``to_json``
    form): orchestration CPU per step both ways and their ratio, Redis commands per step both
    ways and their difference (the round trips the caps add)."""
    cpu0, cpu1 = uncapped["orch_cpu_ms_per_step"], capped["orch_cpu_ms_per_step"]
    r0, r1 = redis_calls_per_step(uncapped), redis_calls_per_step(capped)
    return {"cpu_ms_per_step_uncapped": cpu0, "cpu_ms_per_step_capped": cpu1,
            "cpu_ratio": cpu1 / cpu0 if cpu0 else float("nan"),
            "redis_per_step_uncapped": r0, "redis_per_step_capped": r1, "redis_extra_per_step": r1 - r0}


# --------------------------------------------------------------------------- the rollout feed


@dataclass
class FeedResult:
    spec: LoadSpec
    group: int = 4  # episodes per group (env_num)
    batch: int = 0  # groups the trainer asks for per take
    max_ahead: int = 0
    train_s: float = 1.0  # the trainer's simulated training step after each take
    window_s: float = 0.0
    takes: int = 0  # takes that returned in the window
    groups: int = 0  # groups they returned
    rate: float = 0.0  # groups delivered per second in the window
    latency_ms: dict[str, float] = field(default_factory=dict)  # group completed -> take returned it
    latency_n: int = 0
    wait_s: float = 0.0  # the trainer's time inside take, in the window
    idle_fraction: float = 0.0  # wait_s / window_s
    running_reached: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # the feed's counters at the end (GET /stats)
    errors: list[str] = field(default_factory=list)


def feed_shape(spec: LoadSpec, group: int = 4, train_s: float = 1.0) -> tuple[int, int]:
    """(batch, max_ahead) of a feed level. The batch is what the fleet ideally completes while
    the trainer trains, so a trainer that keeps up neither starves by design nor lets a backlog
    build (a backlog would measure max_ahead, not the feed). max_ahead covers the groups running
    in all C slots, a fifth more queued to refill them, one batch ready and one taken."""
    groups_per_s = spec.concurrency / group / (spec.steps * spec.step_latency_s)
    batch = max(1, math.ceil(groups_per_s * train_s))
    return batch, math.ceil(1.2 * spec.concurrency / group) + 2 * batch


def _start_feed_server(cmd: list[str], env: dict, log_path: Path, cwd: str, timeout: float = 60.0
                       ) -> tuple[subprocess.Popen, str]:
    """``interactor feed serve`` prints ``feed of job J at URL`` once it serves."""
    logf = open(log_path, "ab")
    p = spawn(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=logf)
    logf.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline().decode(errors="replace")
        if not line:
            break
        if line.startswith("feed of job") and " at http" in line:
            return p, line.rsplit(" at ", 1)[1].strip()
    p.kill()
    raise RuntimeError(f"the feed server did not start (see {log_path})")


def run_feed(spec: LoadSpec, work: Path, *, train_s: float = 1.0, src: str | None = None,
             base: Settings | None = None) -> FeedResult:
    """A continuous job at concurrency C served by ``interactor feed serve --job J`` (its own
    process: HTTP on loopback, the producer paced by max_ahead) to a trainer loop here, using
    the stdlib client: take a batch, acknowledge it, train for ``train_s``, again.

    * group delivery latency: from the group's completion (its last member's attempt end, as
      the store has it) to the moment the take that handed it out returned, for the groups
      taken in the window;
    * trainer idle fraction: the trainer's time inside take in the window / the window.
    """
    from interactor.feed_client import Feed
    from producer.continuous import create_continuous_job

    folder = Path(tempfile.mkdtemp(prefix=f"feed-{spec.concurrency}-", dir=work)).resolve()
    res = FeedResult(spec, train_s=train_s)
    res.batch, res.max_ahead = feed_shape(spec, res.group, train_s)
    cluster = Cluster(folder, spec, src=src, base=base)
    feed_p = None
    stop = threading.Event()
    takes: list[tuple[float, float, list[str]]] = []  # (take started, returned, group ids) wall clock
    trainer_errors: list[str] = []
    log(f"feed run: concurrency {spec.concurrency}, batch {res.batch} groups per take, max_ahead {res.max_ahead}, "
        f"training {train_s:g} s per batch")

    def trainer(f: Feed) -> None:
        while not stop.is_set():
            try:
                t0 = time.time()
                groups = f.take(res.batch, timeout=5.0)
                t1 = time.time()
                ids = [g["group_id"] for g in groups]
                takes.append((t0, t1, ids))
                if ids:
                    f.ack(ids)
                stop.wait(train_s)  # training on the batch
            except Exception as exc:  # noqa: BLE001 - reported in the table
                trainer_errors.append(f"trainer: {type(exc).__name__}: {exc}")
                stop.wait(1.0)

    thread = None
    try:
        settings = cluster.start().replace(feed_max_ahead=res.max_ahead)
        client = redis.Redis.from_url(settings.redis_url)
        keys = Keys(settings.key_prefix)
        cluster.wait_workers_ready()
        tasks = _write_countdown_tasks(folder, cluster.env_url, max(res.group, spec.concurrency), spec.steps,
                                       res.group)
        job_id = create_continuous_job(client, settings, [tasks], job_id=f"bench-feed-{uuid.uuid4().hex[:6]}",
                                       seed=1).job_id
        feed_p, url = _start_feed_server([sys.executable, "-m", "interactor.cli", "feed", "serve", "--job", job_id,
                                          "--port", "0"],
                                         _child_env(settings, src), cluster.logs / "feed.log", cluster.cwd)
        f = Feed(url, trainer="bench-trainer")
        thread = threading.Thread(target=trainer, args=(f,), daemon=True, name="bench-trainer")
        thread.start()
        ledger = Ledger(client, keys, settings.lease_ttl_s)
        deadline = time.monotonic() + max(30.0, spec.concurrency * 0.02)
        while time.monotonic() < deadline:
            res.running_reached = max(res.running_reached, ledger.counts(job_id)[LedgerState.RUNNING])
            if res.running_reached >= spec.concurrency:
                break
            if feed_p.poll() is not None:
                raise RuntimeError(f"the feed server exited with {feed_p.returncode}; see {cluster.logs}")
            time.sleep(0.2)
        if res.running_reached < spec.concurrency:
            res.errors.append(f"only {res.running_reached} of {spec.concurrency} episodes ran at once")
        # Groups complete only after an episode's length: the window opens once they flow.
        first = time.monotonic() + 2 * spec.steps * spec.step_latency_s + 30
        while not any(t[2] for t in takes) and time.monotonic() < first:
            time.sleep(0.1)
        time.sleep(spec.warmup_s)
        t0 = time.time()
        time.sleep(spec.window_s)
        t1 = time.time()
        res.window_s = t1 - t0
        stop.set()
        thread.join(10)
        res.stats = f.stats()
        window = [t for t in takes if t0 <= t[1] <= t1]
        res.takes = len(window)
        res.wait_s = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in takes)
        res.idle_fraction = res.wait_s / res.window_s
        taken_at = {gid: b for _, b, ids in window for gid in ids}
        res.groups = len(taken_at)
        res.rate = res.groups / res.window_s
        done_at = _groups_completed(settings.results_db, job_id)
        lat = [1000 * (b - done_at[g]) for g, b in taken_at.items() if g in done_at]
        if len(lat) < len(taken_at):
            res.errors.append(f"{len(taken_at) - len(lat)} delivered groups without a stored completion")
        res.latency_ms = _percentiles(lat)
        res.latency_n = len(lat)
        if not res.groups:
            res.errors.append("no group was delivered in the window")
        for name, p in [("consumer", cluster.consumer_p), ("feed", feed_p)] + [
                (f"worker{i + 1}", w) for i, w in enumerate(cluster.workers)]:
            if p.poll() is not None:
                res.errors.append(f"{name} exited with {p.returncode} (see {cluster.logs / (name + '.log')})")
        client.close()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res.errors.append(f"{type(exc).__name__}: {exc}")
        log(f"feed run failed: {exc}")
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        stop_process(feed_p, 30, signal.SIGTERM)
        cluster.stop()
    res.errors.extend(sorted(set(trainer_errors)))
    log(f"  {res.groups} groups in {res.takes} takes ({res.rate:.1f}/s); delivery latency p50 "
        f"{res.latency_ms.get('p50', float('nan')):.0f} ms, p99 {res.latency_ms.get('p99', float('nan')):.0f} ms; "
        f"trainer idle {res.idle_fraction:.3f}" + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _groups_completed(db: str, job_id: str) -> dict[str, float]:
    """When each group of the job completed: its last member's attempt end (completed attempts)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT e.group_id, MAX(a.finished_at) FROM attempts a JOIN episodes e "
                           "ON e.episode_id = a.episode_id "
                           f"WHERE a.job_id = ? AND a.status = '{AttemptStatus.COMPLETED}' "
                           "GROUP BY e.group_id", (job_id,)).fetchall()
    finally:
        con.close()
    return {g: t for g, t in rows if t}


# --------------------------------------------------------------------------- ingest


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
    procs: list[subprocess.Popen] = []
    try:
        with EmbeddedRedis(folder / "redis") as srv:
            store_url = str(folder / "results.sqlite")
            if backend == "postgres":
                from broker.embedded_postgres import EmbeddedPostgres

                pg = EmbeddedPostgres(folder / "pg").start()
                store_url = pg.create_database("bench")
            settings = (base or Settings.from_env({})).replace(redis_url=srv.url, store_url=store_url,
                                                               run_dir=str(folder))
            client = redis.Redis.from_url(srv.url)
            keys = Keys(settings.key_prefix)
            from consumer.ingest import GROUP
            from consumer.storage import open_store

            open_store(store_url).close()  # schema made once, before the clock
            client.xgroup_create(keys.results, GROUP, id="0", mkstream=True)
            env = _child_env(settings, None)
            for i in range(consumers):
                procs.append(spawn_role("consumer", f"bench-c{i + 1}", env=env, cwd=str(ROOT),
                                        log_path=folder / f"consumer{i + 1}.log"))
            deadline = time.monotonic() + 60
            while sum(1 for i in range(consumers) if "reading" in (folder / f"consumer{i + 1}.log").read_text(
                    errors="replace")) < consumers:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("consumers did not start; see " + str(folder))
                time.sleep(0.1)
            time.sleep(0.5)
            packed = [r.pack() for r in realistic_records(n)]
            roles = {"consumers": [pr for p in procs for pr in _procs(p)],
                     "redis": _procs(srv.proc),
                     "database": _pg_procs(pg.proc) if pg else []}
            cpu0 = {r: _cpu_snapshot(p) for r, p in roles.items()}
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for i, raw in enumerate(packed):
                pipe.xadd(keys.results, {"r": raw})
                if i % 2000 == 1999:
                    pipe.execute()
            pipe.execute()
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
            res.seconds = time.perf_counter() - t0
            cpu1 = {r: _cpu_snapshot(p) for r, p in roles.items()}
            res.cpu_consumers_s = _cpu_delta(cpu0["consumers"], cpu1["consumers"])
            res.cpu_redis_s = _cpu_delta(cpu0["redis"], cpu1["redis"])
            res.cpu_database_s = _cpu_delta(cpu0["database"], cpu1["database"])
            store = open_store(store_url, readonly=True)
            stored = store.sql("SELECT COUNT(*) FROM session_steps")[0][0] + store.sql(
                "SELECT COUNT(*) FROM attempts")[0][0]
            store.close()
            if stored != n:
                res.errors.append(f"{stored} of {n} records in the database")
            res.rate = n / res.seconds
            client.close()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for p in procs:
            stop_process(p, 30, signal.SIGTERM)
        if pg is not None:
            pg.stop()
    shutil.rmtree(folder, ignore_errors=True)
    log(f"  {res.rate:.0f} records/s" + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _pg_procs(p: subprocess.Popen | None) -> list[psutil.Process]:
    return _procs(p)


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# --------------------------------------------------------------------------- enqueue


@dataclass
class EnqueueResult:
    episodes: int = 0
    plan_s: float = 0.0
    enqueue_s: float = 0.0
    rate: float = 0.0  # episodes/s, plan + ledger + queue
    enqueue_rate: float = 0.0  # ledger + queue only
    errors: list[str] = field(default_factory=list)


def run_enqueue(n: int, work: Path, *, base: Settings | None = None) -> EnqueueResult:
    """A job of ``n`` episodes from a task file: plan (read + validate + expand) and submit
    (ledger + queue), as ``interactor submit`` does."""
    from producer.enqueue import plan, submit_plan

    folder = Path(tempfile.mkdtemp(prefix="enqueue-", dir=work))
    res = EnqueueResult(episodes=n)
    log(f"enqueue: a job of {n} episodes")
    with EmbeddedRedis(folder / "redis") as srv:
        settings = (base or Settings.from_env({})).replace(redis_url=srv.url, run_dir=str(folder),
                                                           env_base_url="http://127.0.0.1:9")
        client = redis.Redis.from_url(srv.url)
        data = folder / "rows.jsonl"
        data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i, "steps": 20}) + "\n"
                                for i in range(max(1, n // 4))))
        tasks = folder / "tasks.yaml"
        tasks.write_text("environments:\n  - env_name: countdown\n    env_params: {system_bytes: 1500}\n"
                         f"    dataset: {data.name}\n    env_num: 4\n")
        t0 = time.perf_counter()
        planned = plan(settings, [str(tasks)], "bench-enqueue")
        res.plan_s = time.perf_counter() - t0
        sub = submit_plan(client, settings, planned)
        res.enqueue_s = sub.enqueue_s
        total = time.perf_counter() - t0
        queued = client.llen(settings.queue)
        if queued != len(planned.episodes):
            res.errors.append(f"{queued} tasks queued for {len(planned.episodes)} episodes")
        res.episodes = len(planned.episodes)
        res.rate = res.episodes / total
        res.enqueue_rate = res.episodes / res.enqueue_s
        client.close()
    shutil.rmtree(folder, ignore_errors=True)
    log(f"  {res.rate:.0f} episodes/s end to end (plan {res.plan_s:.2f}s, ledger+queue {res.enqueue_s:.2f}s)")
    return res


# --------------------------------------------------------------------------- the machine


def machine() -> dict:
    info = {
        "cpu": platform.processor() or "",
        "cores": psutil.cpu_count(logical=True),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "host": socket.gethostname(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from broker.embedded import redis_server_binary

        out = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
        info["redis"] = out.split("v=", 1)[1].split()[0] if "v=" in out else out.strip()
    except Exception:
        info["redis"] = "?"
    import celery

    info["celery"] = celery.__version__
    return info


def to_json(obj) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        d = asdict(obj)
        for name in ("orch_cpu_ms_per_step", "mem_mb_per_episode", "mem_total_mb_per_episode"):
            if hasattr(obj, name):
                d[name] = getattr(obj, name)
        return d
    return obj


# --------------------------------------------------------------------------- token storage


@dataclass
class TokenStorageResult:
    episodes: int = 0
    turns: int = 0
    sampled_tokens: int = 0  # completion ids: what the model sampled
    stored_ids: int = 0  # prompt ids + completion ids, as stored per step
    token_bytes: int = 0  # ids and logprobs as stored (the step_tokens blobs)
    json_bytes: int = 0  # the same ids and logprobs as JSON text of numbers
    texts_bytes: int = 0  # the sampled tokens' strings kept for the browser
    file_growth_bytes: int = 0  # the SQLite file with tokens minus the same job without
    errors: list[str] = field(default_factory=list)

    @property
    def bytes_per_stored_id(self) -> float:
        return self.token_bytes / max(1, self.stored_ids)

    @property
    def bytes_per_sampled_token(self) -> float:
        return self.token_bytes / max(1, self.sampled_tokens)


def run_token_storage(work: Path, *, episodes: int = 200, turns: int = 5, system_tokens: int = 600,
                      env_tokens: int = 80, completion_tokens: int = 150) -> TokenStorageResult:
    """What token-exact trajectories cost on disk: full-history episodes (each turn's prompt is
    the last one plus the answer and the env's reply) written through the real store twice,
    with and without their token fields; ids packed int32 and logprobs float32 (broker/tokens.py)
    against the same numbers as JSON text."""
    import random

    from broker.records import StepRecord
    from broker.tokens import TOKENS_OK, pack_ids, pack_logprobs
    from consumer.storage import open_store

    res = TokenStorageResult(episodes=episodes, turns=turns)
    rng = random.Random(7)
    folder = Path(tempfile.mkdtemp(prefix="tokens-", dir=work))
    try:
        sizes = {}
        for with_tokens in (False, True):
            path = folder / f"{'with' if with_tokens else 'without'}.sqlite"
            store = open_store(str(path))
            for e in range(episodes):
                prompt = [rng.randrange(50_000) for _ in range(system_tokens)]
                batch = []
                for t in range(1, turns + 1):
                    completion = [rng.randrange(50_000) for _ in range(completion_tokens)]
                    logprobs = [-rng.random() * 4 for _ in completion]
                    texts = [f"tok{i % 997}" for i in completion]
                    step = StepRecord(
                        job_id="bench-tokens", env_id=f"bench-tokens.e{e}", attempt=1, step_id=t, env_name="chat",
                        llm_model="stand-in", group_id=f"g{e // 4}", messages_json=b"[]", response="x" * 600,
                        step_reward=0.0, cumulative_reward=0.0, terminated=t == turns, truncated=False,
                        episode_finished=t == turns, is_trainable=True, attempt_id=f"a{e}",
                        prompt_tokens=len(prompt), completion_tokens=len(completion))
                    if with_tokens:
                        step.token_source, step.token_status = "vllm", TOKENS_OK
                        step.prompt_ids, step.completion_ids = pack_ids(prompt), pack_ids(completion)
                        step.completion_logprobs = pack_logprobs(logprobs)
                        step.completion_token_texts = texts
                        res.sampled_tokens += len(completion)
                        res.stored_ids += len(prompt) + len(completion)
                        res.token_bytes += len(step.prompt_ids) + len(step.completion_ids) + len(
                            step.completion_logprobs)
                        res.json_bytes += len(json.dumps(prompt)) + len(json.dumps(completion)) + len(
                            json.dumps(logprobs))
                        res.texts_bytes += sum(len(x) for x in texts)
                    batch.append(step)
                    prompt = prompt + completion + [rng.randrange(50_000) for _ in range(env_tokens)]
                store.write_batch(batch)
            store.close()
            sizes[with_tokens] = sum(p.stat().st_size for p in folder.glob(path.name + "*"))
        res.file_growth_bytes = sizes[True] - sizes[False]
    except Exception as exc:
        res.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log(f"token storage: {res.bytes_per_stored_id:.2f} bytes per stored id, {res.bytes_per_sampled_token:.1f} per "
        f"sampled token (JSON text: {res.json_bytes / max(1, res.stored_ids):.2f} per id)")
    return res
