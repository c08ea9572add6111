"""The model gateway (workers/gateway.py) on its own: a real gateway on loopback in front of the
real model stand-in, called by the plain ``openai`` client and by raw HTTP; every answered call
recorded once, in order, with its tool calls (workers/agent_episode.py ``CallRecorder``), and
hostile callers refused without stopping anything."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest

from broker import errors
from broker.settings import Settings
from workers.agent_episode import CallRecorder
from workers.gateway import AgentSession, Gateway
from workers.loop import LoopConfig
from workers.modelclient import ModelClient

CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class DirectPort:
    """A model port straight onto the stand-in through the worker's own model client."""

    def __init__(self, url: str):
        self.url, self.client = url, ModelClient(Settings.from_env({}, llm_retries=0))

    def complete(self, messages, **request):
        return self.client.complete(self.url, messages, model="stand-in", temperature=0.0, params=request,
                                    deadline=time.monotonic() + 10)


@pytest.fixture
def gateway():
    gw = Gateway("127.0.0.1", 0, max_body_bytes=64 * 1024)
    gw.serve_in_thread("test-gateway")
    yield gw
    gw.shutdown()


def open_session(gateway, model_url, session_id="job.1.1.1.1"):
    published = []
    recorder = CallRecorder(LoopConfig(job_id="job", episode_id=session_id, env_name="calculator",
                                       group_id="job.1.1.1", llm_model="stand-in", attempt_id="a1"), published.append)
    session = gateway.table.open(AgentSession(session_id, "stand-in", DirectPort(model_url), recorder.record))
    return session, recorder, published


def raw(gateway, method, path, body=b"", key="", headers=None):
    host, port = gateway.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=h)
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, json.loads(data) if data.startswith(b"{") else data


def solve(client, question="What is 6 * 7?", **kw):
    """The bundled tool task, as an agent with a calculator tool runs it."""
    messages = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="anything", messages=messages, tools=CALCULATOR, **kw)
    call = first.choices[0].message.tool_calls[0]
    result = str(eval(json.loads(call.function.arguments)["expression"]))  # noqa: S307 - the test's own tool
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model="anything", messages=messages, tools=CALCULATOR, **kw)
    return first, second


def test_the_plain_openai_client_is_answered_and_every_call_recorded_in_order(gateway, model_server):
    _, model_url = model_server
    session, recorder, published = open_session(gateway, f"{model_url}/v1")
    client = openai.OpenAI(base_url=gateway.session_url(session), api_key=session.key, max_retries=0)
    assert gateway.session_url(session).endswith("/v1")
    assert [m.id for m in client.models.list().data] == ["stand-in"]
    first, second = solve(client)
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.tool_calls[0].function.name == "calculator"
    assert second.choices[0].message.content == "The answer is 42. <answer>42</answer>"
    recorder.finish(1.0)
    assert [r.step_id for r in published] == [1, 2]
    one, two = published
    assert one.tool_calls[0]["function"]["name"] == "calculator" and one.response == ""
    assert one.tools == CALCULATOR and one.finish_reason == "tool_calls"
    assert json.loads(one.messages_json) == [{"role": "user", "content": "What is 6 * 7?"}]
    assert json.loads(two.messages_json)[-1] == {"role": "tool", "tool_call_id": one.tool_calls[0]["id"],
                                                 "content": "42"}
    assert two.response.endswith("<answer>42</answer>") and two.tool_calls is None
    assert (one.step_reward, one.episode_finished) == (0.0, False)
    assert (two.step_reward, two.cumulative_reward, two.episode_finished, two.terminated) == (1.0, 1.0, True, True)
    assert session.calls == 2


def test_the_original_proxy_path_and_a_stream_are_served_and_recorded_once(gateway, model_server):
    _, model_url = model_server
    session, recorder, published = open_session(gateway, f"{model_url}/v1")
    status, body = raw(gateway, "POST", f"/v1/{session.session_id}/chat/completions",
                       json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"}]}).encode(), session.key)
    assert status == 200 and body["choices"][0]["message"]["content"].endswith("The answer is 4")
    client = openai.OpenAI(base_url=gateway.session_url(session), api_key=session.key, max_retries=0)
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "What is 5 - 1?"}],
                                            tools=CALCULATOR, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert json.loads(calls[0].function.arguments) == {"expression": "5 - 1"}
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason] == [
        "tool_calls"]
    assert chunks[-1].usage is not None
    recorder.finish(0.0)
    assert [r.step_id for r in published] == [1, 2]
    assert published[1].tool_calls[0]["function"]["arguments"] == calls[0].function.arguments


