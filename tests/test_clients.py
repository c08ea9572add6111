"""EnvClient and ModelClient against real HTTP servers on loopback (no mocks of requests)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter, defaultdict, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_INSTANCE_LOST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EPISODE_TIMEOUT,
    MODEL_BAD_REQUEST,
    MODEL_MALFORMED,
    MODEL_UNAVAILABLE,
    ContextOverflow,
    EpisodeError,
)
from broker.settings import Secret, Settings
from workers.envclient import EnvClient
from workers.envport import StepResult
from workers.modelclient import Completion, ModelClient, context_overflow

ENV, EID = "demo", "ep-1"
P = f"/{ENV}/{EID}"
KEY = "sk-very-secret-key-123"
OK_COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
OK_STEP = {"observation": {}, "reward": 1.5, "terminated": False, "truncated": False, "info": {"k": 1}}


# ---------------------------------------------------------------------------------------------
# A scriptable HTTP server
# ---------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's pool is exercised
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls between header and body writes

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._handle()

    def do_POST(self):
        self._handle()

    def do_DELETE(self):
        self._handle()

    def _handle(self):
        fake: FakeServer = self.server.fake  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        key = (self.command, self.path)
        with fake.lock:
            fake.counts[key] += 1
            fake.requests.append({"key": key, "headers": dict(self.headers), "body": body, "peer": self.client_address})
            queue = fake.scripts.get(key)
            action = queue.popleft() if queue else fake.defaults.get(key, {"status": 404, "json": {"error": "unscripted"}})
        if action.get("sleep"):
            time.sleep(action["sleep"])
        if action.get("drop"):
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        status = action.get("status", 200)
        payload = action["raw"] if "raw" in action else json.dumps(action.get("json", {})).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for name, value in action.get("headers", {}).items():
                self.send_header(name, value)
            if action.get("no_length"):  # body delimited by closing the connection
                self.send_header("Connection", "close")
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the client gave up (read timeout): fine
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # no tracebacks from dropped clients
        pass


class FakeServer:
    def __init__(self, port: int = 0, defaults: dict | None = None):
        self.lock = threading.Lock()
        self.scripts: dict[tuple[str, str], deque] = defaultdict(deque)
        self.defaults: dict[tuple[str, str], dict] = dict(defaults or {})
        self.counts: Counter = Counter()
        self.requests: list[dict] = []
        self.httpd = _Server(("127.0.0.1", port), _Handler)
        self.httpd.fake = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def script(self, method: str, path: str, *actions: dict, default: dict | None = None) -> None:
        with self.lock:
            self.scripts[(method, path)].extend(actions)
            if default is not None:
                self.defaults[(method, path)] = default

    def count(self, method: str, path: str) -> int:
        return self.counts[(method, path)]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = FakeServer()
    yield srv
    srv.stop()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fast(**overrides) -> Settings:
    base = dict(
        env_backoff_initial_s=0.01, env_backoff_max_s=0.05, env_retries=3,
        env_connect_timeout_s=1.0, env_read_timeout_s=3.0,
        llm_backoff_initial_s=0.01, llm_backoff_max_s=0.05, llm_retries=4,
        llm_connect_timeout_s=1.0, llm_read_timeout_s=3.0,
        concurrency=2,
    )
    base.update(overrides)
    return Settings.from_env({}, **base)


def far() -> float:
    return time.monotonic() + 30


def retry_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "retrying" in r.getMessage()]


# ---------------------------------------------------------------------------------------------
# ModelClient
# ---------------------------------------------------------------------------------------------


def complete(client: ModelClient, server: FakeServer, *, deadline: float | None = None, api_key: str = "", **params):
    return client.complete(
        server.url + "/v1/", [{"role": "user", "content": "x"}], model="m", temperature=0.5,
        params=params, deadline=deadline or far(), api_key=api_key,
    )


def test_model_retries_429_and_5xx_then_succeeds(server):
    server.script(
        "POST", "/v1/chat/completions",
        {"status": 429, "json": {"error": "slow down"}},
        {"status": 500, "json": {"error": "boom"}},
        {"status": 503, "raw": b"unavailable"},
        {"status": 200, "json": OK_COMPLETION},
    )
    out = complete(ModelClient(fast()), server, max_tokens=7, stop=["\n"], extra_field=True)
    assert isinstance(out, Completion)
    assert (out.content, out.finish_reason, out.weight_version, out.attempts) == ("hi", "stop", None, 4)
    assert out.latency_s >= 0
    assert server.count("POST", "/v1/chat/completions") == 4
    sent = json.loads(server.requests[-1]["body"])
    assert sent == {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.5,
        "max_tokens": 7, "stop": ["\n"], "extra_field": True,
    }
    assert "Authorization" not in server.requests[-1]["headers"]  # no key, no header


def test_model_retries_exhausted_is_transient_unavailable(server):
    server.script("POST", "/v1/chat/completions", default={"status": 503, "json": {"error": "loading"}})
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast(llm_retries=2)), server)
    assert ei.value.reason == MODEL_UNAVAILABLE and ei.value.transient
    assert server.count("POST", "/v1/chat/completions") == 3


@pytest.mark.unit
def test_model_connection_refused_retried_then_unavailable(caplog):
    caplog.set_level(logging.WARNING)
    client = ModelClient(fast(llm_retries=2))
    with pytest.raises(EpisodeError) as ei:
        client.complete(f"http://127.0.0.1:{closed_port()}/v1", [], model="m", temperature=0, params={},
                        deadline=far(), api_key="")
    assert ei.value.reason == MODEL_UNAVAILABLE and ei.value.transient
    assert len(retry_logs(caplog)) == 2


def test_model_400_is_permanent_and_not_retried(server):
    server.script("POST", "/v1/chat/completions",
                  {"status": 400, "json": {"error": {"message": "bad parameter: " + "x" * 2000 + " (the end)"}}})
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast()), server)
    assert ei.value.reason == MODEL_BAD_REQUEST and not ei.value.transient
    # Long texts keep their head and their tail, where a traceback says why.
    assert "bad parameter" in str(ei.value) and "(the end)" in str(ei.value) and len(str(ei.value)) < 800
    assert server.count("POST", "/v1/chat/completions") == 1


# Each server's answer to a prompt longer than the model's context, as it sends it.
CONTEXT_OVERFLOW_ANSWERS = {
    "vLLM": {"object": "error", "message": "This model's maximum context length is 4096 tokens. However, you "
             "requested 5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the length of "
             "the messages or completion.", "type": "BadRequestError", "param": None, "code": 400},
    "vLLM (under error)": {"error": {"message": "This model's maximum context length is 4096 tokens. However, you "
                                     "requested 1000 output tokens and your prompt contains 4000 input tokens, for "
                                     "a total of 5000 tokens.", "type": "BadRequestError", "param": None,
                                     "code": 400}},
    "vLLM (engine)": {"object": "error", "message": "The decoder prompt (length 5000) is longer than the maximum "
                      "model length of 4096. Make sure that `max_model_len` is no smaller than the number of text "
                      "tokens.", "type": "BadRequestError", "code": 400},
    "SGLang": {"object": "error", "message": "The input (5000 tokens) is longer than the model's context length "
               "(4096 tokens).", "type": "BadRequestError", "param": None, "code": 400},
    "SGLang (with max_tokens)": {"object": "error", "message": "Requested token count exceeds the model's maximum "
                                 "context length of 4096 tokens. You requested a total of 5000 tokens: 4000 tokens "
                                 "from the input messages and 1000 tokens for the completion.",
                                 "type": "BadRequestError", "code": 400},
    "llama.cpp": {"error": {"code": 400, "message": "request (2057 tokens) exceeds the available context size "
                            "(2048 tokens), try increasing it", "type": "exceed_context_size_error",
                            "n_prompt_tokens": 2057, "n_ctx": 2048}},
    "llama.cpp (older)": {"error": {"code": 400, "message": "the request exceeds the available context size, try "
                                    "increasing it", "type": "invalid_request_error"}},
    "OpenAI": {"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages "
                         "resulted in 9000 tokens. Please reduce the length of the messages.",
                         "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}},
}


@pytest.mark.parametrize("wording", sorted(CONTEXT_OVERFLOW_ANSWERS))
def test_model_context_overflow_is_recognised_in_each_servers_words(server, wording):
    server.script("POST", "/v1/chat/completions", {"status": 400, "json": CONTEXT_OVERFLOW_ANSWERS[wording]})
    with pytest.raises(ContextOverflow) as ei:
        complete(ModelClient(fast()), server)
    assert ei.value.server == wording.split(" ")[0]
    # Still a permanent model_bad_request wherever it is not the step loop that catches it.
    assert ei.value.reason == MODEL_BAD_REQUEST and not ei.value.transient and ei.value.status == 400
    assert "longer than the model's context" in str(ei.value) and "HTTP 400" in str(ei.value)
    assert server.count("POST", "/v1/chat/completions") == 1  # the same prompt will not fit again


@pytest.mark.parametrize("body", [
    {"error": {"message": "Unrecognized request argument supplied: max_tokenz", "type": "invalid_request_error",
               "code": None}},
    {"object": "error", "message": "temperature must be non-negative, got -1.", "type": "BadRequestError",
     "code": 400},
    {"error": {"code": 400, "message": "the chat template is invalid", "type": "invalid_request_error"}},
])
def test_model_other_400s_stay_bad_requests(server, body):
    server.script("POST", "/v1/chat/completions", {"status": 400, "json": body})
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast()), server)
    assert type(ei.value) is EpisodeError and ei.value.reason == MODEL_BAD_REQUEST


def test_context_overflow_signs_in_plain_text_and_not_on_outage_statuses(server):
    assert context_overflow(b"request (9000 tokens) exceeds the available context size (8192 tokens)") == "llama.cpp"
    assert context_overflow(b'{"detail": "This model\'s maximum context length is 2048 tokens."}') == "vLLM"
    assert context_overflow(b'{"error": "context_length_exceeded"}') is None  # a code only counts as a code
    assert context_overflow(b"\xff\xfe not text") is None
    # A proxy's 503 page quoting the wording is an outage all the same: retried.
    server.script("POST", "/v1/chat/completions",
                  {"status": 503, "json": CONTEXT_OVERFLOW_ANSWERS["vLLM"]}, {"status": 200, "json": OK_COMPLETION})
    assert complete(ModelClient(fast()), server).content == "hi"


@pytest.mark.parametrize(
    "action",
    [
        {"raw": b"<html>not json</html>"},
        {"json": ["not", "an", "object"]},
        {"json": {"choices": []}},
        {"json": {"object": "chat.completion"}},
        {"json": {"choices": ["x"]}},
        {"json": {"choices": [{"finish_reason": "stop"}]}},
        {"json": {"choices": [{"message": {"content": 5}}]}},
        {"json": {"choices": [{"message": {"content": "a"}, "finish_reason": 3}]}},
        {"raw": b'{"choices": [{"message": {"content": "' + b"x" * 5000 + b'"}}]}', "limit": 4000},
        {"raw": b"[" * 100_000 + b"]" * 100_000},
    ],
    ids=["html", "list", "no-choices", "choices-absent", "choice-str", "no-message", "content-int",
         "finish-int", "too-large", "deep-nesting"],
)
def test_model_malformed(server, action):
    action = dict(action)
    limit = action.pop("limit", 10**7)
    server.script("POST", "/v1/chat/completions", {"status": 200, **action})
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast(max_response_bytes=limit)), server)
    assert ei.value.reason == MODEL_MALFORMED and not ei.value.transient
    assert server.count("POST", "/v1/chat/completions") == 1


def test_model_too_large_without_content_length(server):
    body = json.dumps({"choices": [{"message": {"content": "y" * 50_000}}]}).encode()
    server.script("POST", "/v1/chat/completions", {"raw": body, "no_length": True})
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast(max_response_bytes=10_000)), server)
    assert ei.value.reason == MODEL_MALFORMED


def test_model_null_content_absent_finish_reason_and_weight_version(server):
    server.script(
        "POST", "/v1/chat/completions",
        {"json": {"choices": [{"message": {"role": "assistant", "content": None}}], "metadata": {"weight_version": 7}}},
        {"json": {"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}],
                  "metadata": {"weight_version": "v12"}}},
        {"json": {"choices": [{"message": {"content": "ok"}, "finish_reason": None}], "metadata": {"other": 1}}},
    )
    client = ModelClient(fast())
    a, b, c = (complete(client, server) for _ in range(3))
    assert (a.content, a.finish_reason, a.weight_version) == ("", "stop", "7")
    assert (b.content, b.finish_reason, b.weight_version) == ("ok", "length", "v12")
    assert (c.finish_reason, c.weight_version) == ("stop", None)
    # one pooled keep-alive connection served all three
    assert len({r["peer"] for r in server.requests}) == 1


def test_model_retry_after_is_honoured_and_capped(server):
    server.script("POST", "/v1/chat/completions",
                  {"status": 429, "headers": {"Retry-After": "0.4"}}, {"json": OK_COMPLETION})
    started = time.monotonic()
    complete(ModelClient(fast(llm_backoff_max_s=2.0)), server)
    assert 0.35 <= time.monotonic() - started < 1.5

    server.script("POST", "/v1/chat/completions",
                  {"status": 503, "headers": {"Retry-After": "3600"}}, {"json": OK_COMPLETION})
    started = time.monotonic()
    complete(ModelClient(fast(llm_backoff_max_s=0.2)), server)
    assert time.monotonic() - started < 1.0


def test_model_backoff_that_would_pass_the_deadline_is_not_slept(server):
    server.script("POST", "/v1/chat/completions", default={"status": 429, "headers": {"Retry-After": "5"}})
    started = time.monotonic()
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast(llm_backoff_max_s=10.0)), server, deadline=time.monotonic() + 0.5)
    assert ei.value.reason == EPISODE_TIMEOUT
    assert time.monotonic() - started < 0.3
    assert server.count("POST", "/v1/chat/completions") == 1


def test_model_deadline_against_slow_server(server):
    server.script("POST", "/v1/chat/completions", {"sleep": 2.0, "json": OK_COMPLETION})
    started = time.monotonic()
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast()), server, deadline=time.monotonic() + 0.3)
    assert ei.value.reason == EPISODE_TIMEOUT
    assert time.monotonic() - started < 0.5


def test_model_deadline_already_passed(server):
    with pytest.raises(EpisodeError) as ei:
        complete(ModelClient(fast()), server, deadline=time.monotonic() - 1)
    assert ei.value.reason == EPISODE_TIMEOUT
    assert server.count("POST", "/v1/chat/completions") == 0


def test_model_api_key_sent_but_never_shown(server, caplog):
    caplog.set_level(logging.DEBUG)
    server.script(
        "POST", "/v1/chat/completions",
        {"json": OK_COMPLETION},
        {"status": 503, "json": {"error": f"bad token Bearer {KEY}"}},
        {"status": 503, "json": {"error": f"bad token Bearer {KEY}"}},
        {"status": 401, "json": {"error": f"invalid api key {KEY}"}},
    )
    client = ModelClient(fast(llm_retries=1))
    complete(client, server, api_key=Secret(KEY))
    assert server.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    with pytest.raises(EpisodeError) as unavailable:
        complete(client, server, api_key=KEY)
    with pytest.raises(EpisodeError) as bad:
        complete(client, server, api_key=KEY)
    assert bad.value.reason == MODEL_BAD_REQUEST and unavailable.value.reason == MODEL_UNAVAILABLE
    for err in (unavailable.value, bad.value):
        assert KEY not in str(err) and KEY not in repr(err) and KEY not in repr(err.args)
        assert "***" in str(err)
    assert all(KEY not in r.getMessage() for r in caplog.records)
    assert KEY not in repr(client)
    # a key that would be an invalid header is refused without quoting it
    with pytest.raises(EpisodeError) as ei:
        complete(client, server, api_key=KEY + "\r\nX-Evil: 1")
    assert ei.value.reason == MODEL_BAD_REQUEST and KEY not in str(ei.value)


# ---------------------------------------------------------------------------------------------
# EnvClient
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "action, reason",
    [
        ({"status": 500, "json": {"error": "boom"}}, ENV_SERVER_ERROR),
        ({"drop": True}, ENV_UNREACHABLE),
        ({"sleep": 1.0, "json": OK_STEP}, ENV_UNREACHABLE),  # read timeout (0.3 s)
    ],
    ids=["500", "dropped", "read-timeout"],
)
@pytest.mark.parametrize("call", ["step", "get_task_prompt"])
def test_non_idempotent_calls_are_not_retried_once_sent(server, action, reason, call):
    client = EnvClient(fast(env_read_timeout_s=0.3))
    method = "POST" if call == "step" else "GET"
    server.script(method, f"{P}/{call}", action, default={"json": OK_STEP if call == "step" else []})
    with pytest.raises(EpisodeError) as ei:
        if call == "step":
            client.step(server.url, ENV, EID, "act", deadline=far())
        else:
            client.get_task_prompt(server.url, ENV, EID, deadline=far())
    assert ei.value.reason == reason and ei.value.transient
    assert ENV in str(ei.value) and EID in str(ei.value) and call in str(ei.value)
    assert server.count(method, f"{P}/{call}") == 1


@pytest.mark.unit
def test_step_retried_when_connection_refused(caplog):
    caplog.set_level(logging.WARNING)
    client = EnvClient(fast(env_retries=3))
    started = time.monotonic()
    with pytest.raises(EpisodeError) as ei:
        client.step(f"http://127.0.0.1:{closed_port()}", ENV, EID, "act", deadline=far())
    assert ei.value.reason == ENV_UNREACHABLE and ei.value.transient
    assert len(retry_logs(caplog)) == 3  # 4 tries
    assert time.monotonic() - started < 2.0


def test_step_retried_until_the_server_comes_up(caplog):
    caplog.set_level(logging.WARNING)
    port = closed_port()
    holder: list[FakeServer] = []
    timer = threading.Timer(
        0.3, lambda: holder.append(FakeServer(port, defaults={("POST", f"{P}/step"): {"json": OK_STEP}}))
    )
    timer.start()
    try:
        # plenty of tries at <= 0.1 s apart to outlast the 0.3 s gap
        client = EnvClient(fast(env_retries=30, env_backoff_initial_s=0.05, env_backoff_max_s=0.1))
        out = client.step(f"http://127.0.0.1:{port}", ENV, EID, "act", deadline=far())
        assert out.reward == 1.5
        assert holder[0].count("POST", f"{P}/step") == 1
        assert len(retry_logs(caplog)) >= 2
    finally:
        timer.join()
        for srv in holder:
            srv.stop()


def test_step_parses_and_normalises(server):
    server.script(
        "POST", f"{P}/step",
        {"json": OK_STEP},
        {"json": {"reward": None, "terminated": 1, "truncated": "false", "info": ["not", "a", "dict"]}},
        {"json": {"reward": 2, "terminated": True}},
    )
    client = EnvClient(fast())
    a, b, c = (client.step(server.url, ENV, EID, "act", deadline=far()) for _ in range(3))
    assert a == StepResult(reward=1.5, terminated=False, truncated=False, info={"k": 1})
    assert b == StepResult(reward=0.0, terminated=True, truncated=False, info=None)
    assert c == StepResult(reward=2.0, terminated=True, truncated=False, info=None)
    assert json.loads(server.requests[0]["body"]) == {"action": "act"}


def test_prompt_parses(server):
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "t"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
    ]
    server.script("GET", f"{P}/get_task_prompt", {"json": msgs}, {"json": []})
    client = EnvClient(fast())
    assert client.get_task_prompt(server.url, ENV, EID, deadline=far()) == msgs
    assert client.get_task_prompt(server.url, ENV, EID, deadline=far()) == []


@pytest.mark.parametrize(
    "call, action",
    [
        ("step", {"raw": b"not json"}),
        ("step", {"json": [1, 2]}),
        ("step", {"json": {"reward": "high", "terminated": False, "truncated": False}}),
        ("step", {"json": {"reward": True, "terminated": False, "truncated": False}}),
        ("step", {"raw": b'{"reward": NaN, "terminated": false, "truncated": false}'}),
        ("step", {"json": {"reward": 1, "terminated": "maybe", "truncated": False}}),
        ("step", {"json": {"reward": 1, "terminated": False, "truncated": [1]}}),
        ("get_task_prompt", {"json": {"messages": []}}),
        ("get_task_prompt", {"json": ["hello"]}),
        ("get_task_prompt", {"json": [{"content": "no role"}]}),
        ("get_task_prompt", {"json": [{"role": "user"}]}),
        ("get_task_prompt", {"json": [{"role": "user", "content": 3}]}),
        ("reset", {"json": ["not", "an", "object"]}),
        ("reset", {"raw": b"\xff\xfe\xfa"}),
    ],
)
def test_env_malformed(server, call, action):
    method = "GET" if call == "get_task_prompt" else "POST"
    server.script(method, f"{P}/{call}", {"status": 200, **action})
    client = EnvClient(fast())
    with pytest.raises(EpisodeError) as ei:
        if call == "step":
            client.step(server.url, ENV, EID, "a", deadline=far())
        elif call == "reset":
            client.reset(server.url, ENV, EID, {}, None, deadline=far())
        else:
            client.get_task_prompt(server.url, ENV, EID, deadline=far())
    assert ei.value.reason == ENV_MALFORMED and not ei.value.transient
    assert f"{ENV}/{EID}" in str(ei.value)
    assert server.count(method, f"{P}/{call}") == 1


@pytest.mark.parametrize("no_length", [False, True])
def test_env_oversized_body_is_malformed(server, no_length):
    big = {"observation": {"blob": "z" * 50_000}, "reward": 0, "terminated": False, "truncated": False}
    server.script("POST", f"{P}/step", {"json": big, "no_length": no_length})
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast(max_response_bytes=10_000)).step(server.url, ENV, EID, "a", deadline=far())
    assert ei.value.reason == ENV_MALFORMED and "max_response_bytes" in str(ei.value)
    assert "zzzz" not in str(ei.value)


def test_env_4xx_mapping(server):
    server.script("POST", f"{P}/step", {"status": 404, "json": {"error": "no such env_id"}},
                  {"status": 422, "json": {"detail": "action must be a string"}})
    server.script("GET", f"{P}/get_task_prompt", {"status": 404, "json": {}})
    client = EnvClient(fast())
    with pytest.raises(EpisodeError) as lost:
        client.step(server.url, ENV, EID, "a", deadline=far())
    with pytest.raises(EpisodeError) as bad:
        client.step(server.url, ENV, EID, "a", deadline=far())
    with pytest.raises(EpisodeError) as lost_prompt:
        client.get_task_prompt(server.url, ENV, EID, deadline=far())
    assert lost.value.reason == ENV_INSTANCE_LOST and lost.value.transient
    assert lost_prompt.value.reason == ENV_INSTANCE_LOST
    assert bad.value.reason == ENV_BAD_REQUEST and not bad.value.transient
    assert "action must be a string" in str(bad.value)
    assert server.count("POST", f"{P}/step") == 2


def test_reset_retried_on_5xx_and_drop_then_succeeds(server):
    server.script("POST", f"{P}/reset", {"status": 500, "json": {"error": "init failed"}}, {"drop": True},
                  {"json": {"observation": {}, "info": {"a": 1}}})
    out = EnvClient(fast()).reset(server.url, ENV, EID, {"dataset": {"q": 1}}, 42, deadline=far())
    assert out == {"observation": {}, "info": {"a": 1}}
    assert server.count("POST", f"{P}/reset") == 3
    assert json.loads(server.requests[-1]["body"]) == {"env_param": {"dataset": {"q": 1}}, "seed": 42}


def test_reset_5xx_exhausted(server):
    server.script("POST", f"{P}/reset", default={"status": 502, "raw": b"bad gateway"})
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast(env_retries=2)).reset(server.url, ENV, EID, {}, None, deadline=far())
    assert ei.value.reason == ENV_SERVER_ERROR and ei.value.transient
    assert server.count("POST", f"{P}/reset") == 3


def test_reset_4xx_is_permanent_with_truncated_server_text(server):
    server.script("POST", f"{P}/reset", {"status": 400, "json": {"error": "Unknown env_name demo " + "q" * 5000}})
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast()).reset(server.url, ENV, EID, {}, None, deadline=far())
    assert ei.value.reason == ENV_BAD_REQUEST and not ei.value.transient
    assert "Unknown env_name demo" in str(ei.value) and len(str(ei.value)) < 700
    assert server.count("POST", f"{P}/reset") == 1


def test_env_deadline_against_slow_server(server):
    server.script("POST", f"{P}/step", {"sleep": 2.0, "json": OK_STEP})
    started = time.monotonic()
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast()).step(server.url, ENV, EID, "a", deadline=time.monotonic() + 0.3)
    assert ei.value.reason == EPISODE_TIMEOUT
    assert time.monotonic() - started < 0.5


def test_reset_backoff_stops_at_the_deadline(server):
    server.script("POST", f"{P}/reset", *[{"status": 500, "json": {"error": f"busy {i}"}} for i in range(100)])
    started = time.monotonic()
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast(env_retries=50, env_backoff_initial_s=0.1, env_backoff_max_s=0.2)).reset(
            server.url, ENV, EID, {}, None, deadline=time.monotonic() + 0.4)
    assert ei.value.reason == EPISODE_TIMEOUT
    assert time.monotonic() - started < 0.45


def test_reset_failing_twice_with_the_same_error_is_the_tasks_fault(server):
    """A reset the env answers with the same 500 twice is bad parameters, not a flaky server:
    a permanent error at once, not a minute of retries."""
    trace = "\x1b[31mTraceback (most recent call last):\x1b[0m\n" + "  File x, line 1\n" * 200 + "KeyError: 'difficulty'"
    server.script("POST", f"{P}/reset", default={"status": 500, "raw": trace.encode()})
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast(env_retries=10)).reset(server.url, ENV, EID, {}, None, deadline=far())
    assert ei.value.reason == ENV_BAD_REQUEST and not ei.value.transient
    assert server.count("POST", f"{P}/reset") == 2
    text = str(ei.value)
    assert "Traceback" in text and text.endswith("KeyError: 'difficulty'"), "head and tail kept"
    assert "\x1b" not in text, "terminal colour codes stripped"


def test_env_503_is_an_outage_and_not_applied(server):
    server.script("POST", f"{P}/step", {"status": 503, "json": {"error": "draining"}},
                  {"status": 200, "json": OK_STEP})
    out = EnvClient(fast()).step(server.url, ENV, EID, "a", deadline=far())  # 503: not processed, retried
    assert out.reward == 1.5 and server.count("POST", f"{P}/step") == 2
    server.script("POST", f"{P}/step", default={"status": 502, "json": {"error": "bad gateway"}})
    with pytest.raises(EpisodeError) as ei:
        EnvClient(fast()).step(server.url, ENV, EID, "a", deadline=far())
    assert ei.value.outage and ei.value.maybe_applied and ei.value.status == 502  # a gateway: maybe applied
    assert server.count("POST", f"{P}/step") == 3


def test_close_deletes(server):
    server.script("DELETE", P, {"json": {"status": "ok"}})
    EnvClient(fast()).close(server.url, ENV, EID)
    assert server.count("DELETE", P) == 1 and server.count("POST", f"{P}/close") == 0


def test_close_falls_back_to_post_on_404(server):
    server.script("DELETE", P, {"status": 404, "raw": b"Not Found"})
    server.script("POST", f"{P}/close", {"json": {"status": "ok"}})
    EnvClient(fast()).close(server.url, ENV, EID, deadline=far())
    assert server.count("DELETE", P) == 1 and server.count("POST", f"{P}/close") == 1


def test_close_retries_5xx(server):
    server.script("DELETE", P, {"status": 500}, {"drop": True}, {"json": {"status": "ok"}})
    EnvClient(fast()).close(server.url, ENV, EID)
    assert server.count("DELETE", P) == 3


def test_close_never_raises(server, caplog):
    caplog.set_level(logging.WARNING)
    client = EnvClient(fast(env_retries=2))
    started = time.monotonic()
    assert client.close(f"http://127.0.0.1:{closed_port()}", ENV, EID) is None
    server.script("DELETE", P, default={"status": 500})
    assert client.close(server.url, ENV, EID, deadline=time.monotonic() - 5) is None  # deadline passed: still tries
    server.script("DELETE", P, {"status": 403, "raw": b"forbidden"})
    assert client.close(server.url, ENV, EID) is None
    assert time.monotonic() - started < 3.0
    assert server.count("DELETE", P) == 4
    assert any("close" in r.getMessage() and "linger" in r.getMessage() for r in caplog.records)


def test_ready(server):
    server.script("GET", "/envs", default={"json": ["demo"]})
    client = EnvClient(fast())
    assert client.ready(server.url + "/")
    assert not client.ready(f"http://127.0.0.1:{closed_port()}", timeout=0.5)
    server.script("GET", "/envs", {"status": 503})
    assert not client.ready(server.url)


def test_concurrent_use_of_one_client(server):
    server.script("POST", f"{P}/step", default={"json": OK_STEP})
    client = EnvClient(fast(concurrency=4))
    results: list = []

    def work():
        for _ in range(10):
            results.append(client.step(server.url, ENV, EID, "a", deadline=far()).reward)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.5] * 80
    assert len({r["peer"] for r in server.requests}) <= 8  # connections were reused


def test_environment_proxy_still_applies_with_trust_env_off(monkeypatch):
    """Sessions skip requests' per-request environment scan; HTTP_PROXY/NO_PROXY still apply."""
    import http.server
    import json as _json
    import threading as _threading

    from workers import http_transport as ec

    seen = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)  # a proxy gets the absolute URL
            body = _json.dumps([{"role": "user", "content": "via proxy"}]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    _threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.setenv("NO_PROXY", "bypassed.invalid")
        monkeypatch.setattr(ec, "_proxies", {})
        client = EnvClient(Settings.from_env({}))
        assert client.session.trust_env is False
        prompt = client.get_task_prompt("http://envs.invalid:8080", "game", "e1", deadline=time.monotonic() + 5)
        assert prompt == [{"role": "user", "content": "via proxy"}]
        assert seen == ["http://envs.invalid:8080/game/e1/get_task_prompt"]
        assert ec.proxies_for("http://bypassed.invalid:1/x") == {}
    finally:
        proxy.shutdown()


class Trickler:
    """A server that answers one byte at a time, each well within the read timeout: headers
    (``phase="headers"``) or the body after complete headers (``phase="body"``)."""

    def __init__(self, phase: str, gap_s: float = 0.15):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.phase, self.gap_s = phase, gap_s
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            if self.phase == "body":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n[")
                drip = b" " * 100000
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                drip = b"X-Slow: " + b"a" * 100000
            for i in range(len(drip)):
                if self.stop.is_set():
                    return
                conn.sendall(drip[i:i + 1])
                time.sleep(self.gap_s)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_trickling_server_cannot_hold_a_call_past_the_budget(phase):
    """Each byte arrives within the read timeout, so only the attempt's deadline can end the
    call: the call ends at the deadline, as the budget being spent."""
    srv = Trickler(phase)
    try:
        started = time.monotonic()
        with pytest.raises(EpisodeError) as ei:
            EnvClient(fast(env_read_timeout_s=1.0)).get_task_prompt(srv.url, ENV, EID, deadline=started + 1.5)
        took = time.monotonic() - started
        assert ei.value.reason == EPISODE_TIMEOUT, ei.value
        assert took < 3.0, f"held {took:.1f}s past a 1.5 s budget"
        with pytest.raises(EpisodeError) as ei:
            complete(ModelClient(fast(llm_read_timeout_s=1.0)), srv, deadline=time.monotonic() + 1.0)
        assert ei.value.reason == EPISODE_TIMEOUT
    finally:
        srv.close()


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_trickling_proxy_cannot_hold_a_call_past_the_budget(phase, monkeypatch):
    """Calls through HTTP_PROXY take requests' path, not the urllib3 shortcut: the watchdog
    must cut them at the deadline all the same (a proxy that trickles, or relays a server that
    does)."""
    from workers import http_transport as ec

    srv = Trickler(phase)  # it answers whatever it is sent, the proxy's absolute-URL request too
    try:
        monkeypatch.setenv("HTTP_PROXY", srv.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setattr(ec, "_proxies", {})
        client = EnvClient(fast(env_read_timeout_s=1.0))
        assert client.http.pool_for("http://envs.invalid:8080/x") is None  # the proxied path
        started = time.monotonic()
        with pytest.raises(EpisodeError) as ei:
            client.get_task_prompt("http://envs.invalid:8080", ENV, EID, deadline=started + 1.5)
        took = time.monotonic() - started
        assert ei.value.reason == EPISODE_TIMEOUT, ei.value
        assert took < 3.0, f"held {took:.1f}s past a 1.5 s budget"
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------
# Malformed HTTP answers, through both clients and both HTTP paths
# ---------------------------------------------------------------------------------------------


class CannedAnswer:
    """A raw socket server that answers every request with the same bytes and keeps the
    connection open after it, as a server that goes on speaking on it would."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                self.requests += 1
                conn.sendall(self.answer)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.sock.close()


_OK_COMPLETION_BYTES = json.dumps(OK_COMPLETION).encode()
MALFORMED_ANSWERS = {
    # str.isdigit() takes "²", which int() refuses
    "length-superscript": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \xb2\r\n\r\n"
                          + _OK_COMPLETION_BYTES,
    "length-signed": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: +%d\r\n\r\n"
                     % len(_OK_COMPLETION_BYTES) + _OK_COMPLETION_BYTES,
    # int(x, 16) takes "0x..", so did both paths
    "chunk-0x": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"0x%x\r\n" % len(_OK_COMPLETION_BYTES) + _OK_COMPLETION_BYTES + b"\r\n0\r\n\r\n",
    "switching-protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
}


@pytest.mark.parametrize("path", ["plain-http", "urllib3", "proxy"])
@pytest.mark.parametrize("answer", list(MALFORMED_ANSWERS))
def test_a_malformed_answer_is_a_protocol_error_both_clients_retry(answer, path, monkeypatch):
    """A malformed answer is a transport fault: retried where a dropped connection is, and a
    transient error once the tries are spent (not the env client's internal_error, not the
    model client's permanent model_bad_request). On each HTTP path: our plain-http client,
    urllib3, and requests through HTTP_PROXY (the server answers the proxy's request)."""
    from workers import http_transport as ec

    srv = CannedAnswer(MALFORMED_ANSWERS[answer])
    url = srv.url
    if path == "proxy":
        monkeypatch.setenv("HTTP_PROXY", srv.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setattr(ec, "_proxies", {})
        url = "http://envs.invalid:8080"
    settings = fast(http_plain_client=path == "plain-http", env_retries=2, llm_retries=2)
    said = "connection dropped while reading the answer" if answer.startswith("chunk") else "malformed HTTP answer"
    try:
        env = EnvClient(settings)
        with pytest.raises(EpisodeError) as ei:
            env.reset(url, ENV, EID, {}, None, deadline=far())
        assert ei.value.reason == ENV_UNREACHABLE and ei.value.transient, ei.value
        assert said in str(ei.value)
        assert srv.requests == 3  # reset is retried: 1 + env_retries tries
        with pytest.raises(EpisodeError) as ei:
            env.step(url, ENV, EID, "act", deadline=far())
        assert ei.value.reason == ENV_UNREACHABLE and ei.value.transient, ei.value
        assert srv.requests == 4  # a step that may have been applied is not repeated
        with pytest.raises(EpisodeError) as ei:
            ModelClient(settings).complete(url + "/v1", [{"role": "user", "content": "x"}], model="m",
                                           temperature=0.5, deadline=far())
        assert ei.value.reason == MODEL_UNAVAILABLE and ei.value.transient, ei.value
        assert said in str(ei.value)
        assert srv.requests == 7
    finally:
        srv.close()
