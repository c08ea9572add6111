"""Shared fixtures: a real Redis (embedded, free port, with a password), the stand-in servers
on loopback, and real worker / consumer processes.

One embedded Redis serves the whole session (one per process under `make test`'s pytest-xdist);
each test gets its own key prefix and queue, so tests do not see each other's episodes.

Tests marked ``unit`` are `make check`'s: they need no server, and the hooks below hold them to
it (a unit test that asks for a server fixture, or listens on a socket, fails saying so).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis

from broker.embedded import EmbeddedRedis
from interactor.children import kill_tree, role_command, signal_group, spawn, stop
from broker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

# Fixtures that start a server or processes: a test marked unit (make check) uses none of them.
SERVER_FIXTURES = frozenset({"redis_server", "pg_server", "env_server", "model_server", "servers", "procs", "cpu_hog"})


def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") is not None:
        used = SERVER_FIXTURES.intersection(item.fixturenames)
        if used:
            pytest.fail(f"marked unit (make check: no server) but uses {', '.join(sorted(used))}: "
                        "drop its unit mark (make test runs it)", pytrace=False)


def _unit_tests_listen_nowhere(sock, *args):
    raise AssertionError("a test marked unit (make check: no server) listens on a socket: "
                         "drop its unit mark (make test runs it)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("unit") is None:
        return (yield)
    listen, socket.socket.listen = socket.socket.listen, _unit_tests_listen_nowhere
    try:
        return (yield)
    finally:
        socket.socket.listen = listen


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), password="s3cret-redis-pw")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def settings(redis_server, tmp_path) -> Settings:
    """Settings for one test: its own key prefix, queue and database; fast timings."""
    tag = uuid.uuid4().hex[:8]
    return Settings.from_env(
        {},
        redis_url=redis_server.url,
        key_prefix=f"t{tag}",
        queue=f"q{tag}",
        run_dir=str(tmp_path / "run"),
        db_path=str(tmp_path / "results.sqlite"),
        lease_ttl_s=3.0,
        sweep_interval_s=0.5,
        reconcile_interval_s=2.0,
        retry_backoff_initial_s=0.2,
        retry_backoff_max_s=1.0,
        llm_backoff_initial_s=0.05,
        llm_backoff_max_s=0.2,
        env_backoff_initial_s=0.05,
        env_backoff_max_s=0.2,
        env_read_timeout_s=10,
        llm_read_timeout_s=10,
        episode_budget_s=60,
        consumer_claim_idle_ms=2000,
        consumer_block_ms=200,
        shutdown_grace_s=3,
        concurrency=8,
        model="stand-in",
        # A dead server is waited for this long before its episodes are dead-lettered as an
        # outage (15 minutes by default): tests that kill servers for good end in seconds.
        outage_budget_s=5,
        # The test modules' own env classes (and the docs' example) next to the bundled ones.
        env_classes="envs.*,tests.*,test_inproc:*,wordguess_doc:*",
    )


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL (pgserver's binaries, else the machine's) on a free port.

    Its folder is outside pytest's base temp: run as root, the server runs as another user,
    and every pytest session that starts re-closes ``/tmp/pytest-of-<user>`` to its owner, so a
    second session on the machine (another suite, a make target) locked a running server out
    of its own data directory mid-run."""
    from broker.embedded_postgres import EmbeddedPostgres, binaries

    if binaries() is None:
        pytest.skip("no PostgreSQL server binaries here (pip install pgserver, or the postgresql package)")
    folder = Path(tempfile.mkdtemp(prefix="interactor-test-pg-"))
    server = EmbeddedPostgres(folder)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    """A fresh results store of each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "results.sqlite")
    return request.getfixturevalue("pg_server").create_database()


@pytest.fixture
def env_server():
    from examples.envserver import start_in_thread

    server, url = start_in_thread()
    yield server, url
    server.shutdown()


@pytest.fixture
def model_server():
    from examples.model_standin import start_in_thread

    server, url = start_in_thread()
    yield server, url
    server.shutdown()


@pytest.fixture
def servers():
    """The example env server logging every call (``request_log``: what the env saw, to hold
    against what was stored) and the model stand-in at 30 ms a call (``hold``/``release``: a
    model call a test can stop a worker in)."""
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    env, env_url = start_env(log_requests=True)
    model, model_url = start_model(latency_ms=30)
    yield env, env_url, model, model_url
    model.release()
    model.shutdown()
    env.shutdown()


class Procs:
    """Child processes of one test, all stopped at its end."""

    def __init__(self, settings: Settings, log_dir: Path):
        self.settings = settings
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, **overrides) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
        env.update(self.settings.replace(**overrides).as_environ() if overrides else self.settings.as_environ())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, name: str, role: str, *args: str, cwd: str | None = None, **overrides) -> subprocess.Popen:
        # interactor/children.py, as the command line starts its own, in a session of its own;
        # without the parent-death hook: it runs Python between fork and exec, unsafe with the
        # threads a test runs (its servers), and stop_all stops them anyway
        p = spawn(role_command(role, name if role in ("worker", "consumer") else "", *args),
                  env=self.env(**overrides), log_path=self.log_dir / f"{name}.log", cwd=cwd or str(ROOT),
                  with_parent=False)
        self.procs[name] = p
        return p

    def worker(self, name: str = "w1", **overrides) -> subprocess.Popen:
        return self.start(name, "worker", **overrides)

    def consumer(self, name: str = "consumer", **overrides) -> subprocess.Popen:
        return self.start(name, "consumer", **overrides)

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        """``sig`` to the process's group; SIGKILL takes its whole tree at once (kill_tree)."""
        stop(self.procs[name], 30, sig)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        procs = [p for p in self.procs.values() if p.poll() is None]
        for p in procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(p)
                p.wait(5)


@pytest.fixture
def procs(settings, tmp_path):
    p = Procs(settings, tmp_path / "logs")
    yield p
    p.stop_all()


def interruptible() -> None:
    """preexec_fn for a child a test will Ctrl-C: SIGINT as a terminal has it.

    A shell starting a job in the background (`make test &`, some CI runners) sets SIGINT to
    ignored, and the children inherit that; Python then never raises KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class CpuHog:
    """Busy-looping processes that keep the machine's cores taken while a test runs: what a
    shared CI runner or a laptop building something else does to the workers under test.

    The hogs run at the test's own priority (nice 0 on a normal run), as the other work on such
    a machine does, so the worker processes compete with them for every core. Each hog is a process of its own
    (no GIL shared with anything under test) that dies with the test process (parent-death
    signal) and is killed by the fixture's teardown, also when the test failed.
    ``CPU_HOG_PROCS`` sets how many (one per core by default), to load a machine harder by hand.
    """

    def __init__(self, n: int | None = None):
        self.n = n or int(os.environ.get("CPU_HOG_PROCS", 0)) or os.cpu_count() or 2
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "CpuHog":
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: only the call runs in the child
        parent = os.getpid()

        def die_with_parent() -> None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the test process died between fork and prctl
                os._exit(1)

        while len(self.procs) < self.n:
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs = []

    @property
    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)


@pytest.fixture
def cpu_hog():
    """One busy-looping process per core, started by the test (``cpu_hog.start()``), stopped
    by it or at teardown at the latest."""
    hog = CpuHog()
    try:
        yield hog
    finally:
        hog.stop()

