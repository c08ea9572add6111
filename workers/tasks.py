"""The Celery side of a worker: one task, wired to a per-process :class:`WorkerRuntime`.

Run with ``interactor worker`` (or ``celery -A workers.tasks worker``); settings come from
the environment (``REDIS_URL``, ``INTERACTOR_*``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time

import redis.exceptions
from celery import signals
from celery.backends.base import DisabledBackend
from celery.exceptions import Reject

from broker.celery_app import EPISODE_TASK, make_app
from broker.keys import member
from broker.settings import Settings
from workers.runner import WorkerRuntime

log = logging.getLogger("interactor.worker")

settings = Settings.from_env()
app = make_app(settings, worker_consumer="workers.celery_consumer:EpisodeConsumer")

_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()
_last_received = [time.monotonic()]  # when the consumer last handed us a task (consumer watch)
_watch = None


def runtime() -> WorkerRuntime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = WorkerRuntime(settings)
                _runtime.on_unhealthy = _replace_this_process
    return _runtime


def _replace_this_process(reason: str) -> None:
    # A warm shutdown of our own: Celery stops consuming, the running episodes hand themselves
    # back (the runtime set their shutdown clock to now), and the process exits. Not asked to
    # by a signal of its own, the supervisor (interactor/cli.py) starts a fresh process.
    log.error("exiting to be replaced by a fresh worker process: %s", reason)
    os.kill(os.getpid(), signal.SIGTERM)


# One results backend for the task, set on it: Celery keeps a non-thread-safe backend per
# thread, and under the gevent pool every episode's greenlet is a new "thread", so it built a
# fresh DisabledBackend per episode (a twentieth of a single-turn episode's worker CPU).
@app.task(name=EPISODE_TASK, backend=DisabledBackend(app))
def run_episode_task(job_id: str, episode_id: str) -> None:
    if runtime().unhealthy_reason:  # on its way out: the next process runs it
        raise Reject(runtime().unhealthy_reason, requeue=True)
    try:
        runtime().run(job_id, episode_id)
    except redis.exceptions.RedisError as exc:
        # Redis away past the outage budget (the runtime retries START and the close through
        # shorter outages, with one attempt_id, so a START whose reply was lost is found again
        # as ours). The episode's state is in Redis, so hand the message back rather than
        # acknowledging it as done.
        log.error("episode %s: Redis unavailable (%s); message requeued", episode_id, exc)
        raise Reject(str(exc), requeue=True) from None


@signals.task_received.connect
def _reserve(request=None, **_):
    # Received (prefetched) is not started: hold a reservation so that a worker dying in
    # between does not leave the episode waiting for the broker's visibility timeout.
    if request is not None and request.name == EPISODE_TASK:
        _last_received[0] = time.monotonic()
        try:
            job_id, episode_id = request.args[:2]
            runtime().received(job_id, episode_id)
        except Exception:
            log.exception("could not reserve a received episode (the sweeper's reconcile still covers it)")


def _episodes_in_hand() -> set[str]:
    """The episodes of the requests Celery holds, received and not finished (a message whose
    arguments are not an episode's names none)."""
    from celery.worker import state

    held = set()
    for request in list(state.reserved_requests):
        try:
            if request.name == EPISODE_TASK:
                job_id, episode_id = request.args[:2]
                held.add(member(str(job_id), str(episode_id)))
        except Exception:  # noqa: BLE001 - a message is untrusted input; it must not stop renewals
            continue
    return held


@signals.worker_ready.connect
def _start_runtime(**_):
    # At start, not on the first task: the runtime's sweeper must run in an idle worker too,
    # or a fleet with no consumer up would never re-run a dead worker's episodes.
    rt = runtime()
    rt.renewer.in_hand = _episodes_in_hand
    global _watch
    if settings.worker_stall_s > 0 and _watch is None:
        from celery.worker import state

        from workers.consumer_watch import ConsumerWatch

        _watch = ConsumerWatch(
            rt.redis, settings.served_queues, settings.concurrency * app.conf.worker_prefetch_multiplier,
            in_hand=lambda: len(state.reserved_requests), last_received=lambda: _last_received[0],
            on_stall=_replace_this_process, stall_s=settings.worker_stall_s,
            stopping=lambda: rt.shutdown_at is not None).start()


@signals.worker_process_init.connect
def _fresh_runtime_after_fork(**_):
    # A prefork child must not share the parent's sockets or renewal thread.
    global _runtime
    _runtime = None


@signals.after_setup_logger.connect
def _quiet_per_task_lines(**_):
    # Celery logs two INFO lines per task ("received", "succeeded in"); our own per-episode
    # line says more, and at a thousand episodes a minute the pair costs real CPU.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)


@signals.worker_shutting_down.connect
def _on_shutdown(**_):
    if _runtime is not None:
        _runtime.begin_shutdown()
    # The running episodes are handed back at the grace; what must not happen is a process that
    # never ends: Celery's warm shutdown retries its broker without limit, and a worker whose
    # Redis is gone for good (the run that started it was killed) lived on as an orphan. At this
    # deadline the kernel ends the process, whatever it is stuck in (SIGALRM's default action;
    # nothing here handles SIGALRM).
    signal.alarm(max(1, math.ceil(settings.shutdown_grace_s + settings.shutdown_hard_exit_s)))
    if _watch is not None:
        _watch.stop()
