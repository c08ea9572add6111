"""Adaptive concurrency on a vLLM server's own metrics (``--llm-metrics-url``, issue 50) in real
worker processes.

A loopback model server never answers 429 but serves ``/metrics`` as vLLM does, reporting
``vllm:num_requests_waiting = max(0, in flight - S)`` for a capacity S: a job run with
``--llm-fleet-max-concurrency auto:1-32`` and the metrics URL on two workers must bring the
fleet's limit down near S, by the metrics alone, with no episode failed. A job whose metrics URL
is dead runs as without one: nothing cut, nothing failed, the failure shown in status. The parser
alone: tests/test_server_metrics.py.

The server answers after a second, as a loaded LLM server does: the rule grows the limit by one
per window of ``limit`` answers, about one a second here, and the metrics cut x0.8 once a second,
so the limit settles a little above S. Bands, not exact figures.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from bench.adaptive_curve import OverloadServer, Sampler, _Handler
from broker.adaptive import AdaptiveCaps
from broker.caps import CAP_MODEL
from broker.keys import Keys
from broker.ledger import Ledger
from broker.redisconn import connect
from broker.settings import SettingsError
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.test_adaptive_concurrency import cli
from tests.test_fleet_limits import arith_job

pytestmark = [pytest.mark.integration]

CAPACITY = 5  # requests the server runs at once; more wait in its queue


class _VllmHandler(_Handler):
    def do_GET(self) -> None:
        if not self.path.endswith("/metrics"):
            return super().do_GET()
        srv = self.server
        with srv.lock:
            waiting = max(0, srv.in_flight - srv.capacity)
            kv = min(1.0, srv.in_flight / (4 * srv.capacity))
            srv.scrapes += 1
        body = ("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="overload"}} {float(waiting)}\n'
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="overload"}} {kv}\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class VllmServer(OverloadServer):
    """Never 429; its queue shows in /metrics only."""

    def __init__(self, capacity: int, latency_s: float):
        super().__init__(limit=10_000, latency_s=latency_s)
        self.RequestHandlerClass = _VllmHandler
        self.capacity, self.scrapes = capacity, 0

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/metrics"


def _submit(client, settings, tmp_path, env_url, server, metrics_url: str, rows: int, name: str):
    folder = tmp_path / name
    folder.mkdir()
    s = settings.replace(llm_base_url=server.url, llm_fleet_max_concurrency="auto:1-32", llm_metrics_url=metrics_url)
    return submit(client, s, [arith_job(folder, env_url, rows)]).job


def test_the_fleet_limit_follows_the_servers_queue_and_a_dead_metrics_url_changes_nothing(settings, procs,
                                                                                          env_server, tmp_path):
    _, env_url = env_server
    keys = Keys(settings.key_prefix)
    served = VllmServer(CAPACITY, latency_s=1.0).start()
    blind = VllmServer(10_000, latency_s=0.05).start()  # its job's metrics URL is dead
    settings = settings.replace(concurrency=20, llm_backoff_initial_s=0.1, llm_backoff_max_s=1.0,
                                episode_budget_s=120)
    procs.settings = settings
    client = connect(settings)
    ledger = Ledger.for_settings(client, settings)
    dead = _submit(client, settings, tmp_path, env_url, blind, _dead_url(), 60, "dead")
    job = _submit(client, settings, tmp_path, env_url, served, served.metrics_url, 20000, "served")
    cap_key, dead_cap = keys.cap(CAP_MODEL, served.url), keys.cap(CAP_MODEL, blind.url)
    sampler = Sampler(served, client, cap_key).start()
    procs.worker("w1")
    procs.worker("w2")
    procs.consumer()
    try:
        wait_for(lambda: ledger.counts(dead.job_id)["done"] == 60, timeout=60, what="the dead-metrics job to finish")
        low, high = CAPACITY * 0.6, CAPACITY * 1.8
        wait_for(lambda: low <= sampler.fleet_limit() <= high, timeout=30, interval=0.1,
                 what=f"the fleet's limit within [{low}, {high}] (samples: {sampler.rows[-12:]})")
        time.sleep(5)  # and it stays there
        assert low <= sampler.fleet_limit() <= high, sampler.rows[-24:]
        assert served.refused == 0 and served.scrapes >= 5
        reasons = [c["reason"] for c in AdaptiveCaps(client, keys).history(cap_key)]
        assert any(r.startswith("x0.8: vLLM: ") and r.endswith(" waiting") for r in reasons), reasons
        status = json.loads(cli(settings, "status", "--json").stdout)
        cap = next(c for c in status["caps"] if c["name"] == served.url)
        assert cap["server"]["engine"] == "vLLM" and cap["server"]["kv"] is not None, cap
        assert time.time() - cap["server"]["at"] < 10, cap
        dead_entry = next(c for c in status["caps"] if c["name"] == blind.url)
        assert "Connection" in dead_entry["server"]["error"] and not dead_entry["server"]["at"], dead_entry
        assert "; server vLLM " in cli(settings, "status").stdout
        counts = ledger.counts(job.job_id)
        assert counts["done"] > 30 and counts["failed"] == 0, counts
    finally:
        sampler.stop()
        cli(settings, "cancel", job.job_id)
        served.shutdown()
        blind.shutdown()
    assert ledger.counts(job.job_id)["failed"] == 0
    dead_counts = ledger.counts(dead.job_id)
    assert dead_counts["failed"] == 0 and dead_counts["done"] == 60, dead_counts
    dead_reasons = [c["reason"] for c in AdaptiveCaps(client, keys).history(dead_cap)]
    assert not any(r.startswith("x0.8") for r in dead_reasons), dead_reasons
    print(f"\n[metrics] limit over time: {[r[2] for r in sampler.rows[::8]]}; in flight: "
          f"{[r[3] for r in sampler.rows[::8]]}")


def test_metrics_url_without_an_adaptive_cap_is_refused_naming_why(settings, tmp_path, env_server):
    _, env_url = env_server
    job = arith_job(tmp_path, env_url, 2)
    out = cli(settings, "submit", "--llm-metrics-url", "http://127.0.0.1:9/metrics", job)
    assert out.returncode == 2 and "--llm-fleet-max-concurrency auto" in out.stderr, out.stderr
    out = cli(settings, "submit", "--llm-fleet-max-concurrency", "auto", "--llm-metrics-url", "ftp://x/metrics", job)
    assert out.returncode == 2 and "llm_metrics_url" in out.stderr, out.stderr
    fixed = arith_job(tmp_path, env_url, 2, extra="limits:\n  model:\n    max_concurrency: 4\n", name="fixed.yaml")
    s = settings.replace(llm_fleet_max_concurrency="auto", llm_metrics_url="http://127.0.0.1:9/metrics")
    with pytest.raises(SettingsError, match="task files' limits fix the model's max_concurrency"):
        submit(connect(settings), s, [fixed])
