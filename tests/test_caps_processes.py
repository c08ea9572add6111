"""The fleet-wide caps across real processes (tests/caps_caller.py, one FleetGate each) and a
probe server on loopback that counts the calls in flight across all of them:

* a Redis outage longer than the slots' lease TTL (the embedded redis-server SIGSTOPped,
  then SIGCONTed) never lets more calls be in flight than the cap;
* a cap smaller than the number of processes that want it still serves every one of them
  within a bounded time (they take turns).

Nothing asserts on speed: the figures are counts and bounds far above what the design needs
(a turn is about a second).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from broker.caps import CAP_ENV_INSTANCES
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.redisconn import connect
from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.integration]


class Probe(ThreadingHTTPServer):
    """``GET /call?who=NAME&hold=S`` answers after S seconds; counts the calls in flight (and
    their peak) and keeps every call's (who, start, end)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ProbeHandler)
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.calls: list[tuple[str, float, float]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def starts(self, who: str, since: float = 0.0) -> list[float]:
        with self.lock:
            return sorted(s for w, s, _ in self.calls if w == who and s >= since)


class _ProbeHandler(BaseHTTPRequestHandler):
    server: Probe

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        query = parse_qs(urlparse(self.path).query)
        srv = self.server
        start = time.monotonic()
        with srv.lock:
            srv.now += 1
            srv.peak = max(srv.peak, srv.now)
        time.sleep(float(query["hold"][0]))
        with srv.lock:
            srv.now -= 1
            srv.calls.append((query["who"][0], start, time.monotonic()))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        return None


@pytest.fixture
def probe():
    server = Probe()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


class Callers:
    """tests/caps_caller.py processes of one test, each in a session of its own; all stopped
    (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, redis_url: str, prefix: str, probe_url: str, tmp_path):
        self.redis_url, self.prefix, self.probe_url, self.tmp_path = redis_url, prefix, probe_url, tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *, limit: int, ttl: float, callers: int, hold: float) -> float:
        """Starts one; returns when it said it is ready (monotonic)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.tmp_path / f"{name}.err", "w") as err:
            p = subprocess.Popen([sys.executable, "-m", "tests.caps_caller", self.redis_url, self.prefix, name,
                                  self.probe_url, "--limit", str(limit), "--ttl", str(ttl), "--callers",
                                  str(callers), "--hold", str(hold)],
                                 cwd=str(ROOT), env=env, stdout=subprocess.PIPE, text=True, stderr=err,
                                 start_new_session=True)
        self.procs[name] = p
        line = p.stdout.readline()  # blocks until the process is up (or gone)
        assert line.strip() == "ready", f"{name} did not start: {self.errors(name)}"
        return time.monotonic()

    def errors(self, name: str) -> str:
        return (self.tmp_path / f"{name}.err").read_text()

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            p.stdout.close()


def _holders(client, prefix: str, probe_url: str) -> dict[str, int]:
    held = client.hgetall(Keys(prefix).cap_held(CAP_ENV_INSTANCES, probe_url))
    return {k.decode().split(":")[0]: int(v) for k, v in held.items()}


@pytest.mark.fault
def test_a_redis_outage_longer_than_the_ttl_never_lets_the_cap_be_exceeded(settings, probe, tmp_path):
    """Two processes share a cap of 3 with calls of a second each, back to back; Redis is
    frozen for more than twice the lease TTL, mid-run. Every lease lapses by Redis' clock,
    yet the probe never sees more than 3 calls at once, and both processes go on after."""
    server = EmbeddedRedis(tmp_path / "redis", password="caps-pw").start()
    callers = Callers(server.url, settings.key_prefix, probe.url, tmp_path)
    client = connect(settings.replace(redis_url=server.url))
    ttl, cap = 1.5, 3
    frozen = False
    try:
        callers.start("a", limit=cap, ttl=ttl, callers=3, hold=1.0)
        wait_for(lambda: _holders(client, settings.key_prefix, probe.url).get("a") == cap, timeout=60,
                 interval=0.05, what="process a to hold the whole cap")
        callers.start("b", limit=cap, ttl=ttl, callers=3, hold=1.0)
        wanted = Keys(settings.key_prefix).cap_wanted(CAP_ENV_INSTANCES, probe.url)
        wait_for(lambda: any(m.startswith(b"b:") for m in client.zrange(wanted, 0, -1))
                 or "b" in _holders(client, settings.key_prefix, probe.url),
                 timeout=60, interval=0.05, what="process b to wait for slots or hold some")
        wait_for(lambda: probe.now == cap, timeout=30, interval=0.02, what="every slot in use")
        os.kill(server.proc.pid, signal.SIGSTOP)
        frozen = True
        time.sleep(2 * ttl + 1)  # every lease lapses by Redis' clock, which jumps when it resumes
        os.kill(server.proc.pid, signal.SIGCONT)
        frozen = False
        resumed = time.monotonic()
        wait_for(lambda: probe.starts("a", resumed) and probe.starts("b", resumed), timeout=60,
                 what="both processes to make calls after the outage")
        time.sleep(4 * ttl)  # the holds and renewals after the outage play out
    finally:
        if frozen:
            os.kill(server.proc.pid, signal.SIGCONT)
        callers.stop_all()
        client.close()
        server.stop()
    print(f"\n[caps outage] peak calls in flight {probe.peak} (cap {cap}), {len(probe.calls)} calls")
    assert probe.peak <= cap, f"{probe.peak} calls in flight at once under a cap of {cap}"
    logs = callers.errors("a") + callers.errors("b")
    assert "Traceback" not in logs and "lapsed" not in logs, logs  # nobody lost its slots to the outage


@pytest.mark.parametrize("cap,processes", [(2, 3), (1, 3)])
def test_a_cap_below_the_number_of_processes_serves_each_in_turn(settings, probe, tmp_path, cap, processes):
    """``processes`` processes with 4 callers each making 50 ms calls back to back under a cap
    smaller than their number: the probe never sees more than the cap in flight, and no
    process goes more than 10 s without starting a call (they take turns of about a second;
    a process that held the cap for good would starve the others)."""
    bound_s, window_s = 10.0, 24.0
    callers = Callers(settings.redis_url, settings.key_prefix, probe.url, tmp_path)
    names = [chr(ord("a") + i) for i in range(processes)]
    try:
        ready = {}
        for i, name in enumerate(names):
            ready[name] = callers.start(name, limit=cap, ttl=3.0, callers=4, hold=0.05)
            if i == 0:  # the first one takes the cap before the others come, as in a fleet that grows
                wait_for(lambda: probe.starts("a"), timeout=60, what="process a to make a call")
        time.sleep(window_s)
        end = time.monotonic()
    finally:
        callers.stop_all()
    gaps = {}
    for name in names:
        marks = [ready[name], *probe.starts(name, ready[name]), end]
        gaps[name] = max(b - a for a, b in zip(marks, marks[1:]))
    counts = {name: len(probe.starts(name, ready[name])) for name in names}
    print(f"\n[caps turns] cap {cap}, {processes} processes: calls {counts}, longest wait per process "
          f"{ {n: round(g, 1) for n, g in gaps.items()} } s, peak in flight {probe.peak}")
    assert probe.peak <= cap, probe.peak
    assert all(g <= bound_s for g in gaps.values()), f"a process waited longer than {bound_s} s: {gaps} ({counts})"
    for name in names:
        assert "Traceback" not in callers.errors(name), callers.errors(name)
