"""OpenEnv and Open Reward Standard servers, unchanged: the env ports (workers/openenv_port.py,
workers/ors_port.py) against real servers made from the installed packages, and hostile ones.

The servers: a multi-turn text game made with OpenEnv's ``create_app`` (tests/openenv_game.py),
the template ``openenv init`` generates, and an ORS environment with a tool served by
openreward's ``Server`` (tests/ors_game.py), each run by uvicorn in a process of its own on a
free port. The hostile ones are ours: a WebSocket server and an SSE server answering what no
real server should (frames that are not JSON, binary, huge; streams that stop mid-event).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_INSTANCE_LOST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EpisodeError,
)
from broker.records import EpisodeSpec
from broker.settings import Settings
from broker.states import EndedBy, EnvProtocol
from tests.protocol_servers import Uvicorn, next_guess, openenv_template
from workers.breakers import BreakerBoard
from workers.budget import Budget
from workers.env_mappings import Mapping, default_completion_to_action, default_observation_to_messages
from workers.env_protocols import protocol_env_port
from workers.envclient import EnvClient
from workers.hooks import NullHook
from workers.loop import LoopConfig, run_episode
from workers.modelclient import Completion
from workers.openenv_port import OpenEnvPort, SchemaCache
from workers.ors_port import SseEvents
from workers.ports import Guard

pytest.importorskip("openenv.core.env_server.http_server")
pytest.importorskip("openreward.environments")


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    server = Uvicorn("openenv_game:app", Uvicorn.tests_dir(), log=tmp_path_factory.mktemp("game") / "log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    folder = openenv_template(tmp_path_factory.mktemp("tmpl"))
    server = Uvicorn("server.app:app", folder, log=folder / "server.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ors(tmp_path_factory):
    server = Uvicorn("ors_game:app", Uvicorn.tests_dir(), log=tmp_path_factory.mktemp("ors") / "log").start()
    yield server
    server.stop()


def fast_settings(**kw) -> Settings:
    # timeouts long enough for a loaded machine: no test here waits on one
    return Settings.from_env({}, env_backoff_initial_s=0.05, env_backoff_max_s=0.2, env_read_timeout_s=60,
                             env_connect_timeout_s=20, outage_budget_s=5, **kw)


def spec_of(url: str, protocol: str, env_name: str = "guess", params: dict | None = None, seed: int | None = 1,
            mapping: dict | None = None, episode: str = "j.f.0.0.0") -> EpisodeSpec:
    return EpisodeSpec(job_id="j", episode_id=episode, group_id="g", group_size=1, env_name=env_name, base_url=url,
                       env_params={"dataset": {}, **(params or {})}, seed=seed, protocol=protocol,
                       mapping=mapping or {})


def port_of(spec: EpisodeSpec, settings: Settings | None = None, budget_s: float = 60):
    settings = settings or fast_settings()
    budget = Budget(budget_s)
    return protocol_env_port(spec, (1, "a1"), settings=settings, client=EnvClient(settings), budget=budget,
                             guard=Guard(budget, lambda: None, settings.outage_budget_s),
                             breakers=BreakerBoard(None, None), check=lambda: None)


class GuessPolicy:
    """The test stand-in's policy, in process: text guesses, or ``guess`` tool calls when offered."""

    def __init__(self):
        self.requests: list[tuple[list, dict]] = []

    def complete(self, messages, **request):
        self.requests.append((messages, request))
        guess = next_guess(messages)
        if request.get("tools"):
            return Completion(content="", finish_reason="tool_calls", weight_version=None, latency_s=0.0,
                              tool_calls=[{"id": f"c{len(self.requests)}", "type": "function",
                                           "function": {"name": "guess", "arguments": json.dumps({"number": guess})}}])
        text = "hello" if guess is None else f"My guess: {guess}"
        return Completion(content=text, finish_reason="stop", weight_version=None, latency_s=0.0)


def drive(port, policy, max_steps: int = 12, message_cut: int = 0):
    records: list = []
    cfg = LoopConfig(job_id="j", episode_id="e", env_name="guess", group_id="g", llm_model="m", max_steps=max_steps,
                     message_cut=message_cut)
    out = run_episode(cfg, env=port, policy=policy, publish=lambda record, *_: records.append(record), hook=NullHook())
    return out, records


