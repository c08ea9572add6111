"""The results browser without a browser: pages over a real store (Flask's test client),
escaping of untrusted transcripts, transcripts shown once per message, the Host and action
guards, re-drive against a real Redis, and the `interactor ui` / `interactor run --ui`
commands."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import orjson
import pytest
from hypothesis import given
from hypothesis import settings as settings_hyp
from hypothesis import strategies as st

from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import AttemptRecord, JobSpec, StepRecord
from consumer.storage import open_store
from interactor.ui import plots, transcript
from interactor.ui.app import create_app
from interactor.ui.server import allowed_hosts
from interactor.ui.source import LiveState, RateMeter, Source
from tests.conftest import ROOT, interruptible, wait_for
from workers.loop import trim_messages

JOB = "jobui"
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
       "RU5ErkJggg==")
SCRIPT = "<script>window.__pwned=1</script>"


def rec_step(ep, n, msgs, response, *, reward=0.0, cum=0.0, last=False, env="arith", group="g1", finish="stop"):
    return StepRecord(job_id=JOB, env_id=ep, attempt=1, step_id=n, env_name=env, llm_model="m", group_id=group,
                      messages_json=orjson.dumps(msgs), response=response, step_reward=reward, cumulative_reward=cum,
                      terminated=last, truncated=False, episode_finished=last, is_trainable=True, weight_version="v7",
                      attempt_id=f"{ep}-a1", created_at=1000.0 + n, finish_reason=finish, env_latency_s=0.01,
                      model_latency_s=0.2, prompt_tokens=11, completion_tokens=5, ended_by="terminated" if last else "")


def rec_close(ep, total, steps, *, env="arith", group="g1", size=2, status="completed", reason=""):
    return AttemptRecord(job_id=JOB, episode_id=ep, attempt=1, status=status, group_id=group, group_size=size,
                         env_name=env, llm_model="m", total_reward=total, steps=steps, reason=reason,
                         attempt_id=f"{ep}-a1", started_at=1000.0, finished_at=1010.0 + steps,
                         ended_by="terminated" if status == "completed" else "")


SYSTEM = {"role": "system", "content": "You are <b>careful</b>."}
QUESTION = {"role": "user", "content": "What is 2 + 2? <img src=x onerror=alert(1)>"}
IMAGES = {"role": "user", "content": [
    {"type": "text", "text": "Look at this:"},
    {"type": "image_url", "image_url": {"url": PNG}},
    {"type": "image_url", "image_url": {"url": "http://evil.example/x.png"}},
    {"type": "image_url", "image_url": {"url": "javascript:alert(1)"}},
]}


def fill(store) -> None:
    """One job: a two-step episode whose answer is markup and whose prompt carries images, its
    group mate, and an episode of an env whose name is markup."""
    first = [SYSTEM, QUESTION]
    second = [SYSTEM, QUESTION, {"role": "assistant", "content": SCRIPT}, IMAGES]
    recs = [JobSpec(job_id=JOB, llm_base_url="http://user:pw@llm/v1", model="m", episodes=3, groups=2)]
    recs += [rec_step("ep-x", 1, first, SCRIPT), rec_step("ep-x", 2, second, "4", reward=1.0, cum=1.0, last=True),
             rec_close("ep-x", 1.0, 2)]
    recs += [rec_step("ep-y", 1, first, "5", last=True), rec_close("ep-y", 0.0, 1)]
    evil_env = '<svg onload="alert(1)">'
    recs += [rec_step("ep-z", 1, first, "x", last=True, env=evil_env, group="g2"),
             rec_close("ep-z", 0.5, 1, env=evil_env, group="g2", size=1)]
    store.write_batch(recs)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    fill(store)
    store.close()
    return path


def client_for(path, *, live=None, **kw):
    source = Source(open_store(path, readonly=True), store_shown=path, live=live)
    return create_app(source, **kw).test_client()


def body(resp) -> str:
    assert resp.status_code == 200, resp.get_data(as_text=True)[:2000]
    return resp.get_data(as_text=True)


# --- pages and escaping --------------------------------------------------------------------
@pytest.mark.unit
def test_every_page_renders_and_untrusted_text_stays_text(db):
    c = client_for(db)
    jobs = body(c.get("/"))
    assert f'href="/jobs/{JOB}"' in jobs
    overview = body(c.get(f"/jobs/{JOB}"))
    assert "<svg onload" not in overview and "&lt;svg onload=" in overview  # env name, in tables and plots
    assert overview.count('<svg class="plot"') == 2
    assert "user:pw" not in overview  # the job spec's URL is stored redacted
    episode = body(c.get("/episodes/ep-x"))
    assert SCRIPT not in episode and "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in episode
    assert "<img src=x" not in episode and "<b>careful" not in episode
    # The data: image is shown; other image URLs are text, never an <img src>.
    assert f'<img class="msg-img" src="{PNG}"' in episode
    assert 'src="http://evil' not in episode and 'src="javascript:' not in episode
    assert "http://evil.example/x.png</code>" in episode and "javascript:alert(1)</code>" in episode
    assert "weight_version <b>v7</b>" in episode and "finish_reason <b>stop</b>" in episode
    for path in (f"/jobs/{JOB}/episodes", f"/jobs/{JOB}/episodes?sort=reward&desc=1&env=arith&status=completed",
                 f"/jobs/{JOB}/groups", f"/jobs/{JOB}/groups?zero_std=1&sort=std", "/groups/g1", "/dead-letters",
                 "/api/jobs", f"/api/jobs/{JOB}"):
        page = body(c.get(path))
        assert SCRIPT not in page and "<svg onload" not in page
    resp = c.get("/episodes/ep-x")
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "img-src 'self' data:" in csp and "default-src 'none'" in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert c.get("/episodes/nope").status_code == 404
    assert c.get("/jobs/nope").status_code == 404
    assert c.get(f"/jobs/{JOB}/episodes?sort=nope").status_code == 400
    assert c.get(f"/jobs/{JOB}/episodes?rmin=abc").status_code == 400
    assert c.get(f"/jobs/{JOB}/episodes?after=%7Bbad&after_id=x").status_code == 400


@pytest.mark.unit
def test_group_page_puts_samples_side_by_side_with_advantages(db):
    page = body(client_for(db).get("/groups/g1"))
    assert page.count('class="column"') == 2
    assert "Shown to every sample at step 1" in page  # the same task, shown once
    # rewards 1 and 0: mean 0.5, std 0.5, advantages +1 and -1
    assert ">+1.00<" in page and ">-1.00<" in page


@pytest.mark.unit
def test_pager_walks_every_episode_with_keyset_links(tmp_path):
    path = str(tmp_path / "many.sqlite")
    store = open_store(path)
    recs = [JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=57, groups=57)]
    for i in range(57):
        recs += [rec_step(f"e{i:03d}", 1, [QUESTION], "a", reward=float(i % 3), cum=float(i % 3), last=True,
                          group=f"g{i}"),
                 rec_close(f"e{i:03d}", float(i % 3), 1, group=f"g{i}", size=1)]
    store.write_batch(recs)
    store.close()
    c = client_for(path)
    for sort, desc in (("episode_id", "0"), ("reward", "1")):
        seen, url = [], f"/jobs/{JOB}/episodes?sort={sort}&desc={desc}&limit=25"
        while url:
            page = body(c.get(url))
            seen += re.findall(r'href="/episodes/(e\d+)"', page)
            m = re.search(r'<a href="([^"]+)" rel="next">', page)
            url = m.group(1).replace("&amp;", "&") if m else None
        assert len(seen) == 57 and len(set(seen)) == 57
        # From the last page back to the first with "previous".
        back, url = [], f"/jobs/{JOB}/episodes?sort={sort}&desc={desc}&limit=25&page=last"
        while url:
            page = body(c.get(url))
            back = re.findall(r'href="/episodes/(e\d+)"', page) + back
            m = re.search(r'<a href="([^"]+)" rel="prev">', page)
            url = m.group(1).replace("&amp;", "&") if m else None
        assert back == seen


@pytest.mark.unit
def test_full_history_prompts_are_not_repeated_on_the_episode_page(tmp_path):
    """message_cut 0: every prompt is the whole conversation. The page shows each message once
    and folds in only short prompts; long ones are a link to a page of their own."""
    path = str(tmp_path / "long.sqlite")
    store = open_store(path)
    history = [{"role": "system", "content": "rules"}, {"role": "user", "content": "start"}]
    recs = [JobSpec(job_id=JOB, llm_base_url="http://llm", model="m", episodes=1, groups=1)]
    for n in range(1, 13):
        recs.append(rec_step("long", n, list(history), f"answer {n}", last=n == 12))
        history += [{"role": "assistant", "content": f"answer {n}"}, {"role": "user", "content": f"feedback {n}"}]
    recs.append(rec_close("long", 0.0, 12, size=1))
    store.write_batch(recs)
    store.close()
    c = client_for(path)
    page = body(c.get("/episodes/long"))
    assert page.count('<details class="prompt">') == 7  # steps 2..8: prompts of 4..16 messages
    assert page.count('/episodes/long/steps/') == 4  # steps 9..12
    assert page.count(">feedback 5<") == 1 + 3  # shown once, and in the folded prompts of steps 6, 7, 8
    step = body(c.get("/episodes/long/steps/12/prompt"))
    assert step.count('class="msg ') == 24 + 1  # the 24 messages sent, and the answer
    assert c.get("/episodes/long/steps/99/prompt").status_code == 404


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_pages_render_on_both_backends(backend, request, tmp_path):
    target = str(tmp_path / "r.sqlite") if backend == "sqlite" else request.getfixturevalue("pg_server").create_database()
    store = open_store(target)
    fill(store)
    store.close()
    c = client_for(target)
    for path in ("/", f"/jobs/{JOB}", f"/jobs/{JOB}/episodes?sort=duration&desc=1", f"/jobs/{JOB}/groups?sort=mean",
                 "/groups/g1", "/episodes/ep-x", "/episodes/ep-x/steps/2/prompt", "/api/jobs", "/dead-letters"):
        assert SCRIPT not in body(c.get(path))


# --- transcripts ----------------------------------------------------------------------------
@pytest.mark.unit
def test_chat_shows_each_message_of_a_trimmed_conversation_once():
    history = [{"role": "system", "content": "rules"}, {"role": "user", "content": "start"}]
    steps = []
    for n in range(1, 7):
        prompt = trim_messages(list(history), 3)  # what the loop sends: system + last 5 messages
        answer = f"guess {n}"
        steps.append({"step_id": n, "messages": prompt, "response": answer})
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"feedback {n}"}]
    shown = [(m.role, m.text) for m in transcript.conversation(steps)]
    assert shown == [(m["role"], m["content"]) for m in history[:-1]]  # the last feedback was never sent
    views = transcript.chat(steps)
    assert views[0].repeated == 0 and views[3].repeated == 1 + 4 and not any(v.restarted for v in views)
    assert [m.text for m in views[3].prompt] == [m["content"] for m in steps[3]["messages"]]
    # A prompt that does not continue the conversation (a hook rewrote it) is shown whole.
    odd = steps[:2] + [{"step_id": 3, "messages": [{"role": "user", "content": "something else"}], "response": "?"}]
    assert transcript.chat(odd)[2].restarted and [m.text for m in transcript.chat(odd)[2].shown] == ["something else"]


@pytest.mark.unit
def test_message_parts():
    parts = transcript.parts_of(IMAGES["content"])
    assert [p.kind for p in parts] == ["text", "image", "image_link", "image_link"]
    assert transcript.parts_of(None) == [] and transcript.parts_of({"a": 1})[0].kind == "json"
    svg = "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4="
    assert transcript.image_part(svg).kind == "image"
    assert transcript.image_part("data:text/html;base64,PHNjcmlwdD4=").kind == "image_link"
    assert transcript.image_part('data:image/png;base64,AAAA" onerror="x').kind == "image_link"
    msg = transcript.message_of({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]})
    assert msg.parts[0].kind == "json" and "c1" in msg.parts[0].value


@pytest.mark.unit
def test_plots_escape_labels_and_survive_odd_inputs():
    svg = plots.reward_distribution({"<b>x</b>": [1.0, 2.0, 2.0, 5.0], "flat": [3.0]})
    assert "<b>x" not in svg and "&lt;b&gt;x&lt;/b&gt;" in svg and svg.startswith("<svg")
    assert "No completed" in plots.reward_distribution({})
    assert "<svg" in plots.reward_distribution({"one": [0.0]})
    assert "Not enough" in plots.reward_over_time([("a", 1.0, 5.0)])
    assert "<polyline" in plots.reward_over_time([("a", float(i % 2), 1000.0 + i) for i in range(50)])
    assert "<svg" in plots.reward_over_time([("a", 1.0, 5.0), ("b", 1.0, 5.0)])  # no time span at all
    assert plots.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


@pytest.mark.unit
def test_steps_per_second_from_polled_totals():
    m = RateMeter(window_s=10)
    assert m.sample("j", 0, now=0.0) is None
    assert m.sample("j", 50, now=2.0) == pytest.approx(25.0)
    assert m.sample("j", 250, now=12.0) == pytest.approx(20.0)


# --- guards ---------------------------------------------------------------------------------
@pytest.mark.unit
def test_only_our_own_host_names_are_served(db):
    assert allowed_hosts("127.0.0.1", 8050) == {"127.0.0.1:8050", "localhost:8050", "[::1]:8050"}
    assert allowed_hosts("10.1.2.3", 80) == {"10.1.2.3:80", "10.1.2.3"}
    assert allowed_hosts("0.0.0.0", 8050) is None
    assert allowed_hosts("0.0.0.0", 8050, ["LocalHost:8050"]) == {"localhost:8050"}
    assert "ui.example:443" in allowed_hosts("127.0.0.1", 8050, ["ui.example:443"])
    c = client_for(db, allowed_hosts=allowed_hosts("127.0.0.1", 8050))
    assert c.get("/", headers={"Host": "localhost:8050"}).status_code == 200
    assert c.get("/", headers={"Host": "attacker.example:8050"}).status_code == 421  # DNS rebinding
    assert c.get("/api/jobs", headers={"Host": "127.0.0.1.nip.io:8050"}).status_code == 421


@pytest.mark.unit
def test_actions_are_off_without_the_flag(db):
    c = client_for(db)
    assert c.post("/dead-letters/redrive", data={"episode_id": "ep-x", "token": "x" * 32}).status_code == 403
    assert c.get("/dead-letters/redrive").status_code == 405
    with pytest.raises(ValueError):
        create_app(Source(None, store_shown=""), allow_actions=True, token="short")


def make_dead_letters(redis_client, settings, env_url, model_url, n=2):
    from tests.test_runner import make_job
    from workers.runner import WorkerRuntime

    job, eps = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1", env_name="no_such_env",
                        n=n, job_id="dlqjob")
    rt = WorkerRuntime(settings, name="ui-dlq")
    try:
        for e in eps:
            assert rt.run(job.job_id, e.episode_id) == "failed"
    finally:
        rt.stop()
    return job, eps


@pytest.mark.integration
def test_redrive_needs_the_flag_the_token_and_the_same_origin(db, settings, redis_client, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    job, eps = make_dead_letters(redis_client, settings, env_url, model_url)
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    token = "t0ken-" + "x" * 20

    off = client_for(db, live=LiveState(settings))
    page = body(off.get("/dead-letters"))
    assert eps[0].episode_id in page and "env_bad_request" in page
    assert 'id="actions-off"' in page and 'class="redrive"' not in page and 'action="/dead-letters/redrive"' not in page
    assert off.post("/dead-letters/redrive", data={"episode_id": eps[0].episode_id, "token": token}).status_code == 403
    assert ledger.state(job.job_id, eps[0].episode_id) == "failed"

    on = client_for(db, live=LiveState(settings), allow_actions=True, token=token)
    page = body(on.get("/dead-letters?job=dlqjob"))
    assert page.count('class="redrive"') == 2 and token not in page  # the token is never in a page
    form = {"episode_id": eps[0].episode_id}
    assert on.post("/dead-letters/redrive", data=form).status_code == 403
    assert on.post("/dead-letters/redrive", data=form | {"token": "wrong" + token}).status_code == 403
    assert on.post("/dead-letters/redrive", data=form | {"token": token},
                   headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert on.post("/dead-letters/redrive", data=form | {"token": token},
                   headers={"Origin": "http://attacker.example"}).status_code == 403
    assert ledger.state(job.job_id, eps[0].episode_id) == "failed"
    resp = on.post("/dead-letters/redrive", data=form | {"token": token, "job": "dlqjob"},
                   headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"})
    assert resp.status_code == 303 and "redrove=1" in resp.headers["Location"]
    assert ledger.state(job.job_id, eps[0].episode_id) == "queued"
    page = body(on.get("/dead-letters?job=dlqjob&redrove=1"))
    assert "Re-drove 1 episodes" in page and eps[0].episode_id not in page and eps[1].episode_id in page


@pytest.mark.unit
def test_without_redis_the_store_is_enough(db):
    page = body(client_for(db).get("/dead-letters"))
    assert "has none" in page
    assert "no Redis" in body(client_for(db).get("/"))


@pytest.mark.integration
def test_unreachable_redis_is_reported_not_waited_for(db, settings):
    live = LiveState(settings.replace(redis_url="redis://:pw-secret@127.0.0.1:9/0"))
    c = client_for(db, live=live)
    t0 = time.monotonic()
    page = body(c.get("/"))
    assert "Redis unreachable" in page and "pw-secret" not in page
    body(c.get("/dead-letters"))
    assert time.monotonic() - t0 < 10


# --- commands -------------------------------------------------------------------------------
def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}


def _read_url(proc, pattern=r"(http://127\.0\.0\.1:\d+/)", timeout=60) -> tuple[str, str]:
    out = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
        m = re.search(pattern, line)
        if m:
            return m.group(1), out
    raise AssertionError(f"no URL in the output: {out}")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as r:
        return r.read().decode()


def test_interactor_ui_command(db):
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "ui", "--store", db, "--port", "0",
                             "--allow-actions"], env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    try:
        url, out = _read_url(proc)
        assert "Redis none" in out
        token, _ = _read_url(proc, r"#token=(\S+)")
        _, pasted = _read_url(proc, r"paste this token when the page asks: (\S+)")
        assert len(token) >= 24 and pasted.split()[-1] == token
        assert JOB in _get(url) and "ep-x" in _get(url + "episodes/ep-x")
        assert token not in _get(url + "dead-letters")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0


@pytest.mark.integration
def test_interactor_run_with_ui_serves_while_it_runs_and_after(env_server, model_server, tmp_path):
    from tests.test_integration import write_tasks

    _, env_url = env_server
    _, model_url = model_server
    tasks = write_tasks(tmp_path, env_url, guess=2, rows=2, arith_num=2)
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", tasks, "--llm-base-url",
                             model_url + "/v1", "--run-dir", str(tmp_path / "runs"), "--concurrency", "4",
                             "--workers", "1", "--ui", "--ui-port", "0"], env=_env(), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    try:
        url, out = _read_url(proc, r"results browser on (http://127\.0\.0\.1:\d+/)")
        assert "embedded Redis" in out
        wait_for(lambda: orjson.loads(_get(url + "api/jobs"))["jobs"], 30, what="the job on the jobs page")
        _, out = _read_url(proc, r"results browser still on (http://\S+)", timeout=120)
        jobs = orjson.loads(_get(url + "api/jobs"))["jobs"]
        assert len(jobs) == 1 and jobs[0]["done"] == 2 + 2 * 2 and not jobs[0]["active"]
        assert jobs[0]["counts_from"] == "redis"  # the embedded Redis stays up while we serve
        page = _get(url + f"jobs/{jobs[0]['job_id']}/episodes")
        assert page.count('href="/episodes/') == 6
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, proc.stdout.read()[-3000:]


# --- bounded work per page --------------------------------------------------------------------
@settings_hyp(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
@pytest.mark.unit
def test_the_seen_part_of_a_prompt_is_the_longest_context_tail_that_starts_it(context, body):
    as_msgs = lambda xs: [{"role": "user", "content": str(x)} for x in xs]  # noqa: E731
    brute = next((n for n in range(min(len(context), len(body)), 0, -1) if context[-n:] == body[:n]), 0)
    assert transcript._overlap(as_msgs(context), as_msgs(body)) == brute


@pytest.mark.unit
def test_the_seen_part_of_a_prompt_ignores_key_order():
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = [{"content": "y", "role": "assistant"}, {"role": "user", "content": "z"}]
    assert transcript._overlap(a, b) == 1


@pytest.mark.unit
def test_api_jobs_refuses_unbounded_job_lists(db):
    c = client_for(db)
    assert c.get("/api/jobs?" + "&".join(f"job=j{i}" for i in range(101))).status_code == 400
    assert c.get("/api/jobs?job=" + "x" * 201).status_code == 400
    assert c.get("/api/jobs?job=" + JOB).status_code == 200


@pytest.mark.unit
def test_what_the_server_remembers_per_job_is_bounded(db):
    from interactor.ui.source import MAX_REMEMBERED_JOBS

    m = RateMeter(window_s=10)
    for i in range(MAX_REMEMBERED_JOBS + 50):
        m.sample(f"j{i}", i, now=float(i))
    assert len(m._samples) == MAX_REMEMBERED_JOBS and "j0" not in m._samples and f"j{i}" in m._samples
    store = open_store(db)
    try:
        src = Source(store, store_shown=db)
        for i in range(MAX_REMEMBERED_JOBS + 50):
            src.progress([f"gone{i}"])  # finished (nothing running) jobs are remembered a while
        assert len(src._finished) <= MAX_REMEMBERED_JOBS
    finally:
        store.close()


@pytest.mark.integration
def test_dead_letter_pages_read_the_newest_letters_not_the_whole_queue(settings, redis_client):
    from broker.dlq import DeadLetterQueue
    from broker.records import DeadLetter

    keys = Keys(settings.key_prefix)
    pipe = redis_client.pipeline()
    for i in range(3000):
        job = "big" if i % 3 else "small"
        d = DeadLetter(job_id=job, episode_id=f"{job}.e{i}", group_id="g", env_name="x",
                       reason="env_bad_request" if i % 2 else "model_bad_request", dead_at=1000.0 + i)
        pipe.hset(keys.dlq, f"{job} {d.episode_id}", d.pack())
        pipe.zadd(keys.dlq_index, {f"{job} {d.episode_id}": d.dead_at})
    pipe.execute()
    dlq = DeadLetterQueue(redis_client, settings)

    letters, matched, complete = dlq.newest(limit=10)
    assert [d.dead_at for d in letters] == [1000.0 + i for i in range(2999, 2989, -1)]
    assert matched == 3000 and complete
    letters, matched, complete = dlq.newest(job_id="small", reason="model_bad_request", limit=5)
    assert matched == 500 and complete and len(letters) == 5
    assert all(d.job_id == "small" and d.reason == "model_bad_request" for d in letters)
    # a bounded read says it is bounded: a lower bound, never a wrong total
    letters, matched, complete = dlq.newest(limit=10, scan_limit=1000)
    assert not complete and matched == 1000 and len(letters) == 10
