"""Comparing two jobs (issue 50): consumer/storage/compare.py's numbers against a computation by
hand, `interactor compare A B` on a results store, and the browser's compare page as served
(Flask's client; tests/test_compare_browser.py has it in Chromium)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from consumer.storage import open_store
from consumer.storage.compare import compare, difference
from consumer.storage.score_stats import Sample
from tests.compare_jobs import ENV, JOB_A, JOB_B, REWARDS_A, REWARDS_B, TASK_MARKUP, fill_two_jobs
from tests.conftest import ROOT

pytestmark = pytest.mark.unit  # needs no server: make check runs it


def test_the_difference_and_its_noise_rule():
    a, b = {"mean": 0.5, "stderr": 0.1}, {"mean": 0.8, "stderr": 0.1}
    d = difference(a, b)
    assert d["diff"] == pytest.approx(0.3) and d["se_diff"] == pytest.approx(math.sqrt(0.02))
    assert d["beyond_noise"] is True  # 0.3 > 2 * 0.1414
    assert difference(a, {"mean": 0.7, "stderr": 0.1})["beyond_noise"] is False  # 0.2 < 0.283
    assert difference(a, {"mean": 0.9, "stderr": None}) == {"diff": pytest.approx(0.4), "se_diff": None,
                                                           "beyond_noise": None}


def test_rows_match_by_what_they_asked_whatever_the_job_ids():
    asked = {"x.1": '{"q":1}', "x.2": '{"q":2}', "x.3": "{}"}
    sa = [Sample("x.1", "e", 1.0), Sample("x.2", "e", 0.0), Sample("x.3", "e", 1.0)]
    asked_b = {"y.7": '{"q":2}', "y.8": '{"q":1}', "y.3": "{}", "y.9": '{"q":9}'}
    sb = [Sample("y.7", "e", 1.0), Sample("y.8", "e", 0.0), Sample("y.3", "e", 1.0), Sample("y.9", "e", None)]
    got = compare("x", sa, asked, "y", sb, asked_b)
    assert [r["group_a"] for r in got["only_a"]] == ["x.1"] and [r["group_b"] for r in got["only_b"]] == ["y.7"]
    assert (got["matched"], got["unmatched_a"], got["unmatched_b"]) == (3, 0, 1)
    rewards_a, rewards_b = [1.0, 0.0, 1.0], [1.0, 0.0, 1.0]
    se = statistics.stdev(rewards_a) / math.sqrt(3)
    assert got["by_env"]["e"]["a"]["stderr"] == pytest.approx(se)
    assert got["job"]["diff"] == pytest.approx(statistics.fmean(rewards_b) - statistics.fmean(rewards_a))
    strict = compare("x", sa, asked, "y", sb, asked_b, threshold=2.0)  # nothing reaches 2: nothing solved
    assert strict["only_a"] == strict["only_b"] == []


def store_of_two_jobs(tmp_path) -> str:
    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    fill_two_jobs(store)
    store.close()
    return path


def test_compare_command_prints_both_jobs_the_rule_and_the_rows(tmp_path):
    path = store_of_two_jobs(tmp_path)
    run = subprocess.run([sys.executable, "-m", "interactor.cli", "compare", JOB_A, JOB_B, "--store", path],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "more than noise when |B - A| > 2 * sqrt(se_A^2 + se_B^2)" in out
    se = statistics.stdev(REWARDS_A) / math.sqrt(6)
    se_diff = math.sqrt(2) * se  # both jobs' rewards have the same spread
    row = next(line for line in out.splitlines() if line.startswith(ENV))
    assert f"{statistics.fmean(REWARDS_A):.3f} ± {se:.3f}" in row
    assert f"{statistics.fmean(REWARDS_B) - statistics.fmean(REWARDS_A):+.3f}" in row
    assert f"{se_diff:.3f}" in row and row.endswith("within noise")
    assert "task rows matched by env_name and what they asked: 6 in both" in out
    assert "solved by A, not by B: 2 rows" in out and "solved by B, not by A: 2 rows" in out
    assert TASK_MARKUP in out  # the terminal shows the text as it is
    capped = subprocess.run([sys.executable, "-m", "interactor.cli", "compare", JOB_A, JOB_B, "--store", path, "--json"],
                            capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    got = json.loads(capped.stdout)
    assert [r["task"] for r in got["only_a"]] == ['{"question":"What is 1 + 1?"}', '{"question":"What is 2 + 1?"}']
    missing = subprocess.run([sys.executable, "-m", "interactor.cli", "compare", JOB_A, "nope", "--store", path],
                             capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert missing.returncode == 2 and "no job 'nope'" in missing.stderr


def test_compare_page_escapes_job_ids_and_task_text(tmp_path):
    from interactor.ui.app import create_app
    from interactor.ui.source import Source

    path = store_of_two_jobs(tmp_path)
    store = open_store(path, readonly=True)
    try:
        client = create_app(Source(store, store_shown=path)).test_client()
        empty = client.get("/compare").get_data(as_text=True)
        assert "base&lt;b&gt;line" in empty and "<b>line" not in empty
        resp = client.get("/compare", query_string={"a": JOB_A, "b": JOB_B})
        html = resp.get_data(as_text=True)
        assert resp.status_code == 200
        assert TASK_MARKUP not in html and "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
        assert '<svg onload' not in html and "&lt;svg onload=" in html
        assert html.count("within noise") == 2  # the env and all
        table = html.split('id="only-b"', 1)[1].split("</table>", 1)[0]
        assert table.count("<tr>") == 3  # the head and rows 5 and 6
        assert client.get("/compare", query_string={"a": JOB_A, "b": "nope"}).status_code == 404
        assert client.get("/compare", query_string={"a": JOB_A, "b": JOB_B, "threshold": "x"}).status_code == 400
    finally:
        store.close()