# --- the default text mapping -------------------------------------------------------------------

def test_the_default_mapping_reads_messages_prompt_or_the_one_string_field():
    assert default_observation_to_messages({"messages": [{"role": "user", "content": "x"}]}, []) == [
        {"role": "user", "content": "x"}]
    said = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert default_observation_to_messages({"prompt": "c", "turn": 2}, said) == [*said, {"role": "user", "content": "c"}]
    assert default_observation_to_messages({"echoed_message": "hi", "message_length": 2}, []) == [
        {"role": "user", "content": "hi"}]
    with pytest.raises(EpisodeError) as err:
        default_observation_to_messages({"board": "x", "legend": "y"}, [])
    assert err.value.reason == ENV_MALFORMED and "observation_to_messages" in str(err.value) and "board" in str(err.value)


def test_the_default_action_is_the_one_string_field_of_the_schema():
    schema = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}}
    assert default_completion_to_action("hi", None, schema) == {"message": "hi"}
    two = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    with pytest.raises(EpisodeError) as err:
        default_completion_to_action("hi", None, two)
    assert err.value.reason == ENV_BAD_REQUEST and not err.value.transient and "completion_to_action" in str(err.value)


def test_a_mapping_that_fails_or_answers_nonsense_names_itself():
    m = Mapping(observation_to_messages=lambda obs, conv: 1 / 0, completion_to_action=lambda t, c, s: ["no"])
    with pytest.raises(EpisodeError) as err:
        m.messages({}, [], "x")
    assert err.value.reason == ENV_MALFORMED and "ZeroDivisionError" in str(err.value)
    with pytest.raises(EpisodeError) as err:
        m.action("t", None, {}, "x")
    assert err.value.reason == ENV_BAD_REQUEST and "not an object" in str(err.value)
    with pytest.raises(EpisodeError) as err:
        Mapping.load({"observation_to_messages": "tests.no_such_module:f"})
    assert "could not be loaded" in str(err.value)


# --- OpenEnv, real servers ------------------------------------------------------------------------

def test_an_openenv_game_plays_to_its_end_through_the_step_loop(game):
    port = port_of(spec_of(game.url, EnvProtocol.OPENENV, params={"target": 37}))
    out, records = drive(port, GuessPolicy())
    assert out.ended_by == EndedBy.TERMINATED and out.total_reward == 1.0
    assert [r.response for r in records] == ["My guess: 25", "My guess: 38", "My guess: 31", "My guess: 34",
                                             "My guess: 36", "My guess: 37"]
    # the conversation the port keeps: the env's prompts, each answer, each feedback
    last = json.loads(records[-1].messages_json)
    assert last[0]["content"].startswith("Guess the number between 1 and 50")
    assert [m["role"] for m in last] == ["user", "assistant"] * 5 + ["user"]
    assert port.closed and port.ws is None


def test_the_openenv_init_template_runs_without_adapter_code(template):
    port = port_of(spec_of(template.url, EnvProtocol.OPENENV, env_name="tmpl_env"))
    out, records = drive(port, GuessPolicy(), max_steps=3)
    assert out.ended_by == EndedBy.MAX_STEPS and len(records) == 3
    assert json.loads(records[0].messages_json) == [{"role": "user", "content": "Tmpl Env environment ready!"}]
    assert [r.step_reward for r in records] == pytest.approx([0.5] * 3)  # "hello": 5 characters, 0.1 each


def test_a_full_openenv_server_is_waited_for_not_failed(template):
    # the template serves max_concurrent_envs=1, as openenv init writes it
    try:
        first = port_of(spec_of(template.url, EnvProtocol.OPENENV, env_name="tmpl_env"))
        first.reset()
        second = port_of(spec_of(template.url, EnvProtocol.OPENENV, env_name="tmpl_env"))
        done = threading.Event()
        threading.Thread(target=lambda: (second.reset(), done.set()), daemon=True).start()
        waiting_until = time.monotonic() + 120
        while second.budget.paused_s < 0.5 and time.monotonic() < waiting_until:
            time.sleep(0.05)
        assert not done.is_set() and second.capacity_waits == 1  # waiting: the one session is taken
        first.close()
        assert done.wait(120), "the second reset never got the freed session"
        assert second.observation["echoed_message"] == "Tmpl Env environment ready!"
        assert second.budget.paused_s > 0.5  # the wait was not the episode's doing
        second.close()
    finally:
        first.close()


