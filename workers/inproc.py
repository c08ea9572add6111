"""The inproc transport: an environment class run inside the worker process.

A task entry with ``transport: inproc`` and ``env_class: module:Class`` (contract in
:mod:`envs.base`) is driven through :class:`InprocEnv`, the loop's env port, with
the same rules as the HTTP transport (:mod:`workers.envclient`; the answers are checked by :mod:`workers.envport`):

* Timeouts: every call runs on the instance's own daemon thread and is waited for at most
  ``min(settings.env_read_timeout_s, time left in the attempt)``. No answer in time:
  ``env_unreachable`` (transient: a fresh attempt resets a fresh instance), or
  ``episode_timeout`` when the attempt's budget is what ran out. A call that never returns
  cannot be killed; the instance is then abandoned to its thread (it is not closed, since
  ``close`` would queue behind the stuck call) and the thread ends whenever the call does.
* Answers are normalized like the original driver's ``_normalize_inproc_result`` (dicts,
  lists, pydantic models, JSON bytes), copied through JSON (the env may keep mutating its own
  lists; non-JSON values and answers over ``max_response_bytes`` are ``env_malformed``) and
  then checked by the HTTP client's own validators, so a malformed answer fails with the same
  reason either way. ``reset`` may return None (taken as ``{}``).
* Exceptions: ``ValueError`` (the adapters' ``EnvError``) and ``ImportError`` are a bad
  request: ``env_bad_request``, permanent (as a 4xx). Anything else is a failure inside the
  environment: ``env_server_error``, transient (as a 5xx).
* ``close`` never raises; it has the HTTP client's own budget (``CLOSE_BUDGET_S``, at least
  ``CLOSE_MIN_BUDGET_S`` past the deadline).

One thread per instance keeps each environment's calls on one thread, in order (some libraries
keep thread-local state). Under the gevent pool that thread is a real OS thread (gevent's
thread pool), not a greenlet: an env that computes for seconds neither stalls every other
episode of the worker nor escapes its timeout.
"""

from __future__ import annotations

import inspect
import json
import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EPISODE_TIMEOUT,
    WORKER_SHUTDOWN,
    EpisodeError,
)
from broker.records import EpisodeSpec
from broker.settings import Settings
from envs.base import construct, import_object, normalize_answer
from workers.budget import Budget
from workers.deadlines import deadline_passed, remaining
from workers.envport import (
    CLOSE_BUDGET_S,
    CLOSE_MIN_BUDGET_S,
    StepResult,
    check_prompt_answer,
    check_reset_answer,
    check_step_answer,
)
from workers.http_errors import ERROR_TEXT_CHARS
from workers.http_transport import parse_json
from workers.retries import with_cause

log = logging.getLogger(__name__)

__all__ = ["InprocEnv"]


class _CallThread:
    """A daemon thread that runs submitted calls one after another."""

    def __init__(self, name: str):
        self._q: "queue.SimpleQueue[tuple[Callable[[], Any], Future] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)

    def call(self, fn: Callable[[], Any], timeout: float) -> tuple[bool, bool, Any, BaseException | None]:
        """Run ``fn`` on the thread and wait at most ``timeout``: (done, stuck, result, exception);
        not done and not stuck means it never started (cancelled, the thread is free)."""
        fut: Future = Future()
        self._q.put((fn, fut))
        done, _ = wait_futures([fut], timeout=timeout)
        if not done:
            return False, not fut.cancel(), None, None
        exc = fut.exception()
        return True, False, (None if exc else fut.result()), exc

    def stop(self) -> None:
        self._q.put(None)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


_ENV_CALLS = None  # the process-wide OS lock that serialises env calls under gevent (_OSThread)
# Why this process can run no inproc call any more ("" while it can): a call that never returned
# holds _ENV_CALLS for good. Set once, by the call that holds the lock past its timeout.
_WEDGED: list[str] = []
_HOLDER: list[float] = []  # [the deadline (monotonic) of the call holding _ENV_CALLS], if any


def wedged() -> str:
    return _WEDGED[0] if _WEDGED else ""


