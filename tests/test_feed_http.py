"""The feed server's HTTP edge over raw sockets: which requests it answers (Host, Origin,
Sec-Fetch-Site, JSON bodies when it has no token), what one client can hold (a request's head
and body in bounded time, a bounded number of connections, a Content-Length checked before
any read), that no answer carries a number JSON does not have, and that a client done sending
is answered like any other. A real FeedService over the
session's Redis and a SQLite store; the server is interactor/feedserve.py's, on loopback."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest
import requests

from broker import feed
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import FeedGroup, JobSpec, StepRecord
from broker.states import FeedGroupStatus
from consumer.storage import open_store
from interactor.feed_service import FeedService
from interactor.feed_client import Feed, FeedHTTPError
from interactor.feedserve import MAX_BODY, FeedApp, make_server
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

JOB = "jobhttp"


@pytest.fixture
def service(settings, redis_client, tmp_path):
    """A job with a feed and nothing produced: the routes answer from Redis and the store."""
    keys = Keys(settings.key_prefix)
    Ledger.for_settings(redis_client, settings).create_job(
        JobSpec(job_id=JOB, llm_base_url="http://llm/v1", model="m", episodes=0, groups=0), [])
    feed.enable(redis_client, keys, JOB, feed.FeedConfig(max_ahead=8))
    store = open_store(str(tmp_path / "results.sqlite"))
    yield FeedService(redis_client, settings, JOB, store)
    store.close()


def one_step(job_id: str, episode_id: str, group_id: str) -> StepRecord:
    return StepRecord(job_id=job_id, env_id=episode_id, attempt=1, step_id=1, env_name="x", llm_model="m",
                      group_id=group_id, messages_json=b"[]", response="r", step_reward=0.0, cumulative_reward=0.0,
                      terminated=True, truncated=False, episode_finished=True, is_trainable=True, attempt_id="a1")


@contextmanager
def served(svc, token: str = "", **kw):
    server = make_server(FeedApp(svc), "127.0.0.1", 0, token, **kw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def send(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, dict]:
    """One request with exactly these headers (Host too, unless left out: then none is sent);
    the status and the JSON answer, parsed strictly (no NaN, no Infinity)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw, parse_constant=_not_json) if raw else {}
    finally:
        conn.close()


def _not_json(name: str):
    raise AssertionError(f"the answer holds {name}, which is not JSON")


def own(port: int, body: bytes, **extra) -> dict:
    """What a trainer's client sends: its own Host, a JSON body with its length."""
    return {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
            **extra}


# --- C2: a feed without a token answers its own trainers only --------------------------------------
def test_a_web_pages_post_version_is_refused_and_the_version_unchanged(service):
    """The review's repro: a page on evil.example, its name pointed at 127.0.0.1, posts a
    version as text/plain (no preflight). Refused, naming why; the version is not stored."""
    with served(service) as server:
        port = server.server_address[1]
        body = b'{"version": 999}'
        status, answer = send(port, "POST", "/version", body, {
            "Host": "evil.example", "Origin": "http://evil.example", "Content-Type": "text/plain",
            "Content-Length": str(len(body))})
        assert status == 403 and "evil.example" in answer["error"] and "DNS rebinding" in answer["error"]
        assert feed.current_version(service.r, service.keys, JOB) is None


