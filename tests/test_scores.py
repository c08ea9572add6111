"""Results that say how sure they are (issue 48): the standard error, the 95% interval, pass@1,
pass@k and mean@k of consumer/storage/score_stats.py against independent computations, and
`interactor results JOB`, `--json` and `--rows` after a real local run, as a user types them."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from itertools import combinations

import pytest

from consumer.storage.score_stats import Sample, score_summary, t975, task_rows
from tests.conftest import ROOT
from tests.storecheck import db_rows
from tests.taskfiles import write_arith_tasks


def test_one_sample_per_task_gives_the_textbook_standard_error():
    rewards = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0]
    s = score_summary([Sample(f"g{i}", "e", r) for i, r in enumerate(rewards)])["job"]
    assert s["mean"] == pytest.approx(statistics.fmean(rewards))
    assert s["stderr"] == pytest.approx(statistics.stdev(rewards) / math.sqrt(len(rewards)))
    half = 2.447 * s["stderr"]  # t at 6 degrees of freedom
    assert s["ci95"] == pytest.approx([s["mean"] - half, s["mean"] + half])
    assert s["k"] == 1 and s["pass@k"] == s["pass@1"] == pytest.approx(3 / 7)


def test_samples_of_one_task_are_not_counted_as_independent():
    """Four tasks of four samples: the error is that of the four task means (equal sizes), wider
    than the naive one over sixteen rewards when the samples of a task agree."""
    tasks = {"g1": [1, 1, 1, 1], "g2": [0, 0, 0, 0], "g3": [1, 1, 1, 0], "g4": [0, 0, 0, 0]}
    samples = [Sample(g, "e", float(r)) for g, rs in tasks.items() for r in rs]
    s = score_summary(samples)["job"]
    means = [statistics.fmean(r) for r in tasks.values()]
    assert s["stderr"] == pytest.approx(statistics.stdev(means) / math.sqrt(4))
    naive = statistics.stdev([x for r in tasks.values() for x in r]) / 4
    assert s["stderr"] > naive
    assert s["mean@k"] == pytest.approx(statistics.fmean(means))


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k by enumerating every k of the n samples: the share of draws with a solved one."""
    draws = list(combinations([1] * c + [0] * (n - c), k))
    return sum(1 for d in draws if any(d)) / len(draws)


@pytest.mark.parametrize("solved", [[0, 0], [1, 0], [1, 1], [3, 1, 0, 4]])
def test_pass_at_1_and_pass_at_k_against_enumeration(solved):
    k = 4
    samples = [Sample(f"g{i}", "e", 1.0 if j < c else 0.0) for i, c in enumerate(solved) for j in range(k)]
    s = score_summary(samples)["job"]
    assert s["k"] == k
    assert s["pass@1"] == pytest.approx(statistics.fmean(brute_pass_at_k(k, c, 1) for c in solved))
    assert s["pass@k"] == pytest.approx(statistics.fmean(brute_pass_at_k(k, c, k) for c in solved))
    rows = task_rows(samples)
    assert [r["solved_by"] for r in rows] == ["always" if c == k else "never" if not c else "sometimes" for c in solved]


def test_failed_episodes_are_counted_apart_never_scored_zero():
    samples = [Sample("g1", "e", 1.0), Sample("g1", "e", None, failed=True), Sample("g2", "e", 0.0),
               Sample("g2", "e", None)]  # the last: cancelled, neither scored nor failed
    s = score_summary(samples)["job"]
    assert (s["episodes"], s["failed"], s["mean"]) == (2, 1, 0.5)
    assert score_summary([Sample("g1", "e", None, failed=True)])["job"]["mean"] is None


def test_t_quantiles():
    assert t975(1) == pytest.approx(12.706)
    assert t975(60) == pytest.approx(2.000, abs=1e-3)
    assert t975(120) == pytest.approx(1.980, abs=1e-3)
    assert t975(10_000) == pytest.approx(1.960, abs=1e-3)


