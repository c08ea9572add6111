"""Before anything is enqueued, `run` and `submit` ask each server once (interactor/preflight.py):
a wrong port, a server that is not up, an env_name a server does not have or a model a server
does not serve is one clear line, not minutes of ``0.0 steps/s``. Real servers on loopback."""

from __future__ import annotations

import json
import socket
import time
from http.server import BaseHTTPRequestHandler

import pytest

from broker.records import EpisodeSpec
from envs.http import JSONHandler, QuietHTTPServer
from interactor import preflight


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def episode(base_url: str, env_name: str = "guess_number", transport: str = "http", env_class: str = "") -> EpisodeSpec:
    return EpisodeSpec(job_id="j", episode_id="j.e0", group_id="g", group_size=1, env_params={},
                       env_name=env_name, base_url=base_url,
                       transport=transport, env_class=env_class)


class _StrictModelHandler(JSONHandler):
    """vLLM's answers: /models lists the served name; any other name is a 404."""

    def do_GET(self):
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "served-model", "object": "model"}]})
        return self.send_json(404, {"error": "no route"})

    def do_POST(self):
        self.read_body()
        self.server.posts += 1
        self.send_json(404, {"object": "error", "message": "The model `wrong-name` does not exist.",
                             "type": "NotFoundError", "param": None, "code": 404})


class _AnyNameHandler(JSONHandler):
    """llama.cpp's llama-server: /models lists its model file; every name is served."""

    def do_GET(self):
        return self.send_json(200, {"object": "list", "data": [{"id": "SmolLM2-135M.gguf", "object": "model"}]})

    def do_POST(self):
        self.read_body()
        self.server.posts += 1
        self.send_json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                          "finish_reason": "length"}]})


class _PostOnlyHandler(BaseHTTPRequestHandler):
    """A model server written on Python's http.server with no do_GET: http.server answers 501
    to GET by itself."""

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts += 1
        body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _GetNotAllowedHandler(JSONHandler):
    """A gateway that routes POST only: 405 to GET."""

    def do_GET(self):
        self.send_json(405, {"error": "method not allowed"})


@pytest.fixture
def serve():
    started = []

    def start(handler):
        srv = QuietHTTPServer(("127.0.0.1", 0), handler)
        srv.posts = 0
        started.append(srv)
        return srv.serve_in_thread("preflight-test")

    yield start
    for srv in started:
        srv.shutdown()