class _OSThread:
    """The same, under gevent: a real OS thread (the unpatched ``_thread``) fed by the C
    ``SimpleQueue``, waited for by a greenlet that polls (1 ms doubling to 20 ms), so the hub
    keeps running every other episode meanwhile.

    Not gevent's ThreadPool: its completion wake-up (an async watcher per pool) was seen to be
    lost now and then with a pool per instance, leaving a finished call waited on until its
    timeout. Polling a list the thread appends to cannot lose a wake-up; inproc envs are not
    the per-step hot path that a few idle wake-ups would cost.

    The calls of every instance in the process run one at a time (``_ENV_CALLS``, an OS-level
    lock). Env code runs with gevent's patched locks: two OS threads contending one of them
    (logging's, a library's registry lock) now and then never wake, and the call hangs until
    its timeout (seen: 1 run in 12 of 16 concurrent reasoning-gym and textarena resets; none
    in 16 runs serialized). The GIL serialises CPU-bound env code anyway; what this costs is
    overlap between envs that block on I/O, which belong behind an env server or under the
    threads pool. A call that never returns holds the lock for good, so the first call found
    stuck wedges the process (``_WEDGED``): calls waiting behind it give up at once, and the
    runtime hands their episodes back uncounted and has the process replaced (InprocEnv's
    ``on_wedged``); only the stuck call's own attempt ends as ``env_unreachable``."""

    def __init__(self, name: str):
        import _queue

        from gevent import monkey

        global _ENV_CALLS
        if _ENV_CALLS is None:  # made in the hub's thread, by one greenlet at a time
            _ENV_CALLS = monkey.get_original("_thread", "allocate_lock")()
        self._lock = _ENV_CALLS
        self._q = _queue.SimpleQueue()
        monkey.get_original("_thread", "start_new_thread")(self._loop, ())

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, box, started, end = item
            with self._lock:
                started.append(True)
                _HOLDER[:] = [end]
                try:
                    box.append((fn(), None))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    box.append((None, exc))
                finally:
                    _HOLDER.clear()

    def call(self, fn: Callable[[], Any], timeout: float) -> tuple[bool, bool, Any, BaseException | None]:
        import gevent

        box: list = []
        started: list = []
        end = time.monotonic() + timeout
        self._q.put((fn, box, started, end))
        pause = 0.001
        while not box:
            now = time.monotonic()
            past = now >= end
            holder = _HOLDER[:1]  # one read: the OS thread may clear it meanwhile
            # The call holding the lock past its own timeout never returns: nothing else can run.
            if _WEDGED or (past and (started or (holder and now > holder[0]))):
                if not _WEDGED:
                    _WEDGED.append("an inproc call never returned and holds the process-wide env lock")
                self.wedged_it = bool(started)  # the stuck call itself, not one waiting behind it
                return False, True, None, None
            if past and not (holder and now < end + timeout):
                return False, True, None, None  # queued behind calls that do answer, for too long
            gevent.sleep(min(pause, end - now) if not past else 0.02)
            pause = min(pause * 2, 0.02)
        value, exc = box[0]
        return True, False, value, exc

    def stop(self) -> None:
        self._q.put(None)


def _new_call_thread(name: str):
    if "gevent" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            return _OSThread(name)
    return _CallThread(name)


def _short(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:ERROR_TEXT_CHARS] + ("..." if len(text) > ERROR_TEXT_CHARS else "")


