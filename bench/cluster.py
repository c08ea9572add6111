"""The processes of one run, started in a fresh folder and stopped at its end: an embedded Redis
(and a replica when the run asks for one), the two stand-ins (bench/standins.py) in their own
processes (their own, or ones a comparison shares between runs: ``Standins``), ``interactor
worker`` processes and the consumer (bench/consumer.py: ``interactor consumer`` plus a latency
observer); and the load they are started for (:class:`LoadSpec`)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import psutil
import redis

from bench.measures import procs
from broker.caps import MAX_CONCURRENCY, Limits
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.redisconn import client_for
from broker.settings import Settings
from interactor.children import role_command, spawn
from interactor.children import stop as stop_process

ROOT = Path(__file__).resolve().parent.parent


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
    # A new attempt may continue its predecessor's env instance (broker/resume.py): on by
    # default, as for a job; off, the workers keep no progress snapshots (the "resume" part).
    resume: bool = True
    # A replica beside the primary (its CPU counted as Redis's), and whether the commit points
    # wait for it (broker/replicas.py: the "waits" part measures the same load off and on).
    replica: bool = False
    redis_wait: str = "off"

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


def start_listening(cmd: list[str], env: dict, log_path: Path, cwd: str) -> tuple[subprocess.Popen, str]:
    """Start a server that prints ``listening on URL`` first; return it and its URL."""
    logf = open(log_path, "ab")
    p = spawn(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=logf)
    logf.close()
    line = p.stdout.readline().decode()
    if "listening on" not in line:
        p.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start: {line!r} (see {log_path})")
    return p, line.split("listening on", 1)[1].strip()


def child_env(settings: Settings, src: str | None) -> dict:
    """A child's environment: this one's without our settings, then exactly ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    env["PYTHONUNBUFFERED"] = "1"
    if src:  # run another checkout of the code (before/after comparisons)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Standins:
    """The env and model stand-ins (bench/standins.py), each in its own process."""

    def __init__(self, env_p: subprocess.Popen, model_p: subprocess.Popen, env_url: str, model_url: str):
        self.env_p, self.model_p = env_p, model_p
        self.env_url, self.model_url = env_url, model_url

    @classmethod
    def start(cls, spec: LoadSpec, env: dict, logs: Path, cwd: str) -> "Standins":
        py = sys.executable
        logs.mkdir(parents=True, exist_ok=True)
        env_p, env_url = start_listening(
            [py, "-m", "bench.standins", "env", "--port", "0", "--latency-ms", str(spec.env_latency_ms)],
            env, logs / "env.log", cwd)
        try:
            model_p, model_url = start_listening(
                [py, "-m", "bench.standins", "model", "--port", "0", "--latency-ms", str(spec.model_latency_ms)],
                env, logs / "model.log", cwd)
        except Exception:
            stop_process(env_p, 10, signal.SIGTERM)
            raise
        return cls(env_p, model_p, env_url, model_url)

    def stop(self) -> None:
        for p in (self.env_p, self.model_p):
            stop_process(p, 10, signal.SIGTERM)


class Cluster:
    """Redis, stand-ins, workers and consumer of one load run, in ``folder``. Given
    ``standins``, the run uses those (and leaves them running) instead of starting its own."""

    def __init__(self, folder: Path, spec: LoadSpec, *, src: str | None = None, base: Settings | None = None,
                 standins: Standins | None = None):
        self.folder = folder
        self.spec = spec
        self.src = src
        self.cwd = src or str(ROOT)
        self.base = base or Settings.from_env({})
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis: EmbeddedRedis | None = None
        self.replica: EmbeddedRedis | None = None
        self.env_p = self.model_p = self.consumer_p = None
        self.standins = standins
        self.own_standins = standins is None
        self.workers: list[subprocess.Popen] = []
        self.latency_file = folder / "latency.bin"

    def start(self) -> Settings:
        spec = self.spec
        self.redis = EmbeddedRedis(self.folder / "redis").start()
        if spec.replica:
            self.replica = start_replica(self.redis, self.folder / "replica")
        py = sys.executable
        plain = child_env(self.base, self.src)
        if self.standins is None:
            self.standins = Standins.start(spec, plain, self.logs, self.cwd)
        st = self.standins
        self.env_p, self.model_p, env_url, model_url = st.env_p, st.model_p, st.env_url, st.model_url
        per_worker = max(1, -(-spec.concurrency // spec.workers))
        # The first wave spread over one model latency (llm_startup_jitter_s, what a fleet
        # starting at once should use): with identical latencies, episodes started together
        # would otherwise step in lockstep for the whole run, and a window would count 19 or 20
        # bursts of C steps depending on where it falls (+-5% at 20 s).
        s = self.base.replace(
            redis_url=self.redis.url, run_dir=str(self.folder), db_path=str(self.folder / "results.sqlite"),
            env_base_url=env_url, llm_base_url=model_url + "/v1", model="stand-in", pool=spec.pool,
            concurrency=per_worker, max_steps=max(spec.steps, 1), llm_startup_jitter_s=spec.model_latency_ms / 1000,
            redis_wait=spec.redis_wait,
        )
        self.settings = s
        self.env_url, self.model_url = env_url, model_url
        env = child_env(s, self.src)
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
            "workers": [pr for w in self.workers for pr in procs(w)],
            "consumer": procs(self.consumer_p),
            "redis": procs(self.redis.proc if self.redis else None)
            + procs(self.replica.proc if self.replica else None),
            "env": procs(self.env_p),
            "model": procs(self.model_p),
        }

    def exit_problems(self, *others: tuple[str, subprocess.Popen]) -> list[str]:
        """A line for each of the consumer, ``others`` (name, process) and the workers that has
        exited, in that order."""
        named = [("consumer", self.consumer_p), *others] + [(f"worker{i + 1}", w) for i, w in enumerate(self.workers)]
        return [f"{name} exited with {p.returncode} (see {self.logs / (name + '.log')})"
                for name, p in named if p.poll() is not None]

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
        if self.own_standins and self.standins is not None:
            self.standins.stop()
        stop_process(self.consumer_p, 60, signal.SIGTERM)
        for server in (self.replica, self.redis):
            if server:
                server.stop()

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


def start_replica(primary: EmbeddedRedis, folder: Path, timeout: float = 60.0) -> EmbeddedRedis:
    """A replica of ``primary`` on loopback, returned once it is in sync."""
    replica = EmbeddedRedis(folder, password=primary.password, replica_of=primary.port).start()
    client = client_for(primary.url)
    deadline = time.monotonic() + timeout
    while (client.info("replication").get("slave0") or {}).get("state") != "online":
        if time.monotonic() > deadline:
            replica.stop()
            raise RuntimeError("the bench's replica did not get in sync")
        time.sleep(0.1)
    client.close()
    return replica