@pytest.mark.parametrize("what, headers, status, says", [
    ("another name", {"Host": "evil.example:{port}"}, 403, "not this server's address"),
    ("no Host", {"Host": None}, 403, "missing"),
    ("the right port on another name", {"Host": "127.0.0.1.evil.example:{port}"}, 403, "not this server's address"),
    ("a foreign Origin", {"Origin": "http://evil.example"}, 403, "cross-origin"),
    ("Origin null", {"Origin": "null"}, 403, "cross-origin"),
    ("Sec-Fetch-Site cross-site", {"Sec-Fetch-Site": "cross-site"}, 403, "cross-site"),
    ("text/plain", {"Content-Type": "text/plain"}, 415, "application/json"),
    ("a form", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
    ("no Content-Type", {"Content-Type": None}, 415, "application/json"),
])
def test_each_mark_of_a_cross_site_request_is_refused(service, what, headers, status, says):
    with served(service) as server:
        port = server.server_address[1]
        body = b'{"version": 7}'
        sent = own(port, body)
        for name, value in headers.items():
            if value is None:
                sent.pop(name)
            else:
                sent[name] = value.format(port=port)
        got, answer = send(port, "POST", "/version", body, sent)
        assert (got, says in answer["error"]) == (status, True), (what, got, answer)
        assert feed.current_version(service.r, service.keys, JOB) is None, what
        # /health too answers only its own address: it names the job
        if headers.get("Host"):
            assert send(port, "GET", "/health", headers={"Host": sent["Host"]})[0] == 403


def test_trainers_clients_keep_working_without_a_token(service):
    """The stdlib client, requests' json=, curl with a JSON content type, by every loopback
    name the server answers to; the version each set is the one stored."""
    with served(service) as server:
        port = server.server_address[1]
        assert Feed(f"http://127.0.0.1:{port}").set_version(1) == 1
        assert Feed(f"http://localhost:{port}").set_version(2) == 2
        assert requests.post(f"http://127.0.0.1:{port}/version", json={"version": 3}, timeout=10).json() == \
            {"version": 3}
        out = subprocess.run(["curl", "-sS", "-X", "POST", "-H", "Content-Type: application/json", "-d",
                              '{"version": 4}', f"http://localhost:{port}/version"],
                             capture_output=True, text=True, timeout=30)
        assert json.loads(out.stdout) == {"version": 4}, out.stderr
        # a same-origin request (what a page of the server's own would send) is no cross-site one
        body = b'{"version": 5}'
        assert send(port, "POST", "/version", body, own(port, body, Origin=f"http://127.0.0.1:{port}",
                                                         **{"Sec-Fetch-Site": "same-origin"}))[0] == 200
        assert Feed(f"http://127.0.0.1:{port}").version() == 5
        assert feed.current_version(service.r, service.keys, JOB) == 5


def test_with_a_token_the_token_decides(service):
    """Bound with a token (required beyond loopback), any name may be used: people reach such a
    server by names it cannot know, and a page cannot send the token."""
    with served(service, token="tok-abc") as server:
        port = server.server_address[1]
        body = b'{"version": 6}'
        assert send(port, "POST", "/version", body, own(port, body, Host="feed.example"))[0] == 401
        got, _ = send(port, "POST", "/version", body, own(port, body, Host="feed.example",
                                                          Authorization="Bearer tok-abc"))
        assert got == 200 and feed.current_version(service.r, service.keys, JOB) == 6
        with pytest.raises(FeedHTTPError) as err:
            Feed(f"http://127.0.0.1:{port}", token="wrong").version()
        assert err.value.status == 401


# --- C7: what one client can hold ---------------------------------------------------------------
def server_threads(server) -> int:
    """Request threads of ``server`` alone: an earlier test's server in this process (make
    test runs other files' tests in it too) may still have some."""
    return sum(1 for t in threading.enumerate()
               if "process_request_thread" in t.name and getattr(getattr(t, "_target", None), "__self__", None) is server)


def drained(s: socket.socket) -> bool:
    """Read until the server closes the connection (EOF, or a reset for one it refused)."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_idle_half_requests_are_dropped_at_the_timeout_and_a_trainer_is_served(service):
    """200 connections that send half a request line and nothing more: at most the connection
    limit of them get a thread, each is closed by the request timeout, and a normal request
    is served afterwards. Over the limit a connection is refused at once, not left waiting."""
    timeout_s, limit = 2.0, 16
    with served(service, request_timeout_s=timeout_s, max_connections=limit) as server:
        port = server.server_address[1]
        idle = []
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 30)
            s.sendall(b"POST /take HTT")
            idle.append(s)
        assert server_threads(server) <= limit
        t0 = time.monotonic()
        for s in idle:
            assert drained(s)  # a socket timeout (the server holding on) fails the test here
            s.close()
        assert time.monotonic() - t0 < timeout_s + 30
        wait_for(lambda: server_threads(server) == 0, 30, what="the idle connections' threads gone")
        body = b'{"version": 8}'
        assert send(port, "POST", "/version", body, own(port, body))[0] == 200


def test_over_the_connection_limit_a_connection_is_answered_503_at_once(service):
    with served(service, request_timeout_s=60.0, max_connections=4) as server:
        port = server.server_address[1]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
        for s in idle:
            s.sendall(b"GET /hea")
        wait_for(lambda: server_threads(server) == 4, 30, what="four connections served")
        t0 = time.monotonic()
        try:
            status, answer = send(port, "GET", "/health", headers={"Host": f"127.0.0.1:{port}"}, timeout=30)
            assert status == 503 and "INTERACTOR_FEED_MAX_CONNECTIONS" in answer["error"], (status, answer)
        except ConnectionResetError:
            pass  # refused before its answer was read: refused all the same
        assert time.monotonic() - t0 < 10
        for s in idle:
            s.close()
        wait_for(lambda: server_threads(server) == 0, 30, what="the four connections' threads gone")
        assert send(port, "GET", "/health", headers={"Host": f"127.0.0.1:{port}"})[0] == 200


def test_a_trickled_request_head_is_cut_at_the_timeout(service):
    """A client that sends its head a byte every 0.2 s never lets a read time out; the request
    as a whole is cut at the timeout all the same."""
    timeout_s = 1.5
    with served(service, request_timeout_s=timeout_s) as server:
        port = server.server_address[1]
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: {'a' * 300}\r\n\r\n".encode()
        t0 = time.monotonic()
        cut = None
        for i in range(len(head)):  # 300+ bytes at 0.2 s: a minute were it not cut
            try:
                s.sendall(head[i:i + 1])
            except OSError:
                cut = time.monotonic() - t0
                break
            s.settimeout(0.2)
            try:
                if s.recv(4096) == b"":
                    cut = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                cut = time.monotonic() - t0
                break
        s.close()
        assert cut is not None and cut < timeout_s + 10, cut


def test_a_kept_alive_connection_waits_no_longer_than_the_timeout(service):
    """Idle between two requests counts as waiting for the next head."""
    with served(service, request_timeout_s=1.0) as server:
        port = server.server_address[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        t0 = time.monotonic()
        assert drained(conn.sock)
        assert time.monotonic() - t0 < 15
        conn.close()


@pytest.mark.parametrize("length, status, says", [
    ("-1", 400, "non-negative integer"),
    ("\u00b2", 400, "non-negative integer"),  # a digit to str.isdigit(), not to HTTP
    ("+3", 400, "non-negative integer"),
    ("0x10", 400, "non-negative integer"),
    ("1 2", 400, "non-negative integer"),
    (str(MAX_BODY + 1), 413, "over"),
    ("9" * 5000, 413, "over"),  # more digits than int() parses
])
def test_a_content_length_that_is_no_length_is_refused_before_any_read(service, length, status, says):
    """Refused at once with the connection left open (the body is never waited for), and
    the version unchanged."""
    with served(service) as server:
        port = server.server_address[1]
        s = socket.create_connection(("127.0.0.1", port), timeout=15)
        head = (f"POST /version HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n").encode("latin-1")
        s.sendall(head + b'{"version": 9}')
        resp = http.client.HTTPResponse(s)
        resp.begin()  # a socket timeout here: the server waited for a body
        answer = json.loads(resp.read())
        s.close()
        assert resp.status == status and says in answer["error"], (resp.status, answer)
        assert feed.current_version(service.r, service.keys, JOB) is None


def test_a_negative_length_does_not_lift_the_body_limit(service):
    """The review's repro: 3 MiB with ``Content-Length: -1`` and the connection closed after
    it was answered 200; the same body with its real length 413."""
    with served(service) as server:
        port = server.server_address[1]
        body = b'{"version": 10, "pad": "' + b"x" * (3 << 20) + b'"}'
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"POST /version HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  "Content-Length: -1\r\n\r\n".encode())
        try:
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed first
        resp = http.client.HTTPResponse(s)
        resp.begin()
        resp.read()
        s.close()
        assert resp.status == 400
        # Its real length is refused from the head alone: the answer comes before any of the
        # body is sent (a client still pushing 3 MiB would meet the closed connection).
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"POST /version HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode())
        resp = http.client.HTTPResponse(s)
        resp.begin()
        resp.read()
        s.close()
        assert resp.status == 413
        assert feed.current_version(service.r, service.keys, JOB) is None


def test_a_post_needs_a_content_length(service):
    with served(service) as server:
        port = server.server_address[1]
        headers = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json"}
        status, answer = send(port, "POST", "/take", b"", headers)
        assert status == 411 and "Content-Length" in answer["error"]
        status, answer = send(port, "POST", "/take", b"0\r\n\r\n", {**headers, "Transfer-Encoding": "chunked"})
        assert status == 411 and "Transfer-Encoding" in answer["error"]


def test_a_long_poll_outlasts_the_request_timeout(service):
    """/take's wait is the server's, not a read: a take that waits longer than the request
    timeout is answered when its own timeout ends."""
    with served(service, request_timeout_s=1.0) as server:
        port = server.server_address[1]
        body = b'{"trainer": "t", "batch": 1, "timeout": 3}'
        t0 = time.monotonic()
        status, answer = send(port, "POST", "/take", body, own(port, body))
        assert status == 200 and answer == {"groups": []} and time.monotonic() - t0 >= 2.9


# --- C11: answers are JSON ----------------------------------------------------------------------
def test_a_group_with_an_infinite_reward_goes_out_as_json(service):
    """A group whose stored reward is infinite (a worker before totals were checked) is
    delivered with that reward and every advantage null, in an answer a strict JSON parser
    reads; a finite group beside it keeps its numbers."""
    keys = service.keys
    for gid, rewards in (("g-inf", [float("inf"), 1.0]), ("g-ok", [1.0, 0.0])):
        members = [f"{gid}.1", f"{gid}.2"]
        service.store.write_batch([one_step(JOB, ep, gid) for ep in members])  # a group is delivered with its steps
        group = FeedGroup(job_id=JOB, group_id=gid, status=FeedGroupStatus.READY, members=members,
                          rewards=rewards, size=2)
        assert feed.announce(service.r, keys, group.pack(), JOB, gid)
    with served(service) as server:
        port = server.server_address[1]
        body = b'{"trainer": "t", "batch": 2, "timeout": 5}'
        status, answer = send(port, "POST", "/take", body, own(port, body))
        assert status == 200, answer
        got = {g["group_id"]: g for g in answer["groups"]}
        bad = got["g-inf"]["samples"]
        assert [x["reward"] for x in bad] == [None, 1.0] and [x["advantage"] for x in bad] == [None, None]
        good = got["g-ok"]["samples"]
        assert [x["reward"] for x in good] == [1.0, 0.0] and good[0]["advantage"] > 0 > good[1]["advantage"]


def test_a_request_with_a_non_json_number_is_refused(service):
    with served(service) as server:
        port = server.server_address[1]
        body = b'{"trainer": "t", "batch": 1, "timeout": NaN}'
        status, answer = send(port, "POST", "/take", body, own(port, body))
        assert status == 400 and "NaN" in answer["error"]


def test_a_body_nested_past_what_the_json_reader_takes_is_refused_in_one_line(service, caplog):
    """200,000 ``[``: Python's JSON reader gives up with a RecursionError, not a ValueError. A 400
    saying so, not a 500 with a traceback in the log; the server answers the next request."""
    with served(service) as server, caplog.at_level(logging.ERROR, logger="interactor.feedserve"):
        port = server.server_address[1]
        body = b"[" * 200_000
        status, answer = send(port, "POST", "/take", body, own(port, body))
        assert status == 400 and "nested too deeply" in answer["error"], answer
        assert send(port, "GET", "/health", headers={"Host": f"127.0.0.1:{port}"})[0] == 200
    assert not [r for r in caplog.records if r.name == "interactor.feedserve"], caplog.text


# --- D10: a client done sending is not a client gone ---------------------------------------------
def announce_with_steps(svc, gid: str) -> None:
    members = [f"{gid}.1", f"{gid}.2"]
    svc.store.write_batch([one_step(JOB, ep, gid) for ep in members])  # a group is delivered with its steps
    group = FeedGroup(job_id=JOB, group_id=gid, status=FeedGroupStatus.READY, members=members, rewards=[1.0, 0.0],
                      size=2)
    assert feed.announce(svc.r, svc.keys, group.pack(), JOB, gid)


def half_closed(port: int, request: bytes) -> tuple[int, dict]:
    """Send ``request``, shut the sending side (a FIN: done sending, still reading) and read the
    answer to the end of the connection: its status and JSON (0 and {} for no answer at all)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    finally:
        s.close()
    if not raw:
        return 0, {}
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_client_that_half_closes_after_its_request_is_answered_and_keeps_its_groups(service):
    """A FIN after a complete request says the client is done sending, not gone (HTTP/1.1 allows
    it, and some clients and tools do it). The review's repro, ``GET /health`` with ``Connection:
    close``, is answered; so is a ``/take``, and its group stays the taker's: not handed to the next
    take, acknowledged by it. (A client that closed its connection sends the same FIN; its groups
    are given back: tests/test_feed_trust.py.)"""
    announce_with_steps(service, "g1")
    announce_with_steps(service, "g2")
    with served(service) as server:
        port = server.server_address[1]
        status, answer = half_closed(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                           "Connection: close\r\n\r\n".encode())
        assert (status, answer.get("status")) == (200, "ok"), answer
        body = b'{"trainer": "a", "batch": 1, "timeout": 5}'
        head = "".join(f"{k}: {v}\r\n" for k, v in own(port, body).items())
        status, answer = half_closed(port, f"POST /take HTTP/1.1\r\n{head}\r\n".encode() + body)
        assert status == 200 and len(answer["groups"]) == 1, answer
        taken = answer["groups"][0]["group_id"]
        # Settled before the server closed the connection: the next take has only the other group.
        body = b'{"trainer": "b", "batch": 2, "timeout": 1}'
        status, answer = send(port, "POST", "/take", body, own(port, body))
        assert status == 200 and [g["group_id"] for g in answer["groups"]] == [{"g1": "g2", "g2": "g1"}[taken]]
        assert service.ack("a", [taken]) == {"acked": [taken], "already": []}


def test_messages_prompt_and_answer_mean_what_docs_training_md_says_on_every_surface(settings, redis_client,
                                                                                      service, tmp_path):
    """`messages` was the prompt in the store and /take, the prompt plus the answer in the export
    and /get_rollout_data, and nothing else said which: code moving between them doubled or
    lost the completion. The contracts keep their `messages`; `prompt` is the prompt on every
    surface (docs/training.md, "What `messages` holds, where"), over real HTTP and the real
    export."""
    from broker.records import AttemptRecord
    from consumer.export import export_training
    from tests.conftest import ROOT

    keys = Keys(settings.key_prefix)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    answer = {"role": "assistant", "content": "4"}
    for g in ("ga", "gb"):
        service.store.write_batch([StepRecord(
            job_id=JOB, env_id=f"{g}.1", attempt=1, step_id=1, env_name="x", llm_model="m", group_id=g,
            messages_json=json.dumps(prompt).encode(), response="4", step_reward=1.0, cumulative_reward=1.0,
            terminated=True, truncated=False, episode_finished=True, is_trainable=True, attempt_id="a1"),
            AttemptRecord(job_id=JOB, episode_id=f"{g}.1", attempt=1, status="completed", group_id=g, group_size=1,
                          env_name="x", llm_model="m", total_reward=1.0, steps=1, attempt_id="a1",
                          started_at=1000.0, finished_at=1001.0, ended_by="terminated")])
        feed.announce(redis_client, keys, FeedGroup(job_id=JOB, group_id=g, status=FeedGroupStatus.READY,
                                                    members=[f"{g}.1"], rewards=[1.0], size=1).pack(), JOB, g)
    with served(service) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (group,) = Feed(url, trainer="t").take(1, timeout=5)
        (step,) = group["samples"][0]["steps"]
        assert step["messages"] == prompt and step["response"] == "4"
        body = requests.post(url + "/get_rollout_data", json={"batch_size": 1, "timeout": 5}, timeout=30).json()
        (item,) = body["data"]["data"]
        assert item["messages"] == prompt + [answer]  # the original buffer server's, unchanged
        assert item["prompt"] == prompt
    out = tmp_path / "rows.jsonl"
    export_training(service.store, JOB, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["prompt"] == prompt and r["messages"] == prompt + [answer] for r in rows)
    assert all(r["completion"] == [answer] for r in rows)
    doc = (ROOT / "docs" / "training.md").read_text()
    assert "### What `messages` holds, where" in doc and "`/get_rollout_data` items" in doc