class InprocEnv:
    """The loop's env port for one episode of an inproc environment class."""

    def __init__(self, spec: EpisodeSpec, budget: Budget | float, settings: Settings,
                 on_wedged: Callable[[str], None] = lambda reason: None):
        self.spec = spec
        self.on_wedged = on_wedged  # told once this process can run no inproc call any more
        self.budget = budget if isinstance(budget, Budget) else Budget.until(budget)
        self.settings = settings
        self.env: Any = None
        self._runner: _CallThread | None = None
        self._stuck = False

    @property
    def deadline(self) -> float:
        return self.budget.deadline

    def __repr__(self) -> str:
        return f"InprocEnv({self.spec.env_class!r}, {self.spec.env_name}/{self.spec.episode_id})"

    # ---- the protocol calls ------------------------------------------------------------
    def reset(self) -> dict:
        s = self.spec
        what = f"reset {s.env_name}/{s.episode_id} (inproc {s.env_class})"
        if not s.env_class:
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: the episode names no env_class")

        def create_and_reset() -> Any:
            try:
                cls = import_object(s.env_class)
            except (ImportError, AttributeError) as exc:
                raise ImportError(f"cannot import env_class {s.env_class!r} in this worker: {_short(exc)}") from exc
            if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None))
                                                   for m in ("reset", "get_task_prompt", "step")):
                raise ImportError(f"env_class {s.env_class!r} is not an environment class "
                                  "(a class with reset, get_task_prompt and step)")
            self.env = construct(cls, s.env_name)
            return self.env.reset(s.env_params, s.seed)

        raw = self._call(what, create_and_reset)
        return check_reset_answer({} if raw is None else self._answer(raw, what), what)

    def get_task_prompt(self) -> list | dict:
        s = self.spec
        what = f"get_task_prompt {s.env_name}/{s.episode_id} (inproc)"
        env = self._env(what)
        return check_prompt_answer(self._answer(self._call(what, env.get_task_prompt), what), what)

    def step(self, action: str, tool_calls: list | None = None) -> StepResult:
        s = self.spec
        what = f"step {s.env_name}/{s.episode_id} (inproc)"
        env = self._env(what)
        # the model's tool calls only to a class whose prompt offered tools and that got some
        raw = self._call(what, (lambda: env.step(action, tool_calls=tool_calls)) if tool_calls else (lambda: env.step(action)))
        return check_step_answer(self._answer(raw, what), what)

    def close(self) -> None:
        """Best effort, never raises; stops the instance's thread."""
        s = self.spec
        what = f"close {s.env_name}/{s.episode_id} (inproc)"
        runner, env = self._runner, self.env
        self._runner = None
        if runner is None:
            return
        try:
            if self._stuck:
                log.warning("%s: skipped, a call of this instance never returned; instance abandoned", what)
            elif env is not None and hasattr(env, "close"):
                now = time.monotonic()
                budget = min(CLOSE_BUDGET_S, max(self.deadline - now, CLOSE_MIN_BUDGET_S))
                done, _, _, exc = runner.call(env.close, budget)
                if wedged():
                    self.on_wedged(wedged())
                if not done:
                    log.warning("%s: no answer within %.1fs; instance abandoned", what, budget)
                elif exc is not None:
                    log.warning("%s failed: %s", what, _short(exc))
        except Exception as exc:  # never raise from close
            log.warning("%s failed unexpectedly: %s", what, type(exc).__name__, exc_info=True)
        finally:
            runner.stop()
            self.env = None

    # ---- plumbing -----------------------------------------------------------------------
    def _env(self, what: str) -> Any:
        if self.env is None:
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: the instance was not reset")
        return self.env

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        s = self.settings
        left = remaining(self.deadline)
        if left <= 0:
            raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out")
        if self._stuck:
            raise EpisodeError(ENV_UNREACHABLE, f"{what}: an earlier call of this instance never returned")
        if wedged():
            raise EpisodeError(WORKER_SHUTDOWN, f"{what}: this worker process is being replaced ({wedged()}); "
                               "episode handed back", transient=True)
        if self._runner is None:
            self._runner = _new_call_thread(f"inproc:{self.spec.episode_id}")
        timeout = min(s.env_read_timeout_s, left)
        done, stuck, result, exc = self._runner.call(fn, timeout)
        if not done:
            self._stuck = stuck  # cancelled before it started: the thread is free
            if wedged():
                self.on_wedged(wedged())
                if not getattr(self._runner, "wedged_it", False):  # only waiting behind the stuck call
                    raise EpisodeError(WORKER_SHUTDOWN, f"{what}: this worker process is being replaced "
                                       f"({wedged()}); episode handed back", transient=True)
            if deadline_passed(self.deadline):
                raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out waiting for the env")
            raise EpisodeError(ENV_UNREACHABLE, f"{what}: no answer within {timeout:.1f}s (env_read_timeout_s)")
        if exc is None:
            return result
        if isinstance(exc, (ValueError, ImportError)):
            raise with_cause(EpisodeError(ENV_BAD_REQUEST, f"{what}: {_short(exc)}"), exc)
        if isinstance(exc, EpisodeError):
            raise exc
        log.warning("%s raised %s", what, type(exc).__name__, exc_info=exc)
        raise with_cause(EpisodeError(ENV_SERVER_ERROR, f"{what}: failure inside the env: {_short(exc)}"), exc)

    def _answer(self, raw: Any, what: str) -> Any:
        """A copy of the answer through JSON text, read back as the HTTP client reads a body
        (so NaN, lone surrogates and the like fail here exactly as they would over HTTP)."""
        try:
            obj = normalize_answer(raw)
            data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError, RecursionError) as exc:
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer is not JSON data ({_short(exc)})") from None
        if len(data) > self.settings.max_response_bytes:
            raise EpisodeError(
                ENV_MALFORMED,
                f"{what}: answer larger than max_response_bytes={self.settings.max_response_bytes} ({len(data)} bytes)",
            )
        try:
            return parse_json(data)
        except ValueError as exc:
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer is not JSON data ({_short(exc)})") from None