@pytest.mark.integration
def test_results_summary_json_and_rows_after_a_run(tmp_path, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    tasks = write_arith_tasks(tmp_path, env_url, rows=6, env_num=3)
    run_dir = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}

    def interactor(*args):
        return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=env, cwd=str(ROOT),
                              capture_output=True, text=True, timeout=300)

    run = interactor("run", tasks, "--llm-base-url", model_url + "/v1", "--run-dir", str(run_dir),
                     "--concurrency", "4", "--workers", "1", "--job-id", "scored")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "scores (completed episodes; standard errors over tasks" in run.stdout
    assert "mean ± stderr" in run.stdout and "95% interval" in run.stdout and "pass@k" in run.stdout

    got = json.loads(interactor("results", "scored", "--run-dir", str(run_dir), "--json").stdout)["scores"]
    rewards = {}
    for group, reward in db_rows(str(run_dir / "results.sqlite"),
                                 "SELECT group_id, total_reward FROM episodes WHERE job_id = 'scored'"):
        rewards.setdefault(group, []).append(reward)
    means = [statistics.fmean(r) for r in rewards.values()]
    job = got["job"]
    assert (job["tasks"], job["k"], job["episodes"]) == (6, 3, 18)
    assert job["mean"] == pytest.approx(statistics.fmean(means))
    assert job["stderr"] == pytest.approx(statistics.stdev(means) / math.sqrt(6))
    assert job["ci95"] == pytest.approx([job["mean"] - 2.571 * job["stderr"], job["mean"] + 2.571 * job["stderr"]])
    assert job["pass@k"] == pytest.approx(statistics.fmean(1.0 if max(r) >= 1 else 0.0 for r in rewards.values()))
    assert got["by_env"]["arithmetic"]["mean"] == pytest.approx(job["mean"])

    rows = interactor("results", "scored", "--run-dir", str(run_dir), "--rows")
    assert rows.returncode == 0, rows.stderr
    lines = rows.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("group_id"))
    table = lines[start + 2:start + 8]
    assert [line.split()[0] for line in table] == [f"scored.1.1.{r}" for r in range(1, 7)]
    assert all('{"question":"What is' in line for line in table), table
    for line in table:
        group = line.split()[0]
        solved = sum(1 for x in rewards[group] if x >= 1)
        assert line.split()[4] == str(solved)
        assert ("always" if solved == 3 else "never" if not solved else "sometimes") in line
    assert lines[start + 8].startswith("6 tasks: solved always ")

    # interactor jobs across run folders: a parent of several, or one store by its path
    import shutil

    (tmp_path / "more" / "eval2").mkdir(parents=True)
    shutil.copy(run_dir / "results.sqlite", tmp_path / "more" / "eval2" / "results.sqlite")
    listed = interactor("jobs", "--run-dir", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    head, *rows = listed.stdout.splitlines()
    assert head.rstrip().endswith("run dir"), head
    assert sorted(r.split()[-1] for r in rows) == sorted([str(run_dir), str(tmp_path / "more" / "eval2")]), rows
    assert all(r.split()[0] == "scored" and "finished" in r.split() for r in rows), rows
    one = json.loads(interactor("jobs", "--store", str(run_dir / "results.sqlite"), "--json").stdout)
    assert [(j["job_id"], j["state"], j["completed"]) for j in one] == [("scored", "finished", 18)]


def test_the_job_page_shows_the_scores_and_an_episode_its_reasoning(tmp_path):
    """The browser's pages as served (Flask's client; tests/test_ui_browser.py has them in Chromium)."""
    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import Source
    from tests.test_ui import JOB, fill, rec_close, rec_step

    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    fill(store)
    step = rec_step("ep-r", 1, [{"role": "user", "content": "What is 1 + 1?"}], "2", reward=1.0, cum=1.0, last=True,
                    group="g3")
    step.reasoning_content = "<b>one</b> and one make two"
    store.write_batch([step, rec_close("ep-r", 1.0, 1, group="g3", size=1)])
    store.close()
    store = open_store(path, readonly=True)
    try:
        client = create_app(Source(store, store_shown=path)).test_client()
        html = client.get(f"/jobs/{JOB}").get_data(as_text=True)
        scores = html.split('id="scores"', 1)[1].split("</table>", 1)[0]
        assert scores.count("<tr") == 4  # the head, two env_names, all
        mean = statistics.fmean([1.0, 0.0, 0.5, 1.0])
        assert f"{mean:.3f} ± " in scores and "[" in scores
        assert "solved always 1, sometimes 1," in " ".join(html.split()) and "never 1" in html
        page = client.get("/episodes/ep-r").get_data(as_text=True)
        assert "&lt;b&gt;one&lt;/b&gt; and one make two" in page and 'class="reasoning"' in page
    finally:
        store.close()