def test_servers_that_answer_pass(settings, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1", model="anything")
    assert preflight.check(s, [episode(env_url)]) == []


def test_a_wrong_port_is_named_for_the_model_and_for_each_env_server(settings, env_server):
    _, env_url = env_server
    bad_env = f"http://127.0.0.1:{closed_port()}"
    s = settings.replace(llm_base_url=f"http://127.0.0.1:{closed_port()}/v1")
    problems = preflight.check(s, [episode(env_url), episode(bad_env), episode(bad_env, "other")])
    assert [(p.kind, p.what) for p in problems] == [("model", "unreachable: connection refused"),
                                                     ("env", "unreachable: connection refused")]
    assert problems[1].url == bad_env
    text = preflight.refusal(problems)
    assert text.startswith("nothing was enqueued:") and "--no-preflight" in text and bad_env in text


def test_an_env_name_the_server_does_not_list_is_named(settings, env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1")
    (p,) = preflight.check(s, [episode(env_url), episode(env_url, "no_such_env")])
    assert p.kind == "env" and "'no_such_env'" in p.what and "guess_number" in p.what


def test_inproc_episodes_ask_no_env_server(settings, model_server):
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1")
    assert preflight.check(s, [episode("", transport="inproc", env_class="envs.bundled:GuessNumber")]) == []


def test_an_inproc_class_the_workers_would_refuse_is_named_before_anything_is_enqueued(settings, model_server):
    """docs/environments.md's example dead-lettered all 12 episodes as bad_task: its class was
    not on the allow-list, and nothing said so until the results were read."""
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1", env_classes="envs.*")
    (p,) = preflight.check(s, [episode("", transport="inproc", env_class="wordguess:WordGuess")])
    assert p.kind == "env_class" and "wordguess:WordGuess" in str(p) and "INTERACTOR_ENV_CLASSES" in p.what
    assert preflight.check(s.replace(env_classes="envs.*,wordguess:*"),
                           [episode("", transport="inproc", env_class="wordguess:WordGuess")]) == []


def test_a_model_the_server_does_not_serve_is_named(settings, serve):
    srv, url = serve(_StrictModelHandler)
    (p,) = preflight.check(settings.replace(llm_base_url=url + "/v1", model="wrong-name"), [])
    assert p.kind == "model" and "has no model 'wrong-name'" in p.what and "served-model" in p.what
    assert "does not exist" in p.what
    assert preflight.check(settings.replace(llm_base_url=url + "/v1", model="served-model"), []) == []
    assert srv.posts == 1  # a listed name costs no request


def test_a_server_that_takes_any_model_name_is_not_refused(settings, serve):
    srv, url = serve(_AnyNameHandler)
    assert preflight.check(settings.replace(llm_base_url=url + "/v1", model="default"), []) == []
    assert srv.posts == 1


@pytest.mark.parametrize("handler,status", [(_PostOnlyHandler, 501), (_GetNotAllowedHandler, 405)])
def test_a_model_server_without_a_get_models_route_passes_and_a_dead_port_does_not(settings, env_server, serve,
                                                                                    handler, status):
    """A server that answers GET /models with "no such route" is up: `run` refused it with
    "answers HTTP 501 to GET /models". The one line says what was asked and how it answered."""
    _, env_url = env_server
    srv, url = serve(handler)
    s = settings.replace(llm_base_url=url + "/v1", model="any")
    assert preflight.check(s, [episode(env_url)]) == []
    out = preflight.ask(s, [episode(env_url)])
    assert out.summary() == (f"preflight: model server {url}/v1 answers (GET /models: {status}, no such route), "
                             f"env server {env_url} answers (GET /envs)")
    assert srv.posts == 0  # nothing listed, nothing more asked
    started = time.monotonic()
    dead = preflight.ask(settings.replace(llm_base_url=f"http://127.0.0.1:{closed_port()}/v1"), [episode(env_url)])
    assert [(p.kind, p.what) for p in dead.problems] == [("model", "unreachable: connection refused")]
    assert time.monotonic() - started < preflight.PROBE_TIMEOUT_S  # refused at once, not timed out


@pytest.mark.unit
def test_the_summary_names_a_few_env_servers_and_counts_the_rest():
    out = preflight.Outcome(model_url="http://m/v1", model_answer="GET /models: 200",
                            env_urls=[f"http://e{i}" for i in range(5)])
    assert out.summary() == ("preflight: model server http://m/v1 answers (GET /models: 200), env servers "
                             "http://e0, http://e1, http://e2 and 2 more answer (GET /envs)")
    assert preflight.Outcome(model_url="http://m/v1", model_answer="GET /models: 200").summary() == \
        "preflight: model server http://m/v1 answers (GET /models: 200)"


def test_a_server_that_is_up_but_unavailable_is_named(settings, serve):
    from examples.model_standin import start_in_thread

    srv, url = start_in_thread()
    srv.unavailable = True
    try:
        (p,) = preflight.check(settings.replace(llm_base_url=url + "/v1"), [])
        assert p.kind == "model" and "HTTP 503" in p.what
    finally:
        srv.shutdown()


# --- the command line -------------------------------------------------------------------------
def _cli(settings, *args, timeout=120):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
def test_submit_to_a_wrong_port_enqueues_nothing_and_says_why(settings, redis_client, env_server, model_server,
                                                              tmp_path):
    _, env_url = env_server
    _, model_url = model_server
    wrong = f"http://127.0.0.1:{closed_port()}"
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {wrong}\n    env_num: 2\n")
    out = _cli(settings, "submit", str(tasks), "--llm-base-url", model_url + "/v1")
    assert out.returncode == 2, out.stderr
    assert f"env server {wrong}: unreachable: connection refused" in out.stderr and "Traceback" not in out.stderr
    assert redis_client.llen(settings.queue) == 0 and not redis_client.keys(settings.key_prefix + ":*")
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n    env_num: 2\n")
    out = _cli(settings, "submit", str(tasks), "--llm-base-url", model_url + "/v1")
    assert out.returncode == 0, out.stderr
    assert redis_client.llen(settings.queue) == 2
    assert f"preflight: model server {model_url}/v1 answers (GET /models: 200), env server {env_url} answers" \
        in out.stderr  # and stdout is the job's JSON alone
    assert json.loads(out.stdout)["episodes"] == 2
    # servers that start later: the check is skipped on request
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {wrong}\n    env_num: 1\n")
    out = _cli(settings, "submit", str(tasks), "--no-preflight", "--llm-base-url", model_url + "/v1")
    assert out.returncode == 0, out.stderr
    assert redis_client.llen(settings.queue) == 3


@pytest.mark.parametrize("command", [["status"], ["dlq", "list"], ["reconcile", "somejob"]])
def test_unreachable_redis_is_one_line_not_a_traceback(settings, command):
    s = settings.replace(redis_url=f"redis://:pw-secret@127.0.0.1:{closed_port()}/0")
    out = _cli(s, *command)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
    assert "Traceback" not in out.stderr and "pw-secret" not in out.stderr
    assert lines[-1].startswith("interactor: Redis at redis://:***@127.0.0.1:") and "unreachable" in lines[-1]


@pytest.mark.integration
def test_run_to_a_wrong_port_stops_before_starting_anything(settings, env_server, tmp_path):
    _, env_url = env_server
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n    env_num: 2\n")
    s = settings.replace(redis_url="", run_dir=str(tmp_path / "run"))
    wrong = f"http://127.0.0.1:{closed_port()}/v1"
    out = _cli(s, "run", str(tasks), "--llm-base-url", wrong)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"model server {wrong}: unreachable: connection refused" in out.stderr
    assert "embedded Redis" not in out.stdout and not (tmp_path / "run" / "redis").exists()


def test_open_breakers_are_named_when_they_open_while_open_and_when_they_close(settings, redis_client):
    from broker.keys import Keys
    from broker.records import BreakerState
    from interactor.localrun import BreakerNotes
    from interactor.fleet_reader import FleetReader

    keys = Keys(settings.key_prefix)
    state = BreakerState(kind="model", server="http://127.0.0.1:9/v1", worker="w1@h", since=time.time() - 45,
                         error="connection refused")
    redis_client.hset(keys.breakers, state.hash_field(), state.pack())
    notes = BreakerNotes(FleetReader(redis_client, settings), every_s=0, repeat_s=30)
    (said,) = notes.news(100.0)
    assert said.startswith("model server http://127.0.0.1:9/v1 down 4") and "connection refused" in said
    assert "wait up to" in said
    assert notes.news(110.0) == []  # not every poll
    assert len(notes.news(131.0)) == 1  # but again while it stays open
    redis_client.hdel(keys.breakers, state.hash_field())
    assert notes.news(132.0) == ["model server http://127.0.0.1:9/v1 answers again"]
    assert notes.news(133.0) == []


@pytest.mark.integration
def test_a_run_whose_model_is_down_says_so_while_it_waits(settings, env_server, tmp_path):
    _, env_url = env_server
    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n    env_num: 2\n")
    s = settings.replace(redis_url="", run_dir=str(tmp_path / "run"), max_attempts=1)
    wrong = f"http://127.0.0.1:{closed_port()}/v1"
    out = _cli(s, "run", str(tasks), "--no-preflight", "--llm-base-url", wrong, "--workers", "1", timeout=240)
    # the episodes end dead-lettered after the (test's short) outage budget; meanwhile the
    # progress output named the server and why
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"model server {wrong} down" in out.stdout and "connection refused" in out.stdout, out.stdout[-3000:]


# --------------------------------------------------------------------- serve-env, as documented

def _documented_entry(heading: str, env_url: str) -> str:
    """docs/environments.md's task entry under ``heading``, with ``base_url`` of serve-env in
    place of ``env_class``, as its comment says."""
    import re

    from tests.conftest import ROOT

    text = (ROOT / "docs" / "environments.md").read_text()
    section = text.split(heading, 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    assert "env_class:" in block, block
    return re.sub(r"env_class: .*", f"base_url: {env_url}", block)


def test_serve_env_passes_preflight_for_the_documented_task_names(settings, model_server, tmp_path):
    """`env_name: reasoning_gym.leg_counting` against `serve-env` was refused ("does not serve
    env_name"): GET /envs lists families, serve-env routes on the part before the dot. The
    documented task file runs as documented, through preflight, with a real serve-env process
    and real workers; a name of no family it lists is still refused, naming the rule."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (pip install -e '.[reasoning-gym]')")
    pytest.importorskip("textarena", reason="textarena not installed (pip install -e '.[textarena]')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    server = subprocess.Popen([sys.executable, "-m", "interactor.cli", "serve-env", "--port", "0",
                               "--envs", "reasoning_gym,textarena"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=str(ROOT), env=env)
    try:
        lines = [server.stdout.readline() for _ in range(2)]
        assert "listening on" in lines[1], lines
        env_url = lines[1].split("listening on", 1)[1].strip()
        _, model_url = model_server
        entries = [_documented_entry("### reasoning-gym", env_url), _documented_entry("### textarena", env_url)]
        # Fewer rows, fewer turns, smaller groups: the same names and routes, in less time.
        entries = [e.replace("env_num: 8", "env_num: 2").replace("env_num: 4", "env_num: 2")
                    .replace("max_turns: 8", "max_turns: 2") for e in entries]
        tasks = tmp_path / "served.yaml"
        tasks.write_text("environments:\n" + "".join(entries))
        out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url",
                              model_url + "/v1", "--model", "stand-in", "--run-dir", str(tmp_path / "run"),
                              "--concurrency", "4", "--workers", "1"],
                             env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"env server {env_url} answers (GET /envs)" in out.stdout
        assert "reasoning_gym.leg_counting" in out.stdout and "textarena.GuessTheNumber-v0" in out.stdout
        done = out.stdout.rsplit("done=", 1)[1].split()[0]
        assert done == str(3 * 2 + 3 * 2), out.stdout[-3000:]

        (p,) = preflight.check(settings.replace(llm_base_url=model_url + "/v1"),
                               [episode(env_url, "reasoning_gym.leg_counting"), episode(env_url, "wordle.easy")])
        assert p.what.startswith("does not serve env_name 'wordle.easy': GET /envs lists reasoning_gym, textarena")
        assert "part before its first dot" in p.what and "docs/protocol.md" in p.what
    finally:
        server.terminate()
        server.wait(10)


def _envs_handler(body: bytes):
    class _EnvsHandler(JSONHandler):
        """An env server whose GET /envs answers ``body``."""

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return _EnvsHandler


@pytest.mark.parametrize("body,served", [
    (b'["reasoning_gym", "textarena"]', True),
    (b'{"envs": ["reasoning_gym", "textarena"]}', True),
    (b'{"env_names": ["reasoning_gym", "textarena"]}', True),
    (b'{}', None), (b'[]', None), (b'"ok"', None), (b'up', None), (b'', None)])
def test_get_envs_is_read_as_docs_protocol_md_says(settings, model_server, serve, body, served):
    """docs/protocol.md#what-get-envs-answers: a list of env_names or families (as such, or under
    "envs"/"env_names"); any other body says nothing about names. Its example refusal is the
    one preflight prints."""
    from tests.conftest import ROOT

    _, model_url = model_server
    _, url = serve(_envs_handler(body))
    s = settings.replace(llm_base_url=model_url + "/v1")
    assert preflight.check(s, [episode(url, "reasoning_gym.leg_counting"), episode(url, "textarena")]) == []
    problems = preflight.check(s, [episode(url, "wordle.easy")])
    if served is None:
        assert problems == []
        return
    (p,) = problems
    doc = " ".join((ROOT / "docs" / "protocol.md").read_text().split())
    assert "### What `GET /envs` answers" in (ROOT / "docs" / "protocol.md").read_text()
    assert f"`{p.what.split(' (docs/', 1)[0]}`" in doc, p.what


def test_a_forgotten_model_against_a_real_server_is_refused_naming_what_it_serves(settings, env_server, serve,
                                                                                  model_server, tmp_path):
    """`--model` left at its default (`stand-in`) against llama-server passed preflight (it serves
    any name) and labelled the real model's results `stand-in`. Now `run` refuses in one line
    naming the models GET /v1/models lists; the bundled stand-in lists `stand-in` and needs no
    --model; an explicit --model is served as before."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    _, env_url = env_server
    srv, url = serve(_AnyNameHandler)
    default = settings.replace(model=preflight.DEFAULT_MODEL)
    (p,) = preflight.check(default.replace(llm_base_url=url + "/v1"), [episode(env_url)])
    assert p.kind == "model" and "SmolLM2-135M.gguf" in p.what and "--model" in p.what and "\n" not in p.what
    assert srv.posts == 0  # refused on what it lists, no request spent
    assert preflight.check(default.replace(llm_base_url=url + "/v1", model="SmolLM2-135M.gguf"),
                           [episode(env_url)]) == []
    _, standin_url = model_server
    assert preflight.check(default.replace(llm_base_url=standin_url + "/v1"), [episode(env_url)]) == []

    tasks = tmp_path / "t.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n    env_num: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url", url + "/v1",
                          "--run-dir", str(tmp_path / "run")], env=env, cwd=str(ROOT), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    first = out.stderr.splitlines()[0]
    assert first.startswith(f"interactor: nothing was enqueued: model server {url}/v1: serves SmolLM2-135M.gguf, and "
                            "no --model was given"), out.stderr
    assert "--model SmolLM2-135M.gguf" in first