def test_an_openenv_server_restart_loses_the_session_and_says_so(game):
    port = port_of(spec_of(game.url, EnvProtocol.OPENENV))
    port.reset()
    port.get_task_prompt()
    game.restart()
    with pytest.raises(EpisodeError) as err:
        port.step("My guess: 3")
    assert err.value.reason == ENV_INSTANCE_LOST and err.value.transient
    fresh = port_of(spec_of(game.url, EnvProtocol.OPENENV))
    assert fresh.reset()["observation"]["prompt"].startswith("Guess")  # a new attempt starts afresh
    fresh.close()


def test_an_openenv_server_that_is_not_one_is_named(ors):
    with pytest.raises(EpisodeError) as err:
        port_of(spec_of(ors.url, EnvProtocol.OPENENV)).reset()
    assert err.value.reason in (ENV_BAD_REQUEST, ENV_MALFORMED) and not err.value.transient


# --- OpenEnv, hostile frames -------------------------------------------------------------------------

class HostileWs:
    """A WebSocket server that answers a reset properly and each later message as ``answer`` says."""

    def __init__(self, answer):
        from websockets.sync.server import serve

        self.answer = answer
        def health(connection, request):  # GET /health answers 200, as a live OpenEnv server's does
            return connection.respond(200, "ok\n") if request.path == "/health" else None

        self.server = serve(self._handle, "127.0.0.1", 0, max_size=None, process_request=health)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handle(self, ws):
        try:
            for raw in ws:
                kind = json.loads(raw)["type"]
                if kind == "reset":
                    ws.send(json.dumps({"type": "observation", "data": {
                        "observation": {"prompt": "Guess the number between 1 and 9."}, "reward": 0, "done": False}}))
                elif kind == "step":
                    if self.answer(ws) == "close":
                        return
        except Exception:  # noqa: BLE001 - the client went away
            pass

    def stop(self):
        self.server.shutdown()


