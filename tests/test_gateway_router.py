"""``interactor gateway`` (workers/gateway_router.py): agents given the service's URL instead of
their worker's gateway, as agents that run elsewhere are; a real service process and real worker
processes, the routes in Redis. Calls are recorded as with the worker's own gateway, another
session's key is refused by the worker behind the service (401), an ended session by the service
(410), and what it cannot route or take is refused without stopping it."""

from __future__ import annotations

import http.client
import json
import sys

import pytest

from broker.embedded import free_port
from broker.keys import Keys
from tests.conftest import wait_for
from tests.test_agents import AGENT_SETTINGS, ROW, run_job, steps_of, write_tasks

pytestmark = pytest.mark.integration


def post(port: int, path: str, body: bytes, key: str = "", headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    conn.request("POST", path, body=body, headers=h)
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, json.loads(data)


@pytest.fixture
def routed(settings, model_server, procs):
    """Settings whose agents get the service's URL, and the service's port, the service up."""
    _, model_url = model_server
    port = free_port()
    routed = settings.replace(llm_base_url=model_url + "/v1", gateway_url=f"http://127.0.0.1:{port}",
                              **AGENT_SETTINGS)
    procs.settings = routed
    procs.start("gateway", "gateway", "--port", str(port))

    def up():
        try:
            return post(port, "/sessions/none/v1/chat/completions", b"{}")[0] == 410
        except OSError:
            return False

    wait_for(up, 60, what="interactor gateway listening")
    return routed, port


def test_agents_given_the_services_url_are_served_and_recorded_through_it(routed, procs, redis_client, model_server,
                                                                          tmp_path):
    settings, port = routed
    model, _ = model_server
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = write_tasks(tmp_path, f"""\
        - env_name: where
          agent: tests.agent_fakes:says_where
          env_params: {{marks: "{marks}"}}
        - env_name: tool
          agent: examples.agents.openai_client:solve
          dataset: calc.jsonl
        - env_name: process
          agent_command: [PYTHON, -m, examples.agents.subprocess_agent]
          dataset: calc.jsonl
        - env_name: other
          agent: tests.agent_fakes:uses_anothers_key
          env_params: {{marks: "{marks}"}}
          env_num: 2
        - env_name: late
          agent: tests.agent_fakes:calls_after_its_end
          env_params: {{marks: "{marks}"}}
        """.replace("PYTHON", sys.executable))
    job_id, res = run_job(settings, procs, redis_client, tasks, 6)
    assert res["completed"] == 6, procs.log("w1")[-3000:]
    (given,) = [p.read_text() for p in marks.glob("base-url-*")]
    assert given.startswith(f"http://127.0.0.1:{port}/sessions/") and given.endswith("/v1")
    steps = steps_of(settings.results_store, job_id)
    assert sorted(len(s) for s in steps.values()) == [1, 1, 1, 1, 2, 2]
    tool_calls = [json.loads(s[4])["tool_calls"] for ep in steps.values() for s in ep if s[4] and "tool_calls" in s[4]]
    assert len(tool_calls) == 2  # the calculator call of the tool agent and of the process
    # refused either way: 401 while the mate's session is open, 410 once the mate has ended (the
    # two episodes run at once, so which one a call meets is a matter of timing); the model's
    # request count below shows neither reached it
    other = sorted(p.read_text() for p in marks.glob("other-*"))
    assert len(other) == 2 and set(other) <= {"401", "410"}, other
    wait_for(lambda: (marks / "late-status").exists(), 30, what="the late call's answer")
    assert (marks / "late-status").read_text() == "410"
    assert model.stats()["requests"] == 1 + 2 + 2 + 2 + 1  # nothing refused reached the model
    # every route is gone with its session
    assert list(redis_client.scan_iter(Keys(settings.key_prefix).gateway_route("*"))) == []


def test_the_service_refuses_what_it_cannot_route_or_take_and_goes_on(routed, redis_client):
    settings, port = routed
    body = json.dumps({"messages": [{"role": "user", "content": ROW["question"]}]}).encode()
    assert post(port, "/sessions/j.1.1.1.1/v1/chat/completions", body, "ixs-any")[0] == 410
    status, answer = post(port, "/sessions/j.1.1.1.1/v1/chat/completions", b"", "ixs-any",
                          headers={"Content-Length": str(1 << 40)})
    assert status == 413 and "larger than the gateway takes" in answer["error"]["message"]
    assert post(port, "/v1/chat/completions", body)[0] == 404
    # a route to a worker gateway that is gone: 502, and the service goes on
    redis_client.set(Keys(settings.key_prefix).gateway_route("j.1.1.1.2"), f"http://127.0.0.1:{free_port()}")
    status, answer = post(port, "/sessions/j.1.1.1.2/v1/chat/completions", body, "ixs-any")
    assert status == 502 and answer["error"]["type"] == "upstream_error"
    assert post(port, "/sessions/j.1.1.1.1/v1/chat/completions", body, "ixs-any")[0] == 410
