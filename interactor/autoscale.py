"""Queue-depth autoscaling: one policy, applied to local worker processes.

The policy (:class:`Policy`) is the Kubernetes HPA's, which is what KEDA drives in
``deploy/k8s`` (see docs/deployment.md for the mapping):

* ``recommended = ceil((queued + running) / target_per_worker)``, clamped to ``[min, max]``;
  ``queued`` is every priority sub-queue of the served queues, ``running`` the episode tasks
  delivered to workers and not acknowledged yet (kombu's ``unacked``).
* Scaling up is immediate. Scaling down takes the *highest* recommendation of the last
  ``scale_down_cooldown_s`` (the HPA's scale-down stabilization window), so a queue that
  empties for a moment does not shed workers that are needed again a second later.

:class:`LocalScaler` applies it to ``interactor worker`` child processes: it starts more when
the queue grows and, when it drains, stops only *idle* workers (no episode lease), with SIGTERM:
Celery's warm shutdown (stop taking tasks, hand back prefetched ones, let running ones finish;
our runtime hands an episode back only if it is still running after ``shutdown_grace_s``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import redis

from broker.keys import Keys
from broker.ledger import Ledger
from broker.settings import Settings
from broker.states import LedgerState
from interactor.children import descendants, kill_tree, spawn_role
from interactor.fleet_reader import FleetReader

log = logging.getLogger("interactor.autoscale")


@dataclass(frozen=True)
class Policy:
    min_workers: int = 0
    max_workers: int = 4
    target_per_worker: int = 16  # queued + running episodes one worker should carry
    scale_down_cooldown_s: float = 60.0

    def __post_init__(self):
        if self.min_workers < 0 or self.max_workers < max(1, self.min_workers):
            raise ValueError(f"need 0 <= min <= max and max >= 1, got min={self.min_workers} max={self.max_workers}")
        if self.target_per_worker < 1:
            raise ValueError("target_per_worker must be >= 1")
        if self.scale_down_cooldown_s < 0:
            raise ValueError("scale_down_cooldown_s must be >= 0")

    def recommend(self, queued: int, running: int) -> int:
        """Workers wanted for this load, before the cooldown."""
        want = math.ceil(max(0, queued + running) / self.target_per_worker)
        return max(self.min_workers, min(self.max_workers, want))


@dataclass
class Decider:
    """The policy over time: immediate scale-up, stabilized scale-down."""

    policy: Policy
    _history: deque = field(default_factory=deque)  # (t, recommendation)

    def desired(self, queued: int, running: int, now: float) -> int:
        rec = self.policy.recommend(queued, running)
        self._history.append((now, rec))
        horizon = now - self.policy.scale_down_cooldown_s
        while self._history and self._history[0][0] < horizon:
            self._history.popleft()
        return max(r for _, r in self._history)


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen
    started_at: float
    stopping_since: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


def leases_by_pid(client: redis.Redis, keys: Keys, hostname: str) -> dict[int, int]:
    """Live episode leases per worker pid on this host (lease tokens are ``<host>-<pid>:...``)."""
    out: dict[int, int] = {}
    for token in Ledger(client, keys).live_lease_tokens():
        worker = token.split(":", 1)[0]
        host, _, pid = worker.rpartition("-")
        if host == hostname and pid.isdigit():
            out[int(pid)] = out.get(int(pid), 0) + 1
    return out


class LocalScaler:
    """Runs ``interactor worker`` processes on this machine, as many as the policy says."""

    def __init__(self, settings: Settings, policy: Policy, *, client: redis.Redis, name: str = "as",
                 log_dir: str | None = None, hard_stop_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.policy = policy
        self.decider = Decider(policy)
        self.r = client
        self.keys = Keys(settings.key_prefix)
        self.reader = FleetReader(client, settings)
        self.name = name
        self.log_dir = log_dir
        self.clock = clock
        # A worker that ignores SIGTERM this long past its grace is killed; its leases expire
        # and the sweeper re-queues its episodes.
        self.hard_stop_after_s = (settings.shutdown_grace_s + 60) if hard_stop_after_s is None else hard_stop_after_s
        self.workers: list[WorkerProc] = []  # serving
        self.stopping: list[WorkerProc] = []  # warm shutdown under way
        self.last: dict = {}
        self.peak = 0
        self._seq = 0
        import socket

        self.hostname = socket.gethostname()
        self.env = {**os.environ, **settings.as_environ(), "PYTHONUNBUFFERED": "1"}

    # --- load --------------------------------------------------------------------------
    def load(self) -> tuple[int, int]:
        queues = self.settings.served_queues
        depths = self.reader.queue_depths(queues)
        inflight = self.reader.inflight()
        return sum(sum(d.values()) for d in depths.values()), sum(inflight.get(q, 0) for q in queues)

    # --- processes -----------------------------------------------------------------------
    def _spawn(self) -> WorkerProc:
        self._seq += 1
        name = f"{self.name}-{self._seq}"
        # Own session (children.spawn): a Ctrl-C meant for the autoscaler must not cold-stop them.
        proc = spawn_role("worker", name, env=self.env, extra=["--queues", ",".join(self.settings.served_queues)],
                          log_path=os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None)
        w = WorkerProc(name, proc, self.clock())
        log.info("started worker %s (pid %d)", name, proc.pid)
        return w

    def _stop(self, w: WorkerProc, why: str) -> None:
        try:
            os.kill(w.pid, signal.SIGTERM)  # Celery: warm shutdown
        except ProcessLookupError:
            pass
        w.stopping_since = self.clock()
        self.stopping.append(w)
        log.info("stopping worker %s (pid %d): %s", w.name, w.pid, why)

    def _reap(self) -> None:
        for w in list(self.workers):
            if not w.alive():
                self.workers.remove(w)
                log.warning("worker %s exited unexpectedly with %s", w.name, w.proc.returncode)
        for w in list(self.stopping):
            if not w.alive():
                self.stopping.remove(w)
                log.info("worker %s stopped (exit %s)", w.name, w.proc.returncode)
            elif self.clock() - w.stopping_since > self.hard_stop_after_s:
                log.error("worker %s still running %.0fs after SIGTERM; killing it", w.name, self.hard_stop_after_s)
                kill_tree(w.proc)

    # --- one round ---------------------------------------------------------------------------
    def tick(self) -> dict:
        self._reap()
        queued, running = self.load()
        desired = self.decider.desired(queued, running, self.clock())
        current = len(self.workers)
        if desired > current:
            for _ in range(desired - current):
                self.workers.append(self._spawn())
        elif desired < current:
            self._scale_down(current - desired)
        self.peak = max(self.peak, len(self.workers))
        self.last = {LedgerState.QUEUED: queued, LedgerState.RUNNING: running, "desired": desired,
                     "workers": len(self.workers),
                     "stopping": len(self.stopping)}
        if current != len(self.workers) or desired != current:
            log.info("autoscale: queued=%d running=%d desired=%d workers %d -> %d (stopping %d)", queued,
                     running, desired, current, len(self.workers), len(self.stopping))
        return self.last

    def _scale_down(self, n: int) -> None:
        try:
            busy = leases_by_pid(self.r, self.keys, self.hostname)
        except redis.RedisError as exc:
            log.warning("cannot see leases (%s); not scaling down this round", exc)
            return
        # Only idle workers go: a worker holding a lease is running an episode. Youngest first
        # among the idle (the oldest have warm connections and caches).
        idle = [w for w in self.workers if not any(busy.get(p, 0) for p in descendants(w.pid))]
        for w in sorted(idle, key=lambda w: w.started_at, reverse=True)[:n]:
            self.workers.remove(w)
            self._stop(w, "idle, queue drained")

    def stop_all(self, timeout: float | None = None) -> None:
        """Warm-stop every worker and wait for them (the autoscaler itself is stopping)."""
        for w in list(self.workers):
            self.workers.remove(w)
            self._stop(w, "autoscaler stopping")
        deadline = self.clock() + (self.hard_stop_after_s if timeout is None else timeout)
        while self.stopping and self.clock() < deadline:
            self._reap()
            time.sleep(0.2)
        for w in self.stopping:
            kill_tree(w.proc)
            w.proc.wait(10)
        self.stopping.clear()

    def run(self, stop, interval_s: float = 5.0) -> None:
        log.info("autoscaling workers for queues %s: min=%d max=%d target=%d per worker, cooldown %.0fs",
                 ",".join(self.settings.served_queues), self.policy.min_workers, self.policy.max_workers,
                 self.policy.target_per_worker, self.policy.scale_down_cooldown_s)
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except redis.RedisError as exc:
                    log.warning("Redis unavailable (%s); keeping %d workers", exc, len(self.workers))
                stop.wait(interval_s)
        finally:
            self.stop_all()


AUTOSCALER_METRIC_NAMES = ("interactor_autoscaler_workers", "interactor_autoscaler_desired_workers",
                           "interactor_autoscaler_queued", "interactor_autoscaler_running",
                           "interactor_autoscaler_peak_workers")


def autoscaler_registry(scaler: LocalScaler):
    """Prometheus gauges of the autoscaler itself (its fleet view is `interactor metrics`)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    class _Collector:
        def describe(self):
            return []

        def collect(self):
            w = GaugeMetricFamily("interactor_autoscaler_workers", "Worker processes of this autoscaler",
                                  labels=["state"])
            w.add_metric(["serving"], len(scaler.workers))
            w.add_metric(["stopping"], len(scaler.stopping))
            yield w
            for name, key, doc in (("interactor_autoscaler_desired_workers", "desired", "Workers the policy wants"),
                                   ("interactor_autoscaler_queued", LedgerState.QUEUED, "Queued episodes seen"),
                                   ("interactor_autoscaler_running", LedgerState.RUNNING, "In-flight episodes seen")):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], scaler.last.get(key, 0))
                yield g
            p = GaugeMetricFamily("interactor_autoscaler_peak_workers", "Most workers serving at once")
            p.add_metric([], scaler.peak)
            yield p

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return reg