HOSTILE = {
    "not json": (lambda ws: ws.send("{not json"), ENV_MALFORMED),
    "binary": (lambda ws: ws.send(b"\x00\x01"), ENV_MALFORMED),
    "a list": (lambda ws: ws.send("[1, 2]"), ENV_MALFORMED),
    "unknown type": (lambda ws: ws.send(json.dumps({"type": "mystery", "data": {}})), ENV_MALFORMED),
    "observation not an object": (lambda ws: ws.send(json.dumps({"type": "observation", "data": {
        "observation": "x", "reward": 0, "done": False}})), ENV_MALFORMED),
    "reward not a number": (lambda ws: ws.send(json.dumps({"type": "observation", "data": {
        "observation": {}, "reward": "lots", "done": False}})), ENV_MALFORMED),
    "done not a boolean": (lambda ws: ws.send(json.dumps({"type": "observation", "data": {
        "observation": {}, "reward": 1, "done": "maybe"}})), ENV_MALFORMED),
    "huge": (lambda ws: ws.send("x" * 200_000), ENV_MALFORMED),
    "execution error": (lambda ws: ws.send(json.dumps({"type": "error", "data": {
        "code": "EXECUTION_ERROR", "message": "boom"}})), ENV_SERVER_ERROR),
    "closed mid-step": (lambda ws: "close", ENV_INSTANCE_LOST),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_openenv_answer_fails_the_episode_with_its_reason(case):
    answer, reason = HOSTILE[case]
    server = HostileWs(answer)
    try:
        settings = fast_settings(max_response_bytes=65536)
        budget = Budget(30)
        schemas = SchemaCache()
        schemas._schemas[server.url] = {"properties": {"text": {"type": "string"}}}
        port = OpenEnvPort(spec_of(server.url, EnvProtocol.OPENENV), settings, budget,
                           Guard(budget, lambda: None, 2), BreakerBoard(None, None).for_env(server.url, "/health"),
                           lambda: None, EnvClient(settings), schemas=schemas)
        port.reset()
        port.get_task_prompt()
        with pytest.raises(EpisodeError) as err:
            port.step("5")
        assert err.value.reason == reason, err.value
        port.close()
    finally:
        server.stop()


# --- ORS, a real server -------------------------------------------------------------------------------

def test_an_ors_game_plays_to_its_end_through_tool_calls(ors):
    port = port_of(spec_of(ors.url, EnvProtocol.ORS, env_name="guessing", params={"target": 42}))
    port.reset()
    policy, rewards, turns = GuessPolicy(), [], 0
    while True:
        prompt = port.get_task_prompt()
        assert prompt["tools"][0]["function"]["name"] == "guess"
        answer = policy.complete(prompt["messages"], tools=prompt["tools"])
        result = port.step(answer.content, tool_calls=answer.tool_calls)
        rewards.append(result.reward)
        turns += 1
        if result.terminated or result.truncated:
            break
    assert result.terminated and not result.truncated and sum(rewards) == 1.0 and turns == 5
    tool_results = [m["content"] for m in port.messages if m["role"] == "tool"]
    assert tool_results == ["25 is too low.", "38 is too low.", "44 is too high.", "41 is too low.", "42 is right!"]
    port.close()
    gone = requests.post(f"{ors.url}/ping", headers={"X-Session-ID": port.sid}, timeout=5)
    assert gone.status_code == 404  # the session was deleted


def test_an_ors_tool_call_the_env_refuses_goes_back_to_the_model(ors):
    port = port_of(spec_of(ors.url, EnvProtocol.ORS, env_name="guessing", params={"target": 3}))
    port.reset()
    port.get_task_prompt()
    bad = [{"id": "a", "type": "function", "function": {"name": "guess", "arguments": "{not json"}},
           {"id": "b", "type": "function", "function": {"name": "nope", "arguments": "{}"}},
           {"id": "c", "type": "function", "function": {"name": "guess", "arguments": '{"number": "x"}'}}]
    result = port.step("", tool_calls=bad)
    assert result.reward == 0.0 and not result.terminated
    said = [m["content"] for m in port.messages if m["role"] == "tool"]
    assert said[0] == "error: the arguments are not JSON" and said[1].startswith("error:") and said[2].startswith(
        "error:")
    plain = port.step("I give up")  # no tool call and no terminal tool: the model stopped acting
    assert plain.truncated and not plain.terminated
    port.close()


def test_an_ors_session_lost_to_a_restart_is_an_instance_lost(ors):
    port = port_of(spec_of(ors.url, EnvProtocol.ORS, env_name="guessing"))
    port.reset()
    prompt = port.get_task_prompt()
    ors.restart()
    call = GuessPolicy().complete(prompt["messages"], tools=prompt["tools"])
    with pytest.raises(EpisodeError) as err:
        port.step("", tool_calls=call.tool_calls)
    assert err.value.reason == ENV_INSTANCE_LOST and err.value.transient


# --- ORS, hostile streams ------------------------------------------------------------------------------

class HostileOrs(ThreadingHTTPServer):
    """An ORS-shaped server whose ``call`` answers as ``stream(handler, body)`` writes it."""

    daemon_threads = True

    def __init__(self, stream):
        super().__init__(("127.0.0.1", 0), _OrsHandler)
        self.stream = stream
        self.calls: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _OrsHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if self.path.endswith("/tools"):
            self._json({"tools": [{"name": "guess", "description": "", "input_schema": None}]})
        else:
            self._json([{"type": "text", "text": "Guess the number between 1 and 9."}])

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if not self.path.endswith("/call"):
            return self._json({"sid": self.headers.get("X-Session-ID")})
        self.server.calls.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.server.stream(self.wfile, body)
        self.wfile.flush()
        self.close_connection = True


OK_RESULT = json.dumps({"ok": True, "output": {"blocks": [{"type": "text", "text": "5 is right!"}], "reward": 1.0,
                                               "finished": True}})


def _cut_once(w, body):
    """The first stream stops mid-event after its task id; asked again by it, the result comes whole."""
    if body.get("task_id") == "t1":
        w.write(f"event: end\r\ndata: {OK_RESULT}\r\n\r\n".encode())
    else:
        w.write(b"event: task_id\r\ndata: t1\r\n\r\n: ping\r\n\r\nevent: chunk\r\ndata: {\"ok\": tr")


STREAMS = {
    "cut mid-event, asked again by its task id": (_cut_once, None),
    "cut mid-event, no task id": (lambda w, b: w.write(b"event: chunk\r\ndata: {\"ok\""), ENV_UNREACHABLE),
    "an error event": (lambda w, b: w.write(b"event: task_id\ndata: t\n\nevent: error\ndata: tool crashed\n\n"),
                       ENV_SERVER_ERROR),
    "a result that is not JSON": (lambda w, b: w.write(b"event: end\ndata: {nope\n\n"), ENV_MALFORMED),
    "a result of the wrong shape": (lambda w, b: w.write(b'event: end\ndata: {"ok": true, "output": 3}\n\n'),
                                    ENV_MALFORMED),
    "a reward that is not finite": (lambda w, b: w.write(
        b'event: end\ndata: {"ok": true, "output": {"blocks": [], "reward": 1e999}}\n\n'), ENV_MALFORMED),
    "a stream past max_response_bytes": (lambda w, b: w.write(b"event: chunk\ndata: " + b"x" * 200_000 + b"\n\n"),
                                         ENV_MALFORMED),
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_a_hostile_ors_stream(case):
    stream, reason = STREAMS[case]
    server = HostileOrs(stream)
    try:
        port = port_of(spec_of(server.url, EnvProtocol.ORS, env_name="guessing"),
                       settings=fast_settings(max_response_bytes=65536))
        port.reset()
        port.get_task_prompt()
        call = [{"id": "a", "type": "function", "function": {"name": "guess", "arguments": '{"number": 5}'}}]
        if reason is None:
            result = port.step("", tool_calls=call)
            assert result.terminated and result.reward == 1.0 and port.replayed == 1
            assert [c.get("task_id") for c in server.calls] == [None, "t1"]  # never run twice
        else:
            with pytest.raises(EpisodeError) as err:
                port.step("", tool_calls=call)
            assert err.value.reason == reason, err.value
            assert len(server.calls) == 1  # a call without a task id is never sent again
    finally:
        server.shutdown()


def test_sse_events_are_parsed_across_reads_and_line_ends():
    events = SseEvents()
    got = []
    for piece in (b"event: task_id\r", b"\ndata: 7\r\n\r\n: comment\n\nevent: chunk\ndata: a\ndata: b\r\r",
                  b"event: end\ndata:c\n\n"):
        got += events.feed(piece)
    assert got == [("task_id", "7"), ("chunk", "a\nb"), ("end", "c")]


# --- tools in our own protocol -------------------------------------------------------------------------

class ToolsEnvServer(ThreadingHTTPServer):
    """An env server of the original protocol playing the guessing game; with ``offer`` its
    prompt answer is ``{"messages", "tools"}`` and it reads the ``tool_calls`` beside the action."""

    daemon_threads = True

    def __init__(self, offer: bool, target: int = 6):
        super().__init__(("127.0.0.1", 0), _ToolsEnvHandler)
        self.offer, self.target = offer, target
        self.messages: list[dict] = []
        self.step_bodies: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ToolsEnvHandler(_OrsHandler):
    def do_GET(self):  # noqa: N802 - get_task_prompt
        srv = self.server
        tools = [{"type": "function", "function": {"name": "guess", "parameters": {
            "type": "object", "properties": {"number": {"type": "integer"}}}}}]
        self._json({"messages": srv.messages, "tools": tools} if srv.offer else srv.messages)

    def do_DELETE(self):  # noqa: N802
        self._json({"status": "ok"})

    def do_POST(self):  # noqa: N802
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path.endswith("/reset"):
            srv.messages = [{"role": "user", "content": "Guess the number between 1 and 9."}]
            return self._json({"observation": {}, "info": {}})
        srv.step_bodies.append(body)
        calls = body.get("tool_calls") or []
        guess = json.loads(calls[0]["function"]["arguments"])["number"] if calls else int(body["action"].split()[-1])
        said = f"{guess} is right!" if guess == srv.target else f"{guess} is too {'low' if guess < srv.target else 'high'}."
        srv.messages = srv.messages + [{"role": "assistant", "content": body["action"]},
                                       {"role": "user", "content": said}]
        self._json({"observation": {}, "reward": 1.0 if guess == srv.target else 0.0,
                    "terminated": guess == srv.target, "truncated": False, "info": {}})


@pytest.mark.parametrize("offer", [True, False])
def test_tools_in_our_own_protocol_go_to_the_model_and_back_to_step(offer):
    from workers.ports import BoundEnv

    server = ToolsEnvServer(offer)
    try:
        settings = fast_settings()
        budget = Budget(30)
        spec = spec_of(server.url, "")
        env = BoundEnv(EnvClient(settings), spec, "e~1-a", budget, Guard(budget, lambda: None, 2),
                       BreakerBoard(None, None).for_env(server.url))
        policy = GuessPolicy()
        out, records = drive(env, policy)
        assert out.ended_by == EndedBy.TERMINATED and out.total_reward == 1.0
        if offer:
            # the tools went to the model, its calls to step beside its (empty) text, and the step keeps both
            assert all(request.get("tools") for _, request in policy.requests)
            assert [set(b) for b in server.step_bodies] == [{"action", "tool_calls"}] * len(records)
            assert records[0].tools[0]["function"]["name"] == "guess" and records[0].tool_calls[0]["id"] == "c1"
        else:
            # an env that offers no tools is sent exactly what it always was
            assert all(not request for _, request in policy.requests)
            assert all(b == {"action": r.response} for b, r in zip(server.step_bodies, records))
            assert records[0].tools is None and records[0].tool_calls is None
    finally:
        server.shutdown()


# --- task files ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry, field, words", [
    ("protocol: grpc", "protocol", "must be one of openenv, ors"),
    ("protocol: openenv\n    transport: inproc\n    env_class: envs.bundled:GuessNumber", "protocol", "base_url"),
    ("observation_to_messages: m:f", "observation_to_messages", "only with protocol: openenv"),
    ("protocol: openenv\n    completion_to_action: not a path", "completion_to_action", "module:function"),
    ("protocol: openenv\n    split: train", "split", "only with protocol: ors"),
    ("protocol: ors\n    split: train\n    dataset: [{a: 1}]", "split", "not both"),
])
def test_a_task_entry_of_another_protocol_is_checked(tmp_path, entry, field, words):
    from producer.taskfile import TaskFileError, load_task_file

    path = tmp_path / "t.yaml"
    server = "" if "inproc" in entry else "    base_url: http://127.0.0.1:9\n"
    path.write_text(f"environments:\n  - env_name: x\n{server}    {entry}\n")
    with pytest.raises(TaskFileError) as err:
        load_task_file(str(path))
    assert f"field '{field}'" in str(err.value) or field in str(err.value)
    assert words in str(err.value)


