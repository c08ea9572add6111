"""Child processes of the command line, started and stopped one way everywhere: `interactor
run`/`demo` (localrun), the worker supervisor (cli), the autoscaler and the benchmark harness.

* Children get a session of their own: a terminal's Ctrl-C reaches only the parent, which
  passes it on once (Celery reads a second SIGINT as a cold shutdown).
* Stopping is SIGTERM (Celery's warm shutdown, the consumer's drain), a grace period, then
  SIGKILL for whatever is left.
* :func:`stop_event` is the foreground commands' SIGTERM/SIGINT handling.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

__all__ = ["role_command", "spawn", "spawn_role", "terminate", "stop_event", "wait_for_signal", "die_with_parent"]


def role_command(role: str, name: str = "", *extra: str) -> list[str]:
    """``python -m interactor.cli <role> --name ...``: a worker's name gets ``@%h`` (Celery's
    host suffix) unless it has one."""
    cmd = [sys.executable, "-m", "interactor.cli", role]
    if name:
        cmd += ["--name", name if role != "worker" or "@" in name else f"{name}@%h"]
    return [*cmd, *extra]


def spawn(cmd: list[str], *, env: dict | None = None, log_path: str | os.PathLike | None = None,
          cwd: str | None = None, **popen_kw) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdin closed, output appended to ``log_path`` (or
    inherited when None)."""
    out = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True, **popen_kw)
    finally:
        if out:
            out.close()


def spawn_role(role: str, name: str, *, env: dict | None = None, log_path=None, extra: Iterable[str] = (),
               cwd: str | None = None) -> subprocess.Popen:
    """A worker or consumer (or any other role) as a child process."""
    return spawn(role_command(role, name, *extra), env=env, log_path=log_path, cwd=cwd)


def terminate(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process still running, wait up to ``grace_s`` for all of them, SIGKILL the
    rest. (A worker's supervisor passes SIGTERM on to its Celery process, which dies with it.)"""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def stop_event() -> threading.Event:
    """An event that SIGTERM or SIGINT sets (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_signal() -> None:
    """Block the foreground until SIGTERM or SIGINT."""
    stop = stop_event()
    while not stop.wait(1.0):
        pass


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
