"""Retry honesty (issue 50): the first-try/retried split of a job whose env server fails 20% of the
episodes' first attempts, in the summary a run prints, `results` and `results --json`; and
`--retry-on` leaving those failures out, so that they are dead-lettered on their first attempt."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading

import pytest

from consumer.storage.retry_split import split
from examples.envserver import EnvServer, _EnvHandler
from interactor.report import retry_lines
from tests.conftest import ROOT
from tests.storecheck import db_rows
from tests.taskfiles import write_arith_tasks

ROWS = 10  # 20%: the first reset of every fifth episode to arrive fails


class _FlakyHandler(_EnvHandler):
    def env_call(self, op: str, env_name: str, env_id: str, body: bytes) -> None:
        srv = self.server
        if op == "reset":
            episode = env_id.split("~", 1)[0]  # an instance id is the episode's, "~", its attempt's
            with srv.lock:
                first = episode not in srv.seen
                srv.seen.append(episode) if first else None
                fail = first and len(srv.seen) % 5 == 1
                if fail:
                    srv.failed_ids.append(episode)
            if fail:
                return self.send_json(500, {"error": "flaky env: this episode's first reset fails"})
        return super().env_call(op, env_name, env_id, body)


def flaky_env() -> tuple[EnvServer, str]:
    server = EnvServer()
    server.RequestHandlerClass = _FlakyHandler
    server.seen, server.failed_ids = [], []
    threading.Thread(target=server.serve_forever, name="flaky-env", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def job_page(store_path: str, job_id: str) -> str:
    """The browser's job page as served (Flask's client)."""
    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import Source

    store = open_store(store_path, readonly=True)
    try:
        return create_app(Source(store, store_shown=store_path)).test_client().get(f"/jobs/{job_id}").get_data(
            as_text=True)
    finally:
        store.close()


def interactor(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    # one try of an env call per attempt, and a short wait before the next attempt
    env.update(INTERACTOR_ENV_RETRIES="0", INTERACTOR_RETRY_BACKOFF_INITIAL_S="0.2")
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)


def test_split_counts_only_attempts_that_count():
    rows = [("a", 1.0, 0), ("a", 0.0, 0), ("a", 1.0, 2), ("b", 0.5, 0)]
    got = split(rows, {"b": 1})
    assert got["by_env"]["a"]["first_try"] == {"completed": 2, "mean": 0.5, "stderr": 0.5}
    assert got["by_env"]["a"]["retried"] == {"completed": 1, "mean": 1.0, "stderr": None}
    assert (got["by_env"]["b"]["failed"], got["job"]["failed"], got["job"]["retried_share"]) == (1, 1, 0.25)
    lines = retry_lines(got)
    assert lines[0].startswith("retries (completed on the first try apart from after")
    assert lines[-1].split() == ["all", "3", "0.500", "±", "0.289", "1", "1.000", "1"]
    assert retry_lines(split([("a", 1.0, 0)], {})) == [
        "retries: none (all 1 completed episodes completed on their first try)"]


@pytest.mark.integration
def test_first_try_and_retried_apart_when_an_env_fails_a_fifth_of_first_attempts(tmp_path, model_server):
    _, model_url = model_server
    server, env_url = flaky_env()
    try:
        tasks = write_arith_tasks(tmp_path, env_url, rows=ROWS, env_num=1)
        run_dir = tmp_path / "runs"
        run = interactor("run", tasks, "--llm-base-url", model_url + "/v1", "--run-dir", str(run_dir),
                         "--concurrency", "4", "--workers", "1", "--job-id", "flaky")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        assert len(server.failed_ids) == ROWS // 5
        assert "retries (completed on the first try apart from after a counted failed attempt" in run.stdout

        store = str(run_dir / "results.sqlite")
        reward = dict(db_rows(store, "SELECT episode_id, total_reward FROM episodes WHERE job_id = 'flaky'"))
        retried = [reward[e] for e in server.failed_ids]
        first = [r for e, r in reward.items() if e not in server.failed_ids]
        got = json.loads(interactor("results", "flaky", "--run-dir", str(run_dir), "--json").stdout)["retries"]
        for part in (got["job"], got["by_env"]["arithmetic"]):
            assert part["first_try"]["completed"] == ROWS - ROWS // 5 and part["retried"]["completed"] == ROWS // 5
            assert part["first_try"]["mean"] == pytest.approx(statistics.fmean(first))
            assert part["retried"]["mean"] == pytest.approx(statistics.fmean(retried))
            assert part["failed"] == 0 and part["retried_share"] == pytest.approx(0.2)
        shown = interactor("results", "flaky", "--run-dir", str(run_dir))
        table = shown.stdout.split("retries (", 1)[1].splitlines()
        assert table[3].split()[:2] == ["arithmetic", "8"] and table[5].split()[:2] == ["all", "8"], table
        # the job page: the same split, per env_name and for all
        page = job_page(store, "flaky")
        retries = page.split('id="retries"', 1)[1].split("</table>", 1)[0]
        assert retries.count("<tr") == 3  # the head, arithmetic, all
        cells = [" ".join(c.split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", retries, re.S)][:6]
        assert cells == ["arithmetic", "8", f"{statistics.fmean(first):.3f} ± {statistics.stdev(first) / 8 ** 0.5:.3f}",
                         "2", f"{statistics.fmean(retried):.3f} ± {statistics.stdev(retried) / 2 ** 0.5:.3f}", "0"], cells

        # The same env with --retry-on model_timeout: its failures are not of that class, so the
        # two episodes whose first reset failed are dead-lettered on their first attempt.
        server.seen.clear()
        server.failed_ids.clear()
        other = tmp_path / "runs2"
        run = interactor("run", tasks, "--llm-base-url", model_url + "/v1", "--run-dir", str(other),
                         "--concurrency", "4", "--workers", "1", "--job-id", "strict", "--retry-on", "model_timeout")
        assert run.returncode != 0 or "failed=2" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
        dead = db_rows(str(other / "results.sqlite"),
                       "SELECT episode_id, attempts, error FROM episodes WHERE job_id = 'strict' AND status = 'failed'")
        assert sorted(e for e, _, _ in dead) == sorted(server.failed_ids) and len(dead) == ROWS // 5
        assert all(n == 1 and "not retried: --retry-on model_timeout does not name its class env_outage" in error
                   for _, n, error in dead), dead
        got = json.loads(interactor("results", "strict", "--run-dir", str(other), "--json").stdout)["retries"]
        assert (got["job"]["first_try"]["completed"], got["job"]["retried"]["completed"], got["job"]["failed"]) == (
            ROWS - ROWS // 5, 0, ROWS // 5)
    finally:
        server.shutdown()