def test_a_split_names_its_tasks_or_the_error(tmp_path, ors):
    from producer.planning import plan_job
    from producer.taskfile import TaskFileError

    path = tmp_path / "t.yaml"
    path.write_text(f"environments:\n  - env_name: guessing\n    protocol: ors\n    base_url: {ors.url}\n"
                    "    split: train\n    env_num: 2\n")
    planned = plan_job([str(path)], job_id="j")
    assert len(planned.episodes) == 6 and {e.protocol for e in planned.episodes} == {EnvProtocol.ORS}
    assert planned.episodes[0].env_params["dataset"] == {"target": 7, "high": 50, "max_turns": 8}
    path.write_text(f"environments:\n  - env_name: guessing\n    protocol: ors\n    base_url: {ors.url}\n"
                    "    split: nosuch\n")
    with pytest.raises(TaskFileError) as err:
        plan_job([str(path)], job_id="j2")
    assert "split" in str(err.value) and "HTTP 400" in str(err.value) and "Invalid split" in str(err.value)


def test_an_entry_names_its_own_mappings(template):
    from broker.records import JobSpec
    from workers.allowlist import TrustBoundary

    mapping = {"observation_to_messages": "tests.openenv_mappings:with_rules",
               "completion_to_action": "tests.openenv_mappings:marked"}
    port = port_of(spec_of(template.url, EnvProtocol.OPENENV, env_name="tmpl_env", mapping=mapping))
    out, records = drive(port, GuessPolicy(), max_steps=2)
    assert json.loads(records[1].messages_json) == [
        {"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Tmpl Env environment ready!"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "mapped: hello"}]
    assert [r.step_reward for r in records] == pytest.approx([1.3, 1.3])  # len("mapped: hello") * 0.1
    # a worker imports them only from its allow-list, as env classes
    job = JobSpec(job_id="j", llm_base_url="http://127.0.0.1:8000/v1", model="m")
    spec = spec_of(template.url, EnvProtocol.OPENENV, mapping=mapping)
    refused = TrustBoundary(fast_settings(env_classes="envs.*")).refused(job, spec)
    assert "completion_to_action 'tests.openenv_mappings:marked' is not on this worker's allow-list" in refused
    assert TrustBoundary(fast_settings(env_classes="tests.*")).refused(job, spec) == ""


