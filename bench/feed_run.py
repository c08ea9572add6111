"""The rollout feed's run: a continuous job at concurrency C served by ``interactor feed serve``
to a trainer loop in this process, measured over a window (group delivery latency, trainer
idle fraction)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from bench.benchlog import log
from bench.cluster import Cluster, child_env
from bench.cluster import LoadSpec
from bench.load_runs import write_countdown_tasks
from bench.measures import percentiles
from broker.keys import Keys
from broker.ledger import Ledger
from broker.redisconn import client_for
from broker.settings import Settings
from broker.states import AttemptStatus, LedgerState
from interactor.children import spawn
from interactor.children import stop as stop_process

if TYPE_CHECKING:
    from interactor.feed_client import Feed


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


class _Trainer:
    """The trainer loop of a feed run, in its own thread: take a batch, acknowledge it, train
    for ``train_s``, again. It records each take (started, returned, group ids: wall clock)."""

    def __init__(self, feed: Feed, batch: int, train_s: float):
        self.feed, self.batch, self.train_s = feed, batch, train_s
        self.stop = threading.Event()
        self.takes: list[tuple[float, float, list[str]]] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bench-trainer")

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                t0 = time.time()
                groups = self.feed.take(self.batch, timeout=5.0)
                t1 = time.time()
                ids = [g["group_id"] for g in groups]
                self.takes.append((t0, t1, ids))
                if ids:
                    self.feed.ack(ids)
                self.stop.wait(self.train_s)  # training on the batch
            except Exception as exc:  # noqa: BLE001 - reported in the table
                self.errors.append(f"trainer: {type(exc).__name__}: {exc}")
                self.stop.wait(1.0)

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(10)


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

    folder = Path(tempfile.mkdtemp(prefix=f"feed-{spec.concurrency}-", dir=work)).resolve()
    res = FeedResult(spec, train_s=train_s)
    res.batch, res.max_ahead = feed_shape(spec, res.group, train_s)
    cluster = Cluster(folder, spec, src=src, base=base)
    feed_p = None
    trainer = None
    log(f"feed run: concurrency {spec.concurrency}, batch {res.batch} groups per take, max_ahead {res.max_ahead}, "
        f"training {train_s:g} s per batch")
    try:
        settings = cluster.start().replace(feed_max_ahead=res.max_ahead)
        client = client_for(settings.redis_url)
        keys = Keys(settings.key_prefix)
        cluster.wait_workers_ready()
        job_id, feed_p, url = _serve_feed_job(res, cluster, settings, client, folder, src)
        f = Feed(url, trainer="bench-trainer")
        trainer = _Trainer(f, res.batch, train_s)
        trainer.thread.start()
        ledger = Ledger(client, keys, settings.lease_ttl_s)
        _feed_ramp(res, spec, ledger, job_id, feed_p, cluster)
        # Groups complete only after an episode's length: the window opens once they flow.
        first = time.monotonic() + 2 * spec.steps * spec.step_latency_s + 30
        while not any(t[2] for t in trainer.takes) and time.monotonic() < first:
            time.sleep(0.1)
        time.sleep(spec.warmup_s)
        t0 = time.time()
        time.sleep(spec.window_s)
        t1 = time.time()
        res.window_s = t1 - t0
        trainer.halt()
        res.stats = f.stats()
        _feed_figures(res, trainer.takes, t0, t1, settings.results_db, job_id)
        res.errors += cluster.exit_problems(("feed", feed_p))
        client.close()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res.errors.append(f"{type(exc).__name__}: {exc}")
        log(f"feed run failed: {exc}")
    finally:
        if trainer is not None:
            trainer.halt()
        stop_process(feed_p, 30, signal.SIGTERM)
        cluster.stop()
    if trainer is not None:
        res.errors.extend(sorted(set(trainer.errors)))
    log(f"  {res.groups} groups in {res.takes} takes ({res.rate:.1f}/s); delivery latency p50 "
        f"{res.latency_ms.get('p50', float('nan')):.0f} ms, p99 {res.latency_ms.get('p99', float('nan')):.0f} ms; "
        f"trainer idle {res.idle_fraction:.3f}" + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _serve_feed_job(res: FeedResult, cluster: Cluster, settings: Settings, client: redis.Redis, folder: Path,
                    src: str | None) -> tuple[str, subprocess.Popen, str]:
    """Create the continuous job and start its feed server: (job id, server, its URL)."""
    from producer.continuous import create_continuous_job

    spec = cluster.spec
    tasks = write_countdown_tasks(folder, cluster.env_url, max(res.group, spec.concurrency), spec.steps,
                                  res.group)
    job_id = create_continuous_job(client, settings, [tasks], job_id=f"bench-feed-{uuid.uuid4().hex[:6]}",
                                   seed=1).job_id
    feed_p, url = _start_feed_server([sys.executable, "-m", "interactor.cli", "feed", "serve", "--job", job_id,
                                      "--port", "0"],
                                     child_env(settings, src), cluster.logs / "feed.log", cluster.cwd)
    return job_id, feed_p, url


def _feed_ramp(res: FeedResult, spec: LoadSpec, ledger: Ledger, job_id: str, feed_p: subprocess.Popen,
               cluster: Cluster) -> None:
    """Until every slot runs an episode, or the ramp's time is up (then the table says how many ran)."""
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


def _feed_figures(res: FeedResult, takes: list[tuple[float, float, list[str]]], t0: float, t1: float, db: str,
                  job_id: str) -> None:
    """The window's takes, the trainer's wait in them, and each delivered group's latency from
    its stored completion."""
    window = [t for t in takes if t0 <= t[1] <= t1]
    res.takes = len(window)
    res.wait_s = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in takes)
    res.idle_fraction = res.wait_s / res.window_s
    taken_at = {gid: b for _, b, ids in window for gid in ids}
    res.groups = len(taken_at)
    res.rate = res.groups / res.window_s
    done_at = _groups_completed(db, job_id)
    lat = [1000 * (b - done_at[g]) for g, b in taken_at.items() if g in done_at]
    if len(lat) < len(taken_at):
        res.errors.append(f"{len(taken_at) - len(lat)} delivered groups without a stored completion")
    res.latency_ms = percentiles(lat)
    res.latency_n = len(lat)
    if not res.groups:
        res.errors.append("no group was delivered in the window")


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
