"""Child processes, started and stopped one way everywhere: `interactor run`/`demo`
(localrun), the worker supervisor (cli), the autoscaler, the benchmark harness and the tests'
processes (tests/conftest.py).

* Children get a session of their own: a terminal's Ctrl-C reaches only the parent, which
  passes it on once (Celery reads a second SIGINT as a cold shutdown).
* Stopping is SIGTERM (Celery's warm shutdown, the consumer's drain), a grace period, then
  SIGKILL for whatever is left.
* Foreground commands stop on SIGTERM and SIGHUP as on Ctrl-C: :func:`stop_event` for the
  long-running roles, :func:`interrupt_on_signals` for ``run``/``demo`` (which raise
  :class:`Interrupted`, a ``KeyboardInterrupt``, and exit with 128 + the signal number).
* A parent that dies without a word (SIGKILL, a crash, the OOM killer) takes its children with
  it, because a child in its own session would otherwise live on and keep working:

  - every child that :func:`spawn` starts from the main thread gets SIGTERM from the kernel
    when its parent dies (Linux ``PR_SET_PDEATHSIG``), so it stops the way it stops on
    ``kill``: workers hand back their episodes uncounted, the consumer commits what it holds;
  - every ``interactor`` command started by :func:`spawn` also watches its parent itself
    (:func:`watch_parent`, any platform) and sends itself SIGTERM when it is gone;
  - what must outlive its siblings (the embedded Redis, which they need to hand back their
    episodes), or cannot watch anyone, is left to a :class:`Guard`: a small process that
    notices the parent's death by the end of a pipe and stops the children stage by stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["role_command", "spawn", "spawn_role", "terminate", "stop", "signal_group", "kill_tree", "stop_event", "wait_for_signal",
           "watch_parent", "descendants", "catch", "Guard", "Interrupted", "interrupt_on_signals", "exit_code", "PARENT_ENV"]

# Set by spawn() in a child's environment: the pid the child should find as its parent.
PARENT_ENV = "INTERACTOR_PARENT_PID"
# How often a child looks for its parent: a dead parent's children stop within about this.
WATCH_INTERVAL_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_GUARD_DONE = "done"  # told to the guard on its stdin: we stopped our children ourselves, leave
_PR_SET_PDEATHSIG = 1


def _load_prctl():
    """libc's prctl, looked up once in the parent: in the forked child only the call runs."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).prctl
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def exec_program(module: str, argv: list[str], *, prog: str = "") -> None:
    """Become ``python -m module argv`` (this process, its pid and its signals), with the folder
    that holds ``interactor`` first on PYTHONPATH: a program of the packages above this one
    (``bench``, ``examples``) is found where ``interactor`` was, and run without importing it.
    With ``prog``, the program is the module's ``main(argv, prog=prog)``: its usage and errors
    name the command that ran it (``interactor serve-model``), not the module."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    sys.stdout.flush()
    sys.stderr.flush()
    run = ["-m", module]
    if prog:
        run = ["-c", f"import sys; from {module} import main; sys.exit(main(sys.argv[1:], prog={prog!r}))"]
    os.execve(sys.executable, [sys.executable, *run, *argv], env)


def role_command(role: str, name: str = "", *extra: str) -> list[str]:
    """``python -m interactor.cli <role> --name ...``: a worker's name gets ``@%h`` (Celery's
    host suffix) unless it has one."""
    cmd = [sys.executable, "-m", "interactor.cli", role]
    if name:
        cmd += ["--name", name if role != "worker" or "@" in name else f"{name}@%h"]
    return [*cmd, *extra]


def _with_parent(parent: int):
    """``preexec_fn``: SIGTERM when the parent dies, and no start at all if it already has."""
    prctl = _prctl
    # The kernel sends the signal when the *thread* that forked exits: from any other thread
    # than the main one a child would be stopped when that thread ends, so there only the
    # child's own watch (watch_parent) and the Guard apply.
    if threading.current_thread() is not threading.main_thread():
        prctl = None

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # died between fork and prctl
            os._exit(1)

    return setup


def spawn(cmd: list[str], *, env: dict | None = None, log_path: str | os.PathLike | None = None,
          cwd: str | None = None, with_parent: bool = True, stdin=subprocess.DEVNULL,
          **popen_kw) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdin closed, output appended to ``log_path`` (or
    inherited when None). ``with_parent``: it gets SIGTERM when we die (see the module's
    docstring); False for what a :class:`Guard` stops in its own order."""
    out = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
    env = dict(os.environ if env is None else env)
    env.pop(PARENT_ENV, None)
    if with_parent:
        env[PARENT_ENV] = str(os.getpid())
        popen_kw.setdefault("preexec_fn", _with_parent(os.getpid()))
    try:
        popen_kw.setdefault("stdout", out)
        popen_kw.setdefault("stderr", subprocess.STDOUT if out else None)
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, start_new_session=True, **popen_kw)
    finally:
        if out:
            out.close()


