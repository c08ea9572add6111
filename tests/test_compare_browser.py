"""The results browser's compare page in a real browser (headless Chromium through Playwright, as
tests/test_ui_browser.py drives it): two jobs of one task file run through Redis, a worker
process and the consumer, the model answering each job's rows differently; the page, reached
from the header and its form, shows each job's mean reward ± standard error, the difference
with its verdict, and the rows each solves and the other does not; nothing on it runs scripts.

Chromium is Debian's (/usr/bin/chromium, or $CHROMIUM_PATH); `make test-browser` installs it and
Playwright; elsewhere these tests are skipped with the reason."""

from __future__ import annotations

import math
import statistics

import pytest

from producer.enqueue import submit
from tests.taskfiles import write_arith_tasks
from tests.test_integration import wait_job_stored
from tests.test_ui_browser import TIMEOUT_MS, browser, page, ui_server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.integration]

ROWS = 6
SOLVED_A = {0, 1, 2, 3}  # the dataset rows each job's model answers right
SOLVED_B = {2, 3, 4, 5}


def answer(model, solved: set[int]) -> None:
    """The stand-in answers row i's question ("What is i + i+3?") right when i is in ``solved``."""
    model.replies = {f"What is {i} + {i + 3}?": str(2 * i + 3 if i in solved else -1) for i in range(ROWS)}


def test_the_compare_page_shows_two_jobs_side_by_side(page, settings, procs, redis_client, tmp_path):  # noqa: F811
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    env, env_url = start_env()
    model, model_url = start_model(latency_ms=10)
    ui = None
    try:
        settings = settings.replace(llm_base_url=model_url + "/v1")
        procs.settings = settings
        tasks = write_arith_tasks(tmp_path, env_url, rows=ROWS, env_num=1)
        answer(model, SOLVED_A)
        job_a = submit(redis_client, settings, [tasks], job_id="base").job.job_id
        procs.worker("w1")
        procs.consumer()
        assert wait_job_stored(settings, job_a, ROWS, timeout=TIMEOUT_MS / 1000)["completed"] == ROWS
        answer(model, SOLVED_B)
        job_b = submit(redis_client, settings, [tasks], job_id="tuned").job.job_id
        assert wait_job_stored(settings, job_b, ROWS, timeout=TIMEOUT_MS / 1000)["completed"] == ROWS

        ui = ui_server(settings)
        page.goto(ui.url)
        page.click("header nav >> text=Compare")
        page.select_option("#compare-form select[name=a]", job_a)
        page.select_option("#compare-form select[name=b]", job_b)
        page.click("#compare-form button[type=submit]")
        page.wait_for_selector("table#compare")
        assert page.inner_text("#job-a") == job_a and page.inner_text("#job-b") == job_b
        assert "2 * sqrt(se_A^2 + se_B^2)" in page.inner_text("#rule")

        rewards_a = [1.0 if i in SOLVED_A else 0.0 for i in range(ROWS)]
        rewards_b = [1.0 if i in SOLVED_B else 0.0 for i in range(ROWS)]
        se_a = statistics.stdev(rewards_a) / math.sqrt(ROWS)
        se_b = statistics.stdev(rewards_b) / math.sqrt(ROWS)
        cells = page.eval_on_selector_all('table#compare tr[data-env="arithmetic"] td',
                                          "els => els.map(e => e.textContent.trim())")
        assert cells == ["arithmetic", str(ROWS), f"{statistics.fmean(rewards_a):.3f} ± {se_a:.3f}", str(ROWS),
                         f"{statistics.fmean(rewards_b):.3f} ± {se_b:.3f}",
                         f"{statistics.fmean(rewards_b) - statistics.fmean(rewards_a):+.3f}",
                         f"{math.sqrt(se_a ** 2 + se_b ** 2):.3f}", "within noise"]
        assert page.locator('table#compare tr[data-env="all"]').count() == 1
        assert f"{ROWS} in both" in page.inner_text("#matched")

        def rows_of(table: str) -> list[str]:
            return page.eval_on_selector_all(f"table#{table} tbody td.task", "els => els.map(e => e.textContent)")

        assert page.inner_text("#only-a-count") == "2" and page.inner_text("#only-b-count") == "2"
        assert rows_of("only-a") == [f'{{"question":"What is {i} + {i + 3}?","answer":{2 * i + 3}}}'
                                     for i in sorted(SOLVED_A - SOLVED_B)]
        assert rows_of("only-b") == [f'{{"question":"What is {i} + {i + 3}?","answer":{2 * i + 3}}}'
                                     for i in sorted(SOLVED_B - SOLVED_A)]
        # a row's links lead to each job's group of that task
        page.locator("table#only-b tbody tr").first.locator("a", has_text="B").click()
        assert job_b in page.url and page.locator("#members").count() == 1
        page.go_back()
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
        assert (tmp_path / "compare.png").stat().st_size > 10_000
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert not page.problems, page.problems
    finally:
        if ui is not None:
            ui.stop()
        env.shutdown()
        model.shutdown()
