"""The benchmark harness in a tiny configuration: it runs end to end and writes the table.

Keeps `make bench` from rotting; asserts the shape of the report, never a timing target.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_bench_quick_produces_the_table(tmp_path):
    out, png, work = tmp_path / "benchmarks.md", tmp_path / "benchmarks.png", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    cmd = [sys.executable, "-m", "interactor.cli", "bench", "--quick", "--levels", "4", "--single-turn-levels", "4",
           "--pools", "threads",
           "--pool-level", "4", "--feed-level", "8", "--caps-level", "4", "--steps", "3", "--window", "3", "--warmup", "0.5", "--model-latency-ms", "100",
           "--ingest-records", "600", "--enqueue-episodes", "1000",
           "--out", str(out), "--png", str(png), "--work", str(work)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    text = out.read_text()
    for heading in ("## How to run", "## The machine", "## Targets", "## Load runs", "## Worker pools",
                    "## Consumer ingest", "## Enqueue", "## Single-turn episodes", "## Token storage", "## Rollout feed",
                    "## Cost of the fleet-wide caps", "## Cost of resumable episodes",
                    "## Cost of waiting for a replica", "## Against the original driver"):
        assert heading in text, heading
    # without --original the comparison says why it was not measured
    assert "Not measured in this run: no checkout of the original driver given" in text
    for row in ("| Efficiency at concurrency 4 |", "| Orchestration CPU per step, concurrency 4 |",
                "| Worker memory per concurrent episode, concurrency 4 |", "| Consumer ingest (records/s into SQLite, one consumer) |",
                "| Enqueue (1,000-episode job, episodes/s) |", "| Record latency p99, concurrency 4 |",
                "| Single-turn orchestration CPU per step, concurrency 4 |",
                "| Orchestration CPU per episode beyond its steps, concurrency 4 |"):
        assert row in text, row
    assert "**Chosen default: `threads`**" in text
    assert "**Caps' cost per step:** orchestration CPU x" in text and "Redis commands more" in text
    assert "**Resume's cost per step:** orchestration CPU x" in text
    assert "**Replica waits' cost per step:** orchestration CPU x" in text and "**A wait adds " in text
    assert png.exists() and png.stat().st_size > 1000

    res = json.loads((work / "results.json").read_text())
    (run,) = res["load"]
    assert run["errors"] == [], run["errors"]
    assert run["steps"] > 0 and run["running_reached"] == 4
    assert run["latency_n"] > 0 and run["latency_ms"]["p99"] > 0
    assert set(run["cpu_s"]) == {"workers", "consumer", "redis", "env", "model"}
    (single,) = res["single_turn"]
    assert single["errors"] == [], single["errors"]
    assert single["spec"]["steps"] == 1 and single["episodes"] > 0 and single["steps"] >= single["episodes"] - 4
    # every episode takes a START, a FINISH and a publish at least (commandstats read over the window)
    assert single["redis_calls"].get("evalsha", 0) >= 2 * single["episodes"]
    assert res["ingest"]["records"] == 600 and not res["ingest"]["errors"] and res["ingest"]["backend"] == "sqlite"
    assert res["enqueue"]["episodes"] == 1000 and not res["enqueue"]["errors"]
    fd = res["feed"]
    assert fd["errors"] == [], fd["errors"]
    assert fd["spec"]["concurrency"] == 8 and fd["groups"] > 0 and fd["latency_n"] > 0
    assert 0 < fd["latency_ms"]["p50"] <= fd["latency_ms"]["p99"]
    assert 0 <= fd["idle_fraction"] <= 1
    assert fd["stats"]["acked"] >= fd["groups"]  # every group taken in the window was acknowledged
    # the caps' cost: the same load as the C=4 level, with caps at 10x C (40) that never bind
    cp = res["caps"]
    assert cp["level"] == 4 and cp["factor"] == 10 and cp["uncapped"] == run  # the level of this run, not re-run
    capped = cp["capped"]
    assert capped["errors"] == [], capped["errors"]
    assert capped["spec"]["caps_factor"] == 10 and capped["spec"]["steps"] == run["spec"]["steps"]
    assert capped["steps"] > 0 and capped["running_reached"] == 4  # the caps never bound
    for k in ("cpu_ms_per_step_uncapped", "cpu_ms_per_step_capped", "redis_per_step_uncapped", "redis_per_step_capped"):
        assert 0 < cp[k] < 1000, (k, cp[k])
    assert cp["cpu_ratio"] == pytest.approx(cp["cpu_ms_per_step_capped"] / cp["cpu_ms_per_step_uncapped"])
    rs = res["resume"]
    assert rs["level"] == 4 and rs["on"] == run  # the load of this run (resume on, the default), not re-run
    assert rs["off"]["errors"] == [] and rs["off"]["spec"]["resume"] is False and rs["off"]["steps"] > 0
    for k in ("cpu_ms_per_step_off", "cpu_ms_per_step_on", "redis_per_step_off", "redis_per_step_on"):
        assert 0 < rs[k] < 1000, (k, rs[k])
    assert rs["redis_extra_per_step"] == pytest.approx(rs["redis_per_step_on"] - rs["redis_per_step_off"])
    # the replica waits' cost: the same load with a replica, waits off and on, and the commit points timed
    wt = res["waits"]
    assert wt["level"] == 4
    for mode in ("off", "on"):
        assert wt[mode]["errors"] == [] and wt[mode]["steps"] > 0, wt[mode]["errors"]
        assert wt[mode]["spec"]["replica"] is True and wt[mode]["spec"]["redis_wait"] == mode
    assert wt["on"]["redis_calls"].get("wait", 0) > 0 and "wait" not in wt["off"]["redis_calls"]
    commits = wt["commits"]
    assert commits["errors"] == [] and commits["commits"] == 200
    assert 0 < commits["ms_per_commit"]["off"]["p50"] and 0 < commits["ms_per_commit"]["on"]["p50"]
    assert commits["added_ms_p50"] == pytest.approx(commits["ms_per_commit"]["on"]["p50"]
                                                    - commits["ms_per_commit"]["off"]["p50"])
    assert 0.1 < cp["cpu_ratio"] < 10
    # The difference is the row the report judges. Its sign is not checked here: slots are taken in
    # blocks and renewed once a second, so the caps add about 0.15 commands per step, far less than
    # what a 3-second window at C=4 varies by between two runs (a busy CI machine once saw -3.97).
    # `make bench` measures it at C=256 over a long window; this checks the figure is computed.
    assert cp["redis_extra_per_step"] == pytest.approx(cp["redis_per_step_capped"] - cp["redis_per_step_uncapped"])
    assert math.isfinite(cp["redis_extra_per_step"])
    tok = res["token_storage"]
    assert not tok["errors"] and tok["sampled_tokens"] > 0
    assert tok["token_bytes"] == 4 * (tok["stored_ids"] + tok["sampled_tokens"])  # int32 ids, float32 logprobs
    assert tok["file_growth_bytes"] > 0 and tok["json_bytes"] > tok["token_bytes"]
    gw = res["gateway"]  # bench/gateway_cost.py: quick runs make 200 calls each way
    assert gw["calls"] == 200 and 0 < gw["gateway_cpu_ms_per_call"] < 100 and "## Model gateway" in text


def test_bench_refuses_caps_that_could_bind_before_running_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "interactor.cli", "bench", "--quick", "--caps-factor", "0.5",
                           "--work", str(tmp_path / "work")], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "caps factor 0.5 would let the caps bind" in proc.stderr
    assert not (tmp_path / "work").exists()