def test_calls_made_at_once_are_each_one_step_numbered_in_the_order_answered(gateway, model_server):
    model, model_url = model_server
    model.latency_ms = 20
    session, recorder, published = open_session(gateway, f"{model_url}/v1")
    client = openai.OpenAI(base_url=gateway.session_url(session), api_key=session.key, max_retries=0)
    answers = []

    def ask(i):
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": f"What is {i} + 1?"}])
        answers.append(reply.id)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    recorder.finish(0.5)
    assert sorted(r.step_id for r in published) == list(range(1, 9)) == [r.step_id for r in published]
    asked = sorted(json.loads(r.messages_json)[0]["content"] for r in published)
    assert asked == sorted(f"What is {i} + 1?" for i in range(8))  # each call once, none twice
    assert sorted(answers) == sorted(f"chatcmpl-{session.session_id}-{i}" for i in range(1, 9))


def test_another_sessions_key_is_401_and_an_ended_sessions_key_410(gateway, model_server):
    _, model_url = model_server
    mine, _, mine_published = open_session(gateway, f"{model_url}/v1", "job.1.1.1.1")
    theirs, _, theirs_published = open_session(gateway, f"{model_url}/v1", "job.1.1.1.2")
    body = json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"}]}).encode()
    path = f"/sessions/{mine.session_id}/v1/chat/completions"
    assert raw(gateway, "POST", path, body, theirs.key)[0] == 401
    assert raw(gateway, "POST", path, body, "")[0] == 401
    assert raw(gateway, "POST", path, body, "ixs-guessed")[0] == 401
    assert raw(gateway, "GET", f"/sessions/{mine.session_id}/v1/models", key=theirs.key)[0] == 401
    assert raw(gateway, "POST", path, body, mine.key)[0] == 200
    gateway.table.end(mine)
    status, answer = raw(gateway, "POST", path, body, mine.key)
    assert status == 410 and answer["error"]["type"] == "session_ended"
    client = openai.OpenAI(base_url=gateway.session_url(mine), api_key=mine.key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "What is 1 + 1?"}])
    assert refused.value.status_code == 410
    assert mine.calls == 1 and theirs.calls == 0 and not theirs_published


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "not an object"),
    (b'{"messages": []}', 400, "non-empty list"),
    (b'{"messages": "hi"}', 400, "non-empty list"),
    (b'{"messages": [42]}', 400, "messages[0]"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "'n' must be 1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": "all"}', 400, "'tools' must be a list"),
    (b"\xff\xfe\x00garbage", 400, "not JSON"),
])
def test_malformed_bodies_are_refused_with_the_reason_and_nothing_recorded(gateway, model_server, body, status, says):
    _, model_url = model_server
    session, _, published = open_session(gateway, f"{model_url}/v1")
    got, answer = raw(gateway, "POST", f"/sessions/{session.session_id}/v1/chat/completions", body, session.key)
    assert got == status and says in answer["error"]["message"]
    assert not published and session.refused == 1
    # the gateway still answers the session
    ok = json.dumps({"messages": [{"role": "user", "content": "What is 3 + 3?"}]}).encode()
    assert raw(gateway, "POST", f"/sessions/{session.session_id}/v1/chat/completions", ok, session.key)[0] == 200


def test_oversized_bodies_wrong_routes_and_methods_stop_nothing(gateway, model_server):
    _, model_url = model_server
    session, _, published = open_session(gateway, f"{model_url}/v1")
    path = f"/sessions/{session.session_id}/v1/chat/completions"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    status, answer = raw(gateway, "POST", path, big, session.key)
    assert status == 413 and "larger than the gateway takes" in answer["error"]["message"]
    # a length it claims and never sends: refused before anything is read
    assert raw(gateway, "POST", path, b"", session.key, headers={"Content-Length": str(1 << 40)})[0] == 413
    assert raw(gateway, "POST", path, b"", session.key, headers={"Content-Length": "lots"})[0] == 400
    assert raw(gateway, "GET", path, key=session.key)[0] == 405
    assert raw(gateway, "POST", "/v1/chat/completions", b"{}", session.key)[0] == 404
    assert raw(gateway, "POST", f"/sessions/{session.session_id}/v2/chat/completions", b"{}", session.key)[0] == 404
    assert not published
    ok = json.dumps({"messages": [{"role": "user", "content": "What is 3 + 3?"}]}).encode()
    assert raw(gateway, "POST", path, ok, session.key)[0] == 200


def test_a_model_that_is_down_is_a_502_and_the_sessions_error(gateway):
    with Gateway("127.0.0.1", 0) as dead:  # a port nothing answers on once closed
        dead_url = f"{dead.base_url}/v1"
    session, _, published = open_session(gateway, dead_url)
    body = json.dumps({"messages": [{"role": "user", "content": "What is 3 + 3?"}]}).encode()
    status, answer = raw(gateway, "POST", f"/sessions/{session.session_id}/v1/chat/completions", body, session.key)
    assert status == 502 and answer["error"]["type"] == "upstream_error"
    assert session.error is not None and session.error.reason == errors.MODEL_UNAVAILABLE
    assert not published