def test_open_ors_sessions_are_kept_alive_while_the_model_thinks(ors):
    from workers.ors_port import KeepAlive

    keeper = KeepAlive(every_s=0.4)
    port = port_of(spec_of(ors.url, EnvProtocol.ORS, env_name="guessing", episode="j.f.0.0.9"))
    port.keepalive = keeper
    port.reset()
    wait_pinged = time.monotonic() + 20
    while keeper.pings < 2 and time.monotonic() < wait_pinged:
        time.sleep(0.1)
    assert keeper.pings >= 2  # an idle session was pinged, again and again
    port.close()
    time.sleep(1.0)  # a ping already on its way may land
    pinged = keeper.pings
    time.sleep(2.0)
    assert keeper.pings == pinged  # a closed session is not


def test_an_ors_orphan_is_deleted_the_ors_way(ors, settings, redis_client):
    from broker import closing
    from broker.keys import Keys
    from workers.orphans import OrphanCloser

    spec = spec_of(ors.url, EnvProtocol.ORS, env_name="guessing", episode="j.f.0.0.7")
    port = port_of(spec)
    port.reset()  # a session, then its worker "dies" without closing it
    sid = port.sid
    assert requests.post(f"{ors.url}/ping", headers={"X-Session-ID": sid}, timeout=5).status_code == 200
    keys = Keys(settings.key_prefix)
    redis_client.rpush(keys.orphans, *closing.orphans(spec, [(1, "a1")]))
    closer = OrphanCloser(redis_client, keys, EnvClient(fast_settings()))
    closer.tick()
    assert closer.closed == 1
    assert requests.post(f"{ors.url}/ping", headers={"X-Session-ID": sid}, timeout=5).status_code == 404
    # an OpenEnv session needs no orphan entry: it ended with its worker's socket
    assert closing.orphans(spec_of(ors.url, EnvProtocol.OPENENV), [(1, "a1")]) == []


