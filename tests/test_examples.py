"""The bundled stand-in servers (examples/), over real loopback HTTP; and what of the learning
demo (examples/learn/) needs neither torch nor a model: the run folder it empties, the
llama-server it starts, the signals that stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from examples import envserver, model_standin
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env():
    server, url = envserver.start_in_thread()
    yield server, url
    server.shutdown()


@pytest.fixture
def model():
    server, url = model_standin.start_in_thread()
    yield server, url
    server.shutdown()


@pytest.fixture
def http():
    with requests.Session() as s:
        yield s


def reset(http, url, name, env_id, env_param=None, seed=None):
    return http.post(f"{url}/{name}/{env_id}/reset",
                     json={"env_param": env_param or {}, "seed": seed}, timeout=5)


def chat(http, url, messages, path="/v1/chat/completions", **extra):
    body = {"model": "m", "messages": messages, "temperature": 1.0, **extra}
    return http.post(url + path, json=body, timeout=5)


# --------------------------------------------------------------------- envserver


def test_readiness_and_stats(env, http):
    _, url = env
    r = http.get(f"{url}/envs", timeout=5)
    assert r.status_code == 200
    assert set(r.json()) == {"guess_number", "arithmetic", "antonym"}
    stats = http.get(f"{url}/stats", timeout=5).json()
    for key in ("resets", "steps", "prompts", "closes", "live", "closed_ids", "steps_by_env"):
        assert key in stats


def test_guess_number_flow_and_non_idempotent_prompt(env, http):
    _, url = env
    r = reset(http, url, "guess_number", "g1", {"low": 1, "high": 10, "max_turns": 3}, seed=5)
    assert r.status_code == 200
    assert set(r.json()) == {"observation", "info"}

    p1 = http.get(f"{url}/guess_number/g1/get_task_prompt", timeout=5).json()
    assert [m["role"] for m in p1] == ["system", "user"]
    assert "between 1 and 10" in p1[0]["content"]
    # Not idempotent: a second ask without a step appends a nudge.
    p2 = http.get(f"{url}/guess_number/g1/get_task_prompt", timeout=5).json()
    assert len(p2) == 3 and p2[:2] == p1
    assert p2[2]["role"] == "user" and p2[2]["content"].startswith("You have not answered yet")

    s = http.post(f"{url}/guess_number/g1/step", json={"action": "hmm"}, timeout=5).json()
    assert set(s) == {"observation", "reward", "terminated", "truncated", "info"}
    assert s["reward"] == 0.0 and not s["terminated"] and not s["truncated"]
    assert s["info"]["result"] == "not a number"
    p3 = http.get(f"{url}/guess_number/g1/get_task_prompt", timeout=5).json()
    assert p3[:3] == p2
    assert p3[3] == {"role": "assistant", "content": "hmm"}
    assert p3[4]["role"] == "user" and "not a number" in p3[4]["content"]

    # Run out of turns with wrong guesses -> truncated, prompt becomes [].
    for guess in ("0", "11"):  # outside the range: always wrong
        s = http.post(f"{url}/guess_number/g1/step", json={"action": guess}, timeout=5).json()
    assert s["truncated"] is True and s["terminated"] is False
    target = s["info"]["target"]
    assert 1 <= target <= 10
    assert http.get(f"{url}/guess_number/g1/get_task_prompt", timeout=5).json() == []
    assert http.post(f"{url}/guess_number/g1/step", json={"action": "1"}, timeout=5).status_code == 400

    # Same seed -> same target; re-reset of an existing id resets it.
    reset(http, url, "guess_number", "g1", {"low": 1, "high": 10, "max_turns": 3}, seed=5)
    s = http.post(f"{url}/guess_number/g1/step", json={"action": f"I say {target}"}, timeout=5).json()
    assert s["reward"] == 1.0 and s["terminated"] is True and s["truncated"] is False
    assert http.get(f"{url}/guess_number/g1/get_task_prompt", timeout=5).json() == []

    r = http.delete(f"{url}/guess_number/g1", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    stats = http.get(f"{url}/stats", timeout=5).json()
    assert stats["resets"] == 2 and stats["steps"] == 4 and stats["prompts"] == 5
    assert stats["steps_by_env"] == {"g1": 4}
    assert stats["live"] == 0 and stats["closes"] == 1 and stats["closed_ids"] == 1


def test_guess_number_reads_dataset_row(env, http):
    _, url = env
    r = reset(http, url, "guess_number", "d1",
              {"max_turns": 4, "dataset": {"low": 7, "high": 7}}, seed=None)
    assert r.status_code == 200
    assert "between 7 and 7" in http.get(f"{url}/guess_number/d1/get_task_prompt").json()[0]["content"]
    s = http.post(f"{url}/guess_number/d1/step", json={"action": "7"}).json()
    assert s["reward"] == 1.0 and s["terminated"]


def test_arithmetic_flow(env, http):
    _, url = env
    row = {"question": "What is 17 + 25?", "answer": 42}
    assert reset(http, url, "arithmetic", "a1", {"dataset": row}).status_code == 200
    prompt = http.get(f"{url}/arithmetic/a1/get_task_prompt").json()
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[1]["content"] == row["question"]
    s = http.post(f"{url}/arithmetic/a1/step", json={"action": "17 + 25 = 42"}).json()
    assert s["reward"] == 1.0 and s["terminated"] is True and s["truncated"] is False
    assert http.get(f"{url}/arithmetic/a1/get_task_prompt").json() == []

    reset(http, url, "arithmetic", "a2", {"dataset": {"question": "What is 2 * 3?", "answer": "6"}})
    s = http.post(f"{url}/arithmetic/a2/step", json={"action": "It is 7"}).json()
    assert s["reward"] == 0.0 and s["terminated"] is True

    # The old servers' close spelling.
    r = http.post(f"{url}/arithmetic/a2/close")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert http.get(f"{url}/stats").json()["live"] == 1


def test_errors_404_400(env, http):
    _, url = env
    r = reset(http, url, "nope", "x1")
    assert r.status_code == 400 and "nope" in r.json()["error"]
    r = reset(http, url, "arithmetic", "x2", {})
    assert r.status_code == 400 and "dataset" in r.json()["error"]
    r = reset(http, url, "arithmetic", "x2", {"dataset": {"question": "What is 1 + 1?"}})
    assert r.status_code == 400 and "dataset.answer" in r.json()["error"]
    r = reset(http, url, "guess_number", "x3", {"low": 10, "high": 1})
    assert r.status_code == 400 and "low" in r.json()["error"]
    r = reset(http, url, "guess_number", "x3", {"max_turns": "many"})
    assert r.status_code == 400 and "max_turns" in r.json()["error"]
    r = http.post(f"{url}/guess_number/x3/reset", data=b"{not json",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400

    assert http.get(f"{url}/guess_number/unknown/get_task_prompt").status_code == 404
    assert http.post(f"{url}/guess_number/unknown/step", json={"action": "1"}).status_code == 404
    assert "error" in http.get(f"{url}/guess_number/unknown/get_task_prompt").json()

    reset(http, url, "guess_number", "x4")
    assert http.post(f"{url}/guess_number/x4/step", json={}).status_code == 400
    assert http.post(f"{url}/guess_number/x4/step", json={"action": 5}).status_code == 400

    r = http.delete(f"{url}/guess_number/never-existed")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    stats = http.get(f"{url}/stats").json()
    assert stats["closes"] == 1 and stats["closed_ids"] == 0 and stats["live"] == 1


def test_env_fault_knobs():
    server, url = envserver.start_in_thread(error_rate=1.0)
    try:
        with requests.Session() as http:
            r = reset(http, url, "guess_number", "f1")
            assert r.status_code == 500
            assert http.get(f"{url}/envs").status_code == 200  # readiness is never faulted
            server.error_rate, server.garbage_rate = 0.0, 1.0
            r = reset(http, url, "guess_number", "f1")
            assert r.status_code == 200
            with pytest.raises(ValueError):
                r.json()
            server.garbage_rate, server.drop_rate = 0.0, 1.0
            with pytest.raises(requests.ConnectionError):
                reset(http, url, "guess_number", "f1")
            server.drop_rate = 0.0
            # Faults are decided before anything is applied.
            assert http.get(f"{url}/guess_number/f1/get_task_prompt").status_code == 404
            stats = http.get(f"{url}/stats").json()
            assert stats["resets"] == 0
            assert stats["faults"] == {"error": 1, "drop": 1, "garbage": 1}
    finally:
        server.shutdown()


def test_env_faults_are_reproducible():
    def pattern():
        server, url = envserver.start_in_thread(error_rate=0.5, fault_seed=3)
        try:
            with requests.Session() as http:
                return [reset(http, url, "guess_number", f"r{i}").status_code for i in range(20)]
        finally:
            server.shutdown()

    first = pattern()
    assert first == pattern()
    assert 500 in first and 200 in first


def test_envserver_subprocess():
    proc = subprocess.Popen([sys.executable, "-m", "examples.envserver", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split("listening on ", 1)[1]
        assert requests.get(f"{url}/envs", timeout=5).json() == envserver.ENV_NAMES
        proc.terminate()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_cuts_keepalive_connections(http):
    server, url = envserver.start_in_thread()
    assert http.get(f"{url}/envs").status_code == 200  # pooled keep-alive connection
    server.shutdown()
    with pytest.raises(requests.ConnectionError):
        http.get(f"{url}/envs", timeout=2)


# ----------------------------------------------------------------- model stand-in


def test_chat_completion_shape(model, http):
    _, url = model
    r = chat(http, url, [{"role": "user", "content": "Tell me a joke"}])
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "I don't know"}
    assert out["metadata"] == {"weight_version": "v1"}
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    models = http.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "stand-in"  # --model's default: a run against it needs no --model


def test_model_solves_guess_number_by_binary_search(env, model, http):
    _, env_url = env
    _, llm_url = model
    for i, seed in enumerate((1, 2, 3, 4, 5)):
        env_id = f"bs{i}"
        assert reset(http, env_url, "guess_number", env_id,
                     {"low": 1, "high": 100, "max_turns": 7}, seed=seed).status_code == 200
        total, turns = 0.0, 0
        while True:
            prompt = http.get(f"{env_url}/guess_number/{env_id}/get_task_prompt").json()
            if not prompt:
                break
            # Trim like the driver (system + last 5): the reply restates the range.
            prompt = prompt[:1] + prompt[1:][-5:]
            reply = chat(http, llm_url, prompt, path=f"/v1/{env_id}/chat/completions").json()
            action = reply["choices"][0]["message"]["content"]
            s = http.post(f"{env_url}/guess_number/{env_id}/step", json={"action": action}).json()
            total += s["reward"]
            turns += 1
            if s["terminated"] or s["truncated"]:
                break
        assert total == 1.0 and turns <= 7, (seed, turns)
    stats = http.get(f"{llm_url}/stats").json()
    assert sum(stats["by_session"].values()) == stats["requests"]
    assert set(stats["by_session"]) == {f"bs{i}" for i in range(5)}


def test_model_arithmetic_and_list_content(model, http):
    server, url = model
    msgs = [{"role": "system", "content": "calc"},
            {"role": "user", "content": [{"type": "text", "text": "What is (3 + 4) * 6?"},
                                         {"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    answers = [chat(http, url, msgs).json()["choices"][0]["message"]["content"] for _ in range(40)]
    numbers = [int(a.rsplit(" ", 1)[1]) for a in answers]
    assert set(numbers) <= {41, 42, 43}
    assert 15 <= numbers.count(42) <= 39  # skill 0.7: identical requests differ
    server.skill = 1.0
    r = chat(http, url, [{"role": "user", "content": "What is 17 - 25?"}])
    assert r.json()["choices"][0]["message"]["content"].endswith(" -8")


def test_model_knobs_length_errors_session_auth():
    server, url = model_standin.start_in_thread(length_rate=1.0, weight_version="")
    try:
        with requests.Session() as http:
            out = chat(http, url, [{"role": "user", "content": "What is 1 + 1?"}]).json()
            assert out["choices"][0]["finish_reason"] == "length"
            assert "metadata" not in out

            server.length_rate, server.error_rate = 0.0, 1.0
            statuses = [chat(http, url, [{"role": "user", "content": "hi"}]).status_code
                        for _ in range(6)]
            assert statuses == [429, 500, 503, 429, 500, 503]

            server.error_rate, server.malformed_rate = 0.0, 1.0
            out = chat(http, url, [{"role": "user", "content": "hi"}])
            assert out.status_code == 200 and "choices" not in out.json()

            server.malformed_rate, server.drop_rate = 0.0, 1.0
            with pytest.raises(requests.ConnectionError):
                chat(http, url, [{"role": "user", "content": "hi"}])
            server.drop_rate = 0.0

            r = http.post(f"{url}/v1/sess-42/chat/completions",
                          headers={"Authorization": "Bearer sekret"},
                          json={"model": "m", "messages": [{"role": "user", "content": None}]})
            assert r.status_code == 200
            assert chat(http, url, "not a list").status_code == 400

            stats = http.get(f"{url}/stats").json()
            assert "sekret" not in json.dumps(stats)
            assert stats["auth_headers_seen"] == 1
            assert stats["by_session"] == {"sess-42": 1}
            assert stats["by_status"] == {"200": 3, "429": 2, "500": 2, "503": 2, "400": 1,
                                          "dropped": 1}
            assert stats["requests"] == 11
            assert stats["by_finish_reason"] == {"length": 1, "stop": 1}
    finally:
        server.shutdown()


@pytest.mark.parametrize("style,server_name", [("vllm", "vLLM"), ("sglang", "SGLang"),
                                               ("llama.cpp", "llama.cpp"), ("openai", "OpenAI")])
def test_model_context_tokens_refuse_long_prompts_in_real_servers_words(style, server_name):
    from workers.modelclient import context_overflow

    server, url = model_standin.start_in_thread(context_tokens=20, overflow_style=style)
    try:
        with requests.Session() as http:
            short = [{"role": "user", "content": "What is 1 + 1?"}]  # 5 tokens
            assert chat(http, url, short, max_tokens=10).status_code == 200
            long = [{"role": "user", "content": "word " * 25}]
            r = chat(http, url, long, max_tokens=10)
            assert r.status_code == 400 and context_overflow(r.content) == server_name
            # Prompt plus max_tokens past the window: refused too, but not by llama.cpp, which
            # checks the prompt alone and stops the answer at the window's end.
            r = chat(http, url, [{"role": "user", "content": "word " * 15}], max_tokens=10)
            assert r.status_code == (200 if style == "llama.cpp" else 400)
            assert http.get(f"{url}/stats").json()["context_overflows"] == (1 if style == "llama.cpp" else 2)
    finally:
        server.shutdown()
    with pytest.raises(ValueError):
        model_standin.ModelStandin(overflow_style="tgi")


def test_model_latency_knob():
    server, url = model_standin.start_in_thread(latency_ms=100)
    try:
        t0 = time.monotonic()
        requests.post(f"{url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}]}, timeout=5)
        assert time.monotonic() - t0 >= 0.1
    finally:
        server.shutdown()


# ----------------------------------------------------------------- the learning demo


def test_the_learning_demo_refuses_a_run_folder_it_did_not_make(tmp_path):
    """A run empties its folder first. ``--run-dir`` naming a folder with another run's files
    (``runs``, a checkout, a home directory) is refused in one line naming the folder, before
    torch is imported and before anything is removed; a folder the demo made (its mark in it) is
    emptied for the next run, a missing or an empty one taken."""
    runs = tmp_path / "runs"
    precious = runs / "other-job" / "results.sqlite"
    precious.parent.mkdir(parents=True)
    precious.write_text("another run's results")
    env = {**os.environ, "LLAMA_SERVER": str(tmp_path / "no-llama-server"),
           "SMOLLM2_GGUF": str(tmp_path / "no-model.gguf")}
    done = subprocess.run([sys.executable, "-m", "examples.learn.demo", "--run-dir", str(runs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(said) == 1 and f"--run-dir {runs}: refused" in said[0], done.stderr
    assert precious.read_text() == "another run's results"

    from examples.learn.demo import RUN_DIR_MARK, RunDirRefused, claim_run_dir

    with pytest.raises(RunDirRefused) as refused:
        claim_run_dir(runs)
    assert str(runs) in str(refused.value) and precious.read_text() == "another run's results"
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(RunDirRefused):
        claim_run_dir(tmp_path / "a-file")

    made = tmp_path / "new" / "learn"
    claim_run_dir(made)
    assert [p.name for p in made.iterdir()] == [RUN_DIR_MARK]
    (made / "weights").mkdir()
    (made / "weights" / "v1.gguf").write_bytes(b"weights")
    (made / "summary.json").write_text("{}")
    claim_run_dir(made)  # an earlier run's: emptied
    assert [p.name for p in made.iterdir()] == [RUN_DIR_MARK]
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_run_dir(empty)
    assert [p.name for p in empty.iterdir()] == [RUN_DIR_MARK]


# In llama-server's place: answers /health on the --port it is given, as the real one does once
# its model is loaded.
LLAMA_STANDIN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# The demo's use of LlamaServer, cut to what starts the server: load, say its pid, live on.
LLAMA_OWNER = """
import sys, time
from examples.learn.llama import LlamaServer
server = LlamaServer(sys.argv[1], sys.argv[2])
server.load(sys.argv[3], timeout_s=120)
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has stopped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.unit
def test_the_learning_demos_llama_server_stops_when_the_demo_is_killed(tmp_path):
    """llama-server runs in a session of its own (a terminal's Ctrl-C reaches only the demo): when
    the demo dies without running its own stopping (SIGKILL, the OOM killer; the demo trains a
    model on CPU), the server stops too, instead of keeping its model in memory and its port."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{LLAMA_STANDIN}")
    binary.chmod(0o755)
    owner = subprocess.Popen([sys.executable, "-c", LLAMA_OWNER, str(binary), str(tmp_path / "llama.log"),
                              str(tmp_path / "model.gguf")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), (line, owner.poll())
        server = int(line)
        assert _running(server)
        owner.kill()
        owner.wait(30)
        wait_for(lambda: not _running(server), 30, interval=0.1, what="llama-server stopped after the demo was killed")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
        if server is not None and _running(server):
            os.killpg(server, signal.SIGKILL)  # what the test leaves behind when it fails


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_the_learning_demo_stops_on_sighup_as_on_sigterm(tmp_path, sig):
    """A closed terminal (SIGHUP) stops the demo as ``kill`` (SIGTERM) and Ctrl-C do: through its
    own stopping, with exit code 128 + the signal. It is caught here while the demo imports
    torch: a module in torch's place that waits (the demo needs the learn extra to go further)."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import time\nprint('importing torch', flush=True)\ntime.sleep(300)\n")
    path = [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    demo = subprocess.Popen([sys.executable, "-m", "examples.learn.demo", "--run-dir", str(tmp_path / "run")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # as from a terminal
    try:
        assert demo.stdout.readline().strip() == "importing torch", demo.poll()
        demo.send_signal(sig)
        assert demo.wait(60) == 128 + sig
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(30)