def spawn_role(role: str, name: str, *, env: dict | None = None, log_path=None, extra: Iterable[str] = (),
               cwd: str | None = None) -> subprocess.Popen:
    """A worker or consumer (or any other role) as a child process."""
    return spawn(role_command(role, name, *extra), env=env, log_path=log_path, cwd=cwd)


def signal_group(p: subprocess.Popen, sig: int) -> bool:
    """``sig`` to ``p``'s process group (its session: spawn starts every child in its own);
    False when the group is gone."""
    try:
        os.killpg(p.pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and everything below it at once, as the OOM killer or `docker kill` takes a
    worker: its Celery process runs in a session of its own, and would otherwise get SIGTERM
    from its dying supervisor and hand its episodes back in good order."""
    for pid in descendants(p.pid) - {p.pid}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    signal_group(p, signal.SIGKILL)


def stop(p: subprocess.Popen | None, grace_s: float, sig: int = signal.SIGTERM) -> None:
    """``sig`` to ``p``'s group (SIGKILL: its whole tree), wait up to ``grace_s``, then SIGKILL
    the tree."""
    if p is None or p.poll() is not None:
        return
    if sig == signal.SIGKILL:
        kill_tree(p)
    elif not signal_group(p, sig):
        return
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        p.wait(5)


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
            kill_tree(p)
            p.wait(5)


def watch_parent(interval_s: float = WATCH_INTERVAL_S) -> bool:
    """In a child that :func:`spawn` started: a daemon thread that sends us SIGTERM once the
    parent is gone (we are then re-parented), so the role stops as on ``kill``. Any platform;
    on Linux the kernel's parent-death signal usually comes first. Returns whether it watches.

    The marker is removed from our environment: our own children get theirs from spawn, and a
    process started some other way must not watch a parent that is not its own."""
    raw = os.environ.pop(PARENT_ENV, "")
    if not raw.isdigit():
        return False
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True


def catch(sig: int, handler) -> None:
    """``signal.signal``, except that a SIGHUP ignored by whoever started us (``nohup``) stays
    ignored: such a command is meant to outlive its terminal."""
    if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
        return
    signal.signal(sig, handler)


def stop_event() -> threading.Event:
    """An event that SIGTERM, SIGINT or SIGHUP sets (call from the main thread)."""
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        catch(sig, lambda *_: stop.set())
    return stop


def wait_for_signal() -> None:
    """Block the foreground until SIGTERM, SIGINT or SIGHUP."""
    stop = stop_event()
    while not stop.wait(1.0):
        pass


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """The shell's code for a command ended by a signal: 128 + its number (130 for Ctrl-C,
    143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside (main thread): SIGTERM and SIGHUP raise :class:`Interrupted`, so a foreground
    command that handles Ctrl-C stops its children the same way on ``kill``, ``timeout``,
    systemd, ``docker stop`` or a closed terminal (unless started under ``nohup``)."""
    def interrupt(signum, _frame):
        raise Interrupted(signum)

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig in old:
        catch(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (Linux /proc; just ``pid`` elsewhere).

    ``interactor worker`` may run Celery in a child (a supervisor restarts it if it dies), and a
    prefork pool has children too: the lease tokens name whichever process runs the episode,
    and a process killed outright leaves its own children behind.
    """
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {pid}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields_ = stat[stat.rfind(b")") + 2:].split()
        if len(fields_) > 1:
            children.setdefault(int(fields_[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, ()))
    return out


# --- the guard -----------------------------------------------------------------------------
class Guard:
    """Stops our children if we die without stopping them, in stages (lowest first), each
    with SIGTERM, its grace period, then SIGKILL.

    A child process of its own (``python -m interactor.children guard``) reading our pipe:
    the end of the pipe without a ``done`` line means we died. It ignores the signals that stop
    us (a terminal's, a service manager's), so it is there to act when we no longer can.
    """

    def __init__(self, graces: dict[int, float], *, log_path: str | os.PathLike | None = None):
        self.graces = dict(graces)
        args = [f"{stage}={grace:g}" for stage, grace in sorted(self.graces.items())]
        # Not our stdout: a pipe read by whoever started us must end when we do.
        self.proc = spawn([sys.executable, "-m", "interactor.children", "guard", *args], with_parent=False,
                          stdin=subprocess.PIPE, log_path=log_path or os.devnull)

    def add(self, proc: subprocess.Popen | int, stage: int) -> None:
        self._send(f"add {getattr(proc, 'pid', proc)} {stage}")

    def drop(self, proc: subprocess.Popen | int) -> None:
        self._send(f"drop {getattr(proc, 'pid', proc)}")

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone: nothing more it can do for us
            pass

    def close(self, *, done: bool = True) -> None:
        """``done``: we stopped our children ourselves, the guard leaves without touching
        anything. Otherwise (our own stopping was cut short) it stops whatever is still running,
        in order, and we leave it to it."""
        if done:
            self._send(_GUARD_DONE)
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        if not done:
            return
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _stat(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` after the command name (state first), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), so a recycled pid is never signalled."""
    fields_ = _stat(pid)
    return fields_[19].decode() if fields_ and len(fields_) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    if started is not None:
        fields_ = _stat(pid)
        if fields_ is None:
            return False
        return fields_[0] not in (b"Z", b"X") and len(fields_) > 19 and fields_[19].decode() == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, started: str | None, sig: int) -> None:
    if _alive(pid, started):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _guard_main(args: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    graces = {int(k): float(v) for k, v in (a.split("=", 1) for a in args)}
    parent = os.getppid()
    watched: dict[int, tuple[int, str | None]] = {}  # pid -> (stage, start time)
    for raw in sys.stdin.buffer:
        parts = raw.decode(errors="replace").split()
        if parts == [_GUARD_DONE]:
            return 0
        if len(parts) == 3 and parts[0] == "add" and parts[1].isdigit():
            pid = int(parts[1])
            watched[pid] = (int(parts[2]), _start_time(pid))
        elif len(parts) == 2 and parts[0] == "drop" and parts[1].isdigit():
            watched.pop(int(parts[1]), None)
    # The pipe ended without "done": our parent is gone.
    def say(text: str) -> None:
        print(time.strftime("%Y-%m-%d %H:%M:%S"), f"guard of pid {parent}:", text, file=sys.stderr, flush=True)

    for stage in sorted({s for s, _ in watched.values()}):
        group = [(pid, started) for pid, (s, started) in watched.items() if s == stage and _alive(pid, started)]
        if not group:
            continue
        say(f"parent gone; stopping {' '.join(str(p) for p, _ in group)} (SIGTERM, up to {graces.get(stage, 10):g}s)")
        for pid, started in group:
            _signal(pid, started, signal.SIGTERM)
        deadline = time.monotonic() + graces.get(stage, 10.0)
        while time.monotonic() < deadline and any(_alive(p, st) for p, st in group):
            time.sleep(0.2)
        for pid, started in group:
            if _alive(pid, started):  # with what it started (a worker's Celery process), or it stays
                say(f"{pid} still running: SIGKILL")
                for below in descendants(pid) - {pid}:
                    _signal(below, _start_time(below), signal.SIGKILL)
            _signal(pid, started, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["guard"]:
        sys.exit(_guard_main(sys.argv[2:]))
    sys.exit("usage: python -m interactor.children guard STAGE=GRACE_S...")
