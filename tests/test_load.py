"""Load as a new user makes it: `interactor run` of thousands of five-step episodes at
--concurrency 1000 and 2000 on this machine, against the benchmark's stand-ins (one asyncio
loop each, so they do not eat the cores the system under test needs).

These count outcomes, never time: every episode completed once, no dead letter, one attempt
per episode (no worker lost to a connection pool that ran dry, no lease lost to a stall).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.storecheck import db_rows

pytestmark = pytest.mark.integration


def _start(role: str, latency_ms: float) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "bench.standins", role, "--port", "0", "--latency-ms",
                          str(latency_ms)], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    line = p.stdout.readline().decode()
    assert "listening on" in line, line
    return p, line.split("listening on", 1)[1].strip()


@pytest.fixture
def standins():
    env, env_url = _start("env", 20)
    model, model_url = _start("model", 500)
    yield env_url, model_url
    for p in (env, model):
        p.terminate()
        p.wait(10)


@pytest.mark.parametrize("concurrency,episodes", [(1000, 3000), (2000, 4000)])
def test_thousands_of_episodes_lose_nothing(standins, tmp_path, concurrency, episodes):
    env_url, model_url = standins
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"steps": 5, "task": i}) + "\n" for i in range(episodes // 4)))
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(f"environments:\n  - env_name: countdown\n    base_url: {env_url}\n"
                     f"    env_params: {{system_bytes: 1500, turn_bytes: 300, keep_turns: 3}}\n"
                     f"    dataset: {rows.name}\n    env_num: 4\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url", model_url + "/v1",
                          "--concurrency", str(concurrency), "--run-dir", str(run_dir), "--job-id", "load"],
                         env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    db = str(run_dir / "results.sqlite")
    assert db_rows(db, "SELECT status, COUNT(*) FROM episodes GROUP BY status") == [("completed", episodes)]
    # One attempt each: no episode was failed by a pool that ran dry, nor lost to a stalled worker.
    assert db_rows(db, "SELECT status, reason, COUNT(*) FROM attempts GROUP BY status, reason") == [
        ("completed", "", episodes)]
    assert db_rows(db, "SELECT COUNT(*) FROM session_steps")[0][0] == 5 * episodes
    assert db_rows(db, "SELECT COUNT(*) FROM superseded_steps")[0][0] == 0
    assert db_rows(db, "SELECT COUNT(*), SUM(finished) FROM job_environments") == [(episodes, episodes)]
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    for trouble in ("MaxConnectionsError", "Too many connections", "Too many open files", "Traceback"):
        assert trouble not in logs
