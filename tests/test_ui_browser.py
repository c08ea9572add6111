"""The results browser in a real browser (headless Chromium through Playwright): a job run
through Redis, worker processes and the consumer, followed job -> group -> episode; the
transcript shown is what the env server saw; a model answer made of <script> is shown and
inert; the jobs page counts up while the job runs; dead letters are re-driven from the page
with --allow-actions and its token, and not without (nor from another site).

Chromium is Debian's (/usr/bin/chromium, or $CHROMIUM_PATH); nothing is downloaded (no
`playwright install`). `make test-browser` installs it and Playwright; elsewhere these tests
are skipped with the reason. Screenshots go to each test's tmp_path.
"""

from __future__ import annotations

import os
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from consumer.storage import open_store
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.test_integration import wait_job_stored, write_tasks

pytestmark = [pytest.mark.browser, pytest.mark.integration]

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
SCRIPT_ANSWER = "<script>window.__pwned=1</script> The answer is 5"
TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed: `make test-browser` installs it (pip install -e '.[browser]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: `make test-browser` installs Debian's chromium package "
                    "(or set CHROMIUM_PATH)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    problems: list[str] = []
    pg.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    pg.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    pg.problems = problems
    yield pg
    context.close()


def ui_server(settings, **kw):
    from interactor.ui.server import UIServer, open_source

    open_store(settings.results_store).close()  # as the consumer makes it when it starts
    return UIServer(open_source(settings), "127.0.0.1", 0, **kw).start()


def shown_conversation(page) -> list[tuple[str, str]]:
    """(role, text) of every message in the transcript, in order, leaving out the full
    prompts folded under each step."""
    return [tuple(x) for x in page.eval_on_selector_all(
        ".chat > section.step > .msg",
        "els => els.map(e => [e.dataset.role, [...e.querySelectorAll('.text')].map(t => t.textContent).join('\\n')])")]


def test_browse_a_job_to_an_episode_whose_transcript_is_what_the_env_saw(page, settings, procs, redis_client,
                                                                         tmp_path):
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    env, env_url = start_env(log_requests=True)
    model, model_url = start_model(latency_ms=30)
    model.replies = {"What is 1 + 4?": SCRIPT_ANSWER}  # the arithmetic task of dataset row 1
    ui = None
    try:
        settings = settings.replace(llm_base_url=model_url + "/v1")
        procs.settings = settings
        sub = submit(redis_client, settings, [write_tasks(tmp_path, env_url, guess=3, rows=3, arith_num=2)])
        job_id, total = sub.job.job_id, 3 + 3 * 2
        ui = ui_server(settings)

        # The jobs page, opened before anything ran, counts up by itself (no reload).
        page.goto(ui.url)
        row = page.locator(f'tr[data-job="{job_id}"]')
        assert row.count() == 1
        procs.worker("w1")
        procs.consumer()
        page.wait_for_function(
            "([id, n]) => { const r = document.querySelector(`tr[data-job=\"${id}\"]`);"
            " return r && r.querySelector('[data-field=done]').textContent === String(n)"
            " && r.querySelector('[data-field=state]').textContent === 'finished'; }",
            arg=[job_id, total], timeout=TIMEOUT_MS)
        assert wait_job_stored(settings, job_id, total)["completed"] == total

        # job -> groups -> the guess_number group -> its first sample
        page.reload()
        page.click(f'tr[data-job="{job_id}"] a')
        assert page.locator("svg.plot").count() == 2
        assert "guess_number" in page.inner_text("table.grid")
        page.click("nav.tabs >> text=Groups")
        page.locator("#groups tbody tr", has_text="guess_number").locator("a.mono").first.click()
        assert page.locator(".side .column").count() == 3
        page.locator("#members tbody a").first.click()
        episode_id = page.inner_text("#episode-id")

        # What the env saw: the prompts it served (the last one is the whole conversation) and
        # the actions it was sent, with their rewards.
        (instance,) = [k for k in env.exchanges if k.split("~")[0] == episode_id]
        seen = env.exchanges[instance]
        prompts = [x["prompt"] for x in seen if "prompt" in x and x["prompt"]]
        actions = [x for x in seen if "action" in x]
        want = [(m["role"], m["content"]) for m in prompts[-1]] + [("assistant", actions[-1]["action"])]
        assert shown_conversation(page) == want
        answers = page.eval_on_selector_all(".chat > section.step > .msg:last-child .text", "els => els.map(e => e.textContent)")
        assert answers == [a["action"] for a in actions]
        rewards = page.eval_on_selector_all(".chat .step-meta span:nth-child(2) b", "els => els.map(e => Number(e.textContent))")
        assert rewards == [a["reward"] for a in actions]
        assert page.inner_text("#episode-reward") == f"{sum(a['reward'] for a in actions):.3f}"
        page.screenshot(path=str(tmp_path / "episode.png"), full_page=True)

        # The answer made of markup: visible as text, never run (escaped, and CSP besides).
        store = open_store(settings.results_store, readonly=True)
        (scripted,) = store.sql("SELECT session_id FROM session_steps WHERE job_id = ? AND response = ? LIMIT 1",
                                (job_id, SCRIPT_ANSWER))
        store.close()
        page.goto(ui.url + f"episodes/{scripted[0]}")
        assert page.get_by_text(SCRIPT_ANSWER, exact=True).is_visible()
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert page.evaluate("[...document.scripts].some(s => s.textContent.includes('__pwned'))") is False
        page.screenshot(path=str(tmp_path / "script-answer.png"), full_page=True)
        assert (tmp_path / "episode.png").stat().st_size > 10_000
        assert not page.problems, page.problems
    finally:
        if ui is not None:
            ui.stop()
        env.shutdown()
        model.shutdown()


class _AttackerPage(BaseHTTPRequestHandler):
    """Another site's page that posts a re-drive to the browser as soon as it loads."""

    target = ""
    fields: dict[str, str] = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        inputs = "".join(f'<input type="hidden" name="{k}" value="{v}">' for k, v in self.fields.items())
        html = (f'<html><body><form id="f" method="post" action="{self.target}">{inputs}</form>'
                '<script>document.getElementById("f").submit()</script></body></html>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(html)))
        self.end_headers()
        self.wfile.write(html)

    def log_message(self, *args):
        pass


def test_dead_letters_are_redriven_from_the_page_only_with_actions_and_the_token(page, settings, procs,
                                                                                 redis_client, tmp_path):
    from examples.envserver import start_in_thread as start_env
    from examples.model_standin import start_in_thread as start_model

    env, env_url = start_env()
    model, model_url = start_model(malformed_rate=1.0)  # every answer malformed: dead letters
    servers = []
    try:
        settings = settings.replace(llm_base_url=model_url + "/v1")
        procs.settings = settings
        tasks = tmp_path / "dead.yaml"
        tasks.write_text(textwrap.dedent(f"""\
            environments:
              - env_name: guess_number
                base_url: {env_url}
                env_params: {{low: 1, high: 16, max_turns: 6}}
                env_num: 2
            """))
        job_id = submit(redis_client, settings, [str(tasks)]).job.job_id
        procs.worker("w1")
        procs.consumer()
        dlq = DeadLetterQueue(redis_client, settings)
        wait_for(lambda: len(dlq.list(job_id=job_id)) == 2, 90, what="two dead letters")
        model.malformed_rate = 0.0  # the cause is gone: a re-drive will complete
        ledger = Ledger(redis_client, Keys(settings.key_prefix))
        first, second = sorted(d.episode_id for d in dlq.list(job_id=job_id))

        # Without --allow-actions: listed with reason and error, no button, a POST is refused.
        readonly = ui_server(settings)
        servers.append(readonly)
        page.goto(readonly.url + "dead-letters")
        assert page.locator("#letters tbody tr").count() == 2
        assert "model_malformed" in page.inner_text("#letters")
        assert page.locator("button.redrive").count() == 0 and page.locator("#actions-off").is_visible()
        resp = page.request.post(readonly.url + "dead-letters/redrive", form={"episode_id": first, "token": "x" * 32})
        assert resp.status == 403

        # With --allow-actions: another site cannot post a re-drive, even knowing the token.
        ui = ui_server(settings, allow_actions=True)
        servers.append(ui)
        _AttackerPage.target = ui.url + "dead-letters/redrive"
        _AttackerPage.fields = {"episode_id": first, "token": ui.token}
        attacker = ThreadingHTTPServer(("127.0.0.1", 0), _AttackerPage)
        threading.Thread(target=attacker.serve_forever, daemon=True).start()
        try:
            page.goto(f"http://localhost:{attacker.server_port}/")
            page.wait_for_url(ui.url + "dead-letters/redrive")
            assert "cross-site request refused" in page.content()
        finally:
            attacker.shutdown()
        assert ledger.state(job_id, first) == "failed" and len(dlq.list(job_id=job_id)) == 2
        page.problems.clear()  # the refused post's 403, as it should be

        # The printed address carries the token in its fragment; the page keeps it for the tab.
        page.goto(ui.action_url)
        assert "#token" not in page.url
        page.goto(ui.url + f"dead-letters?job={job_id}")
        assert page.locator("button.redrive").count() == 2
        assert not page.locator(f'tr[data-episode="{first}"] input[name=token]').is_visible()  # filled in, hidden
        page.locator(f'tr[data-episode="{first}"] button.redrive').click()
        page.wait_for_selector("#flash")
        assert "Re-drove 1 episodes" in page.inner_text("#flash")
        assert page.locator("#letters tbody tr[data-episode]").count() == 1
        page.screenshot(path=str(tmp_path / "dead-letters.png"), full_page=True)
        wait_for(lambda: ledger.state(job_id, first) == "done", 90, what="the re-driven episode to complete")
        assert ledger.state(job_id, second) == "failed"
        store = open_store(settings.results_store, readonly=True)
        wait_for(lambda: store.episode(first)["status"] == "completed", 60, what="the completion stored")
        store.close()
        page.goto(ui.url + f"episodes/{first}")
        assert page.locator("#attempts tbody tr").count() == 2  # the dead attempt and the one that completed
        assert not page.problems, page.problems
    finally:
        for s in servers:
            s.stop()
        env.shutdown()
        model.shutdown()


def test_images_in_transcripts_are_shown_and_nothing_is_fetched_from_elsewhere(page, tmp_path):
    """Data-URL images show as images; other image URLs and markup stay text; the page loads
    nothing but its own files (it works offline)."""
    from broker.settings import Settings
    from tests.test_ui import fill

    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    fill(store)
    store.close()
    ui = ui_server(Settings.from_env({}, store_url=path))
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    try:
        page.goto(ui.url + "episodes/ep-x")
        shown = ".chat > section.step > .msg img.msg-img"  # (the folded full prompt has it too)
        assert page.locator(shown).count() == 1
        page.wait_for_function(f"() => document.querySelector('{shown}').complete")
        assert page.evaluate(f"document.querySelector('{shown}').naturalWidth") == 1
        assert page.get_by_text("http://evil.example/x.png").first.is_visible()
        assert page.evaluate("typeof window.__pwned") == "undefined"
        page.goto(ui.url + "jobs/jobui")  # plots with an env named <svg onload=...>
        assert page.locator("svg.plot").count() == 2
        assert page.evaluate("typeof window.__pwned") == "undefined"
        others = [u for u in requested if not (u.startswith(ui.url) or u.startswith("data:"))]
        assert not others, others
        assert not page.problems, page.problems
    finally:
        ui.stop()


def test_the_job_page_says_how_sure_its_scores_are_and_an_episode_shows_its_reasoning(page, tmp_path):
    """Issue 48: the job page's score table (mean ± stderr, 95% interval, pass@1, pass@k,
    mean@k per env_name and for the job) and tasks solved always/sometimes/never; an answer's
    reasoning_content above it on the episode's page, as text (markup in it stays inert)."""
    from broker.settings import Settings
    from tests.test_ui import JOB, fill, rec_close, rec_step

    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    fill(store)
    step = rec_step("ep-r", 1, [{"role": "user", "content": "What is 1 + 1?"}], "2", reward=1.0, cum=1.0, last=True,
                    group="g3")
    step.reasoning_content = "<b>one</b> and one make two"
    store.write_batch([step, rec_close("ep-r", 1.0, 1, group="g3", size=1)])
    store.close()
    ui = ui_server(Settings.from_env({}, store_url=path))
    try:
        page.goto(ui.url + f"jobs/{JOB}")
        rows = page.locator("#scores tbody tr")
        assert rows.count() == 3  # arith, the markup-named env, all
        assert rows.last.locator("td").first.inner_text() == "all"
        # the job's row: its three tasks give a standard error and an interval (the markup-named
        # env, sorted first, has one task: no spread to show)
        assert "±" in rows.last.inner_text() and "[" in rows.last.inner_text()
        assert "solved always 1, sometimes 1, never 1" in page.locator("#solved-by").inner_text()
        page.goto(ui.url + "episodes/ep-r")
        reasoning = page.locator("details.reasoning .text")
        assert reasoning.inner_text() == "<b>one</b> and one make two"
        assert page.locator("details.reasoning b").count() == 0
        assert not page.problems, page.problems
    finally:
        ui.stop()