def test_an_env_class_offering_tools_plays_through_serve_env_and_inproc():
    from envs.serve_env import start_in_thread
    from workers.inproc import InprocEnv
    from workers.ports import BoundEnv

    server, url = start_in_thread(registry={"toolguess": "tests.tool_env:ToolGuess"})
    try:
        settings = fast_settings(env_classes="tests.*")
        budget = Budget(30)
        spec = spec_of(url, "", env_name="toolguess", params={})
        http = BoundEnv(EnvClient(settings), spec, "e~1-a", budget, Guard(budget, lambda: None, 2),
                        BreakerBoard(None, None).for_env(url))
        out, records = drive(http, GuessPolicy())
        assert out.ended_by == EndedBy.TERMINATED and out.total_reward == 1.0 and server.counters["steps"] == 3
        assert [r.tool_calls[0]["function"]["name"] for r in records] == ["guess"] * 3
    finally:
        server.shutdown()
    inproc_spec = EpisodeSpec(job_id="j", episode_id="e2", group_id="g", group_size=1, env_name="toolguess",
                              base_url="", env_params={"dataset": {"target": 2}}, transport="inproc",
                              env_class="tests.tool_env:ToolGuess")
    inproc = InprocEnv(inproc_spec, Budget(30), fast_settings(env_classes="tests.*"))
    out, records = drive(inproc, GuessPolicy())
    assert out.ended_by == EndedBy.TERMINATED and out.total_reward == 1.0 and len(records) == 2
