"""Adaptive concurrency's curve: a model server that answers 429 above a concurrency it changes
mid-run, a job run with ``--concurrency auto`` on real worker processes, and what the fleet's
limit did (docs/adaptive_concurrency.csv and .png; ``python -m bench.adaptive_curve``).

:class:`OverloadServer` is an OpenAI-style chat endpoint on loopback (a thread per request, as
``http.server`` has it) that answers 429 to a request that would put more than ``limit`` in flight
and otherwise answers after ``latency_s``; :class:`Sampler` records, every ``dt``, the time, the
server's limit, the fleet's limit in force (broker/caps.py ``Keys.caps``), the requests in flight
and the 429s so far. tests/test_adaptive_concurrency.py runs the same pieces under pytest.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ((4, 15.0), (12, 20.0), (3, 15.0))  # (the server's concurrency, seconds)
_ANSWER = json.dumps({"id": "x", "object": "chat.completion", "model": "overload",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"},
                                   "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()
_BUSY = json.dumps({"error": {"message": "too many requests in flight", "type": "rate_limit", "code": 429}}).encode()


class OverloadServer(ThreadingHTTPServer):
    """A chat endpoint that takes at most ``limit`` requests at once (429 above)."""

    daemon_threads = True

    def __init__(self, limit: int, latency_s: float = 0.07):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.limit, self.latency_s = limit, latency_s
        self.lock = threading.Lock()
        self.in_flight = self.peak = self.ok = self.refused = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> "OverloadServer":
        threading.Thread(target=self.serve_forever, name="overload-server", daemon=True).start()
        return self

    def take_peak(self) -> int:
        """The most requests in flight at once since the last call (then starts again)."""
        with self.lock:
            peak, self.peak = self.peak, self.in_flight
            return peak


class _Handler(BaseHTTPRequestHandler):
    server: OverloadServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        return None

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # readiness (workers/breakers.py), /models
        self._send(200, b'{"object": "list", "data": [{"id": "overload", "object": "model"}]}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        with srv.lock:
            if srv.in_flight >= srv.limit:
                srv.refused += 1
                busy = True
            else:
                busy = False
                srv.in_flight += 1
                srv.peak = max(srv.peak, srv.in_flight)
        if busy:
            return self._send(429, _BUSY)
        try:
            time.sleep(srv.latency_s)
        finally:
            with srv.lock:
                srv.in_flight -= 1
                srv.ok += 1
        self._send(200, _ANSWER)


class Sampler:
    """Every ``dt``: (seconds since start, the server's limit, the fleet's limit, in flight, 429s)."""

    def __init__(self, server: OverloadServer, client, cap_key: str, dt: float = 0.25):
        self.server, self.r, self.cap_key, self.dt = server, client, cap_key, dt
        self.rows: list[tuple[float, int, int, int, int]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def fleet_limit(self) -> int:
        raw = self.r.hget(self.server_caps_key, self.cap_key)
        return int(raw) if raw else 0

    @property
    def server_caps_key(self) -> str:
        return self.cap_key.split(":cap:")[0] + ":caps"

    def _run(self) -> None:
        while not self._stop.wait(self.dt):
            s = self.server
            with s.lock:
                limit, flight, refused = s.limit, s.in_flight, s.refused
            self.rows.append((round(time.monotonic() - self.t0, 2), limit, self.fleet_limit(), flight, refused))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def write(self, csv_path: Path, png_path: Path | None) -> str:
        """The CSV, and the plot when matplotlib is importable; returns what was written."""
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t_s", "server_limit", "fleet_limit", "in_flight", "http_429_total"])
            w.writerows(self.rows)
        if png_path is None:
            return str(csv_path)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return f"{csv_path} (no plot: matplotlib is not installed; it comes with the learn extra)"
        t = [r[0] for r in self.rows]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.step(t, [r[1] for r in self.rows], where="post", label="server's concurrency (429 above)", color="black")
        ax.plot(t, [r[2] for r in self.rows], label="fleet's limit (--concurrency auto:1-32)", color="tab:blue")
        ax.plot(t, [r[3] for r in self.rows], label="requests in flight", color="tab:green", alpha=0.5, lw=0.8)
        ax2 = ax.twinx()
        ax2.plot(t, [r[4] for r in self.rows], label="429s so far", color="tab:red", ls=":")
        ax.set_xlabel("seconds")
        ax.set_ylabel("concurrency")
        ax2.set_ylabel("429s so far")
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
        ax.legend(lines, labels, loc="upper left", fontsize=8)
        ax.set_title("Adaptive concurrency: 2 worker processes against a server that answers 429")
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        return f"{csv_path} and {png_path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.adaptive_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder of adaptive_concurrency.csv and .png")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    args = p.parse_args(argv)

    from bench.cluster import child_env, start_listening
    from bench.load_runs import write_countdown_tasks
    from broker.cancel import JobCancel
    from broker.caps import CAP_MODEL
    from broker.embedded import EmbeddedRedis
    from broker.keys import Keys
    from broker.redisconn import connect
    from broker.settings import Settings
    from interactor.children import role_command, spawn, stop
    from producer.enqueue import submit

    folder = Path(tempfile.mkdtemp(prefix="adaptive-curve-"))
    server = OverloadServer(limit=PHASES[0][0]).start()
    children: list[subprocess.Popen] = []
    with EmbeddedRedis(folder / "redis") as redis_srv:
        settings = Settings.from_env({}, redis_url=redis_srv.url, run_dir=str(folder), llm_base_url=server.url,
                                     model="overload", concurrency=20, llm_fleet_max_concurrency="auto:1-32",
                                     llm_backoff_initial_s=0.1, llm_backoff_max_s=1.0, episode_budget_s=600)
        env = child_env(settings, None)
        try:
            env_p, env_url = start_listening([sys.executable, "-m", "bench.standins", "env", "--port", "0"], env,
                                             folder / "env.log", str(ROOT))
            children.append(env_p)
            client = connect(settings)
            tasks = write_countdown_tasks(folder, env_url, 100_000, 5)
            job = submit(client, settings, [tasks]).job
            for i in range(args.workers):
                children.append(spawn(role_command("worker", f"w{i}"), env=env, log_path=folder / f"w{i}.log",
                                      cwd=str(ROOT)))
            children.append(spawn(role_command("consumer", "consumer"), env=env, log_path=folder / "consumer.log",
                                  cwd=str(ROOT)))
            while server.ok < 20:
                time.sleep(0.2)
            sampler = Sampler(server, client, Keys(settings.key_prefix).cap(CAP_MODEL, server.url)).start()
            for limit, seconds in PHASES:
                server.limit = limit
                print(f"server concurrency {limit} for {seconds:g} s", flush=True)
                time.sleep(seconds)
            sampler.stop()
            JobCancel(client, settings).cancel(job.job_id, who="bench.adaptive_curve")
        finally:
            for child in reversed(children):
                stop(child, 10)
            server.shutdown()
    out = Path(args.out)
    wrote = sampler.write(out / "adaptive_concurrency.csv", out / "adaptive_concurrency.png")
    print(f"{server.refused} answers 429, {server.ok} answers; wrote {wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
