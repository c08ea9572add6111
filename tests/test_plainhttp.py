"""The worker's own plain-http client (workers/plainhttp.py) against a real socket server that
answers with raw bytes: every framing a server may use, every way an answer can go wrong, and
the same answer (or the same class of failure, as the clients judge it) as the urllib3 path."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest
import requests

from broker.settings import Settings
from workers import http_transport as http
from workers.http_errors import describe, is_timeout, never_reached_server
from workers.plainhttp import PlainPool

CANNED: dict[str, bytes] = {
    "/length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: application/json\r\n\r\nhello",
    "/chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\n"),
    "/eof": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end",
    "/close": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    "/continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
    "/nocontent": b"HTTP/1.1 204 No Content\r\n\r\n",
    "/error": b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: 4\r\n\r\nbusy",
    "/repeated": b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 0\r\n\r\n",
    "/short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",  # then the server closes
    "/badchunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    "/garbage": b"SPDY/9 hello\r\n\r\n",
    "/nothing": b"",  # the server closes without answering
    "/big": b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000,
    "/bigchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"186a0\r\n" + b"x" * 100000
                   + b"\r\n0\r\n\r\n",
    "/blank-ext": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2 ;a=b\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
    "/early-hints": b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
}
# Answers no client may take as an answer. The connection stays open after each, as a server
# that goes on speaking on it would leave it.
MALFORMED: dict[str, bytes] = {
    # str.isdigit() takes "²" (int() does not); int() takes "+2" and "0_2"
    "/length-superscript": b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nok",
    "/length-signed": b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok",
    "/length-underscore": b"HTTP/1.1 200 OK\r\nContent-Length: 0_2\r\n\r\nok",
    "/length-huge": b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\nok",
    "/error-length-superscript": b"HTTP/1.1 503 Busy\r\nContent-Length: \xb2\r\n\r\nok",
    "/length-disagree": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    # int(x, 16) takes all three
    "/chunk-0x": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
    "/chunk-underscore": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0_2\r\nok\r\n0\r\n\r\n",
    "/chunk-sign": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\nok\r\n0\r\n\r\n",
    "/chunk-huge": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 40 + b"2\r\nok\r\n0\r\n\r\n",
    "/long-header": b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\nContent-Length: 2\r\n\r\nok",
    # the connection now speaks another protocol: nothing on it answers the request
    "/switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
}
CANNED.update(MALFORMED)
CLOSES_AFTER = {"/eof", "/close", "/short", "/badchunk", "/garbage", "/nothing"}


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv = self.server
        sock = self.request
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            n = int(hdrs.get("content-length", "0"))
            while len(buf) < n:
                buf += sock.recv(65536)
            body, buf = buf[:n], buf[n:]
            with srv.lock:
                srv.seen.append((method, path, hdrs, body))
            if path == "/slow":
                time.sleep(0.3)
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                continue
            if path == "/echo":
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                continue
            if path == "/hold":  # answers once the test says so
                srv.release.wait(30)
                sock.sendall(CANNED["/length"])
                continue
            if path == "/idle-close":  # answers, then closes the idle connection a moment later
                sock.sendall(CANNED["/length"])
                time.sleep(0.05)
                return
            if path not in CANNED:
                sock.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                continue
            sock.sendall(CANNED[path])
            if path in CLOSES_AFTER:
                return


class RawServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.seen: list = []
        self.accepted = 0
        self.release = threading.Event()

    def get_request(self):
        self.accepted += 1
        return super().get_request()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def raw_server():
    srv = RawServer()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _pools():
    session = http.make_session(Settings(), pool_size=4)
    return {"plain": http.HttpPool(session), "urllib3": http.HttpPool(session, plain=False)}


def _call(pool: http.HttpPool, url: str, *, method="GET", body=None, max_bytes=1 << 20, headers=None,
          budget_s: float = 10.0):
    return http.send(pool, method, url, deadline=time.monotonic() + budget_s, timeout=(2.0, 2.0),
                     max_bytes=max_bytes, what="test call", body=body, headers=headers)


def _outcome(pool, url, **kw):
    try:
        r = _call(pool, url, **kw)
    except requests.exceptions.RequestException as e:
        return ("error", type(e).__name__, describe(e), never_reached_server(e), is_timeout(e))
    except http.TooLarge:
        return ("too large",)
    return ("reply", r.status, r.body, r.headers.get("retry-after"), r.headers.get("Content-Type"))


def test_the_plain_path_is_taken_for_plain_http_and_not_for_tls_or_when_switched_off(raw_server):
    pools = _pools()
    assert isinstance(pools["plain"].pool_for(raw_server.url + "/x"), PlainPool)
    assert not isinstance(pools["urllib3"].pool_for(raw_server.url + "/x"), PlainPool)
    assert not isinstance(pools["plain"].pool_for("https://127.0.0.1:9/x"), PlainPool)
    client_off = http.PooledClient(Settings(http_plain_client=False))
    assert not isinstance(client_off.http.pool_for(raw_server.url + "/x"), PlainPool)


@pytest.mark.parametrize("path", ["/length", "/chunked", "/eof", "/close", "/continue", "/nocontent", "/error",
                                  "/short", "/badchunk", "/garbage", "/nothing", "/blank-ext", *MALFORMED])
def test_both_paths_give_the_same_answer_or_the_same_kind_of_failure(raw_server, path):
    pools = _pools()
    plain = _outcome(pools["plain"], raw_server.url + path)
    old = _outcome(pools["urllib3"], raw_server.url + path)
    assert plain == old, (path, plain, old)


def test_answers_are_read_in_every_framing(raw_server):
    pool = _pools()["plain"]
    assert _call(pool, raw_server.url + "/length").body == b"hello"
    assert _call(pool, raw_server.url + "/chunked").body == b"hello"
    assert _call(pool, raw_server.url + "/eof").body == b"until the end"
    r = _call(pool, raw_server.url + "/continue")
    assert (r.status, r.body) == (201, b"ok")
    r = _call(pool, raw_server.url + "/error")
    assert (r.status, r.body, r.headers["RETRY-AFTER"]) == (503, b"busy", "7")
    assert _call(pool, raw_server.url + "/repeated").headers.get("x-a") == "1, 2"
    assert _call(pool, raw_server.url + "/bigchunked").body == b"x" * 100000
    assert _call(pool, raw_server.url + "/blank-ext").body == b"hello"  # blanks before a chunk extension


@pytest.mark.parametrize("path", list(MALFORMED))
def test_a_malformed_answer_is_a_protocol_error_and_its_connection_is_not_reused(raw_server, path):
    """Every malformed answer is a transport failure as ``requests`` reports one (which the
    clients retry), on both paths; never a ValueError, never an answer, and the connection it
    came on is closed."""
    for name, pool in _pools().items():
        before = raw_server.accepted
        out = _outcome(pool, raw_server.url + path)
        if path.startswith("/chunk"):  # both paths say so for any bad chunk
            assert out[1:] == ("ChunkedEncodingError", "connection dropped while reading the answer", False, False)
        else:  # it reached the server, and it was no timeout
            assert out[1:] == ("ConnectionError", "malformed HTTP answer", False, False), (name, out)
        assert _call(pool, raw_server.url + "/length").body == b"hello", name
        assert raw_server.accepted == before + 2, name  # the second call had a new connection


def test_an_interim_answer_never_leaves_the_real_one_for_the_next_call(raw_server):
    """http.client skips only a 100: urllib3 handed a 103 over as a bodiless answer and left
    the real one on the pooled connection, where the next call read it as its own."""
    for name, pool in _pools().items():
        try:
            first = _call(pool, raw_server.url + "/early-hints")
        except requests.exceptions.ConnectionError:
            first = None  # the urllib3 path cannot skip it: a protocol error, the connection closed
        else:
            assert (first.status, first.body) == (200, b"ok"), name
        assert _call(pool, raw_server.url + "/length").body == b"hello", name


def test_a_body_over_the_cap_is_too_large_whether_declared_or_chunked(raw_server):
    pool = _pools()["plain"]
    for path in ("/big", "/bigchunked", "/eof"):
        with pytest.raises(http.TooLarge):
            _call(pool, raw_server.url + path, max_bytes=5)


def test_keep_alive_reuses_one_connection_and_close_is_honoured(raw_server):
    pool = _pools()["plain"]
    for _ in range(5):
        assert _call(pool, raw_server.url + "/length").body == b"hello"
    assert raw_server.accepted == 1
    _call(pool, raw_server.url + "/close")
    _call(pool, raw_server.url + "/length")
    assert raw_server.accepted == 2  # the closed one was not reused


def test_a_connection_the_server_closed_while_idle_is_not_reused(raw_server):
    pool = _pools()["plain"]
    assert _call(pool, raw_server.url + "/idle-close").body == b"hello"
    time.sleep(0.3)  # the server has closed it by now
    assert _call(pool, raw_server.url + "/length").body == b"hello"
    assert raw_server.accepted == 2


def test_requests_carry_body_headers_and_host(raw_server):
    pool = _pools()["plain"]
    r = _call(pool, raw_server.url + "/echo", method="POST", body=b'{"a":1}', headers={"Authorization": "Bearer k"})
    assert r.body == b'{"a":1}'
    method, path, hdrs, body = raw_server.seen[-1]
    assert (method, path, body) == ("POST", "/echo", b'{"a":1}')
    assert hdrs["host"] == f"127.0.0.1:{raw_server.server_address[1]}"
    assert hdrs["content-type"] == "application/json" and hdrs["authorization"] == "Bearer k"
    assert hdrs["content-length"] == "7" and hdrs["accept-encoding"] == "identity"


@pytest.mark.parametrize("path", ["/length HTTP/1.1\r\nX-Evil: 1\r\n\r\nGET /x", "/len\x00gth", "/caf\u00e9"])
def test_a_path_that_could_split_the_request_goes_percent_encoded_in_one_request(raw_server, path):
    for name, pool in _pools().items():
        raw_server.seen.clear()
        assert _call(pool, raw_server.url + path).status == 404
        assert len(raw_server.seen) == 1, name
        seen_path, hdrs = raw_server.seen[0][1], raw_server.seen[0][2]
        assert "x-evil" not in hdrs and seen_path.isascii() and " " not in seen_path, (name, seen_path)
        assert seen_path.startswith("/len") or seen_path.startswith("/caf")


@pytest.mark.parametrize("headers", [{"X-Token": "a\r\nX-Evil: 1"}, {"X-Token": "a\nb"}, {"X-Evil: 1\r\nX": "v"}])
def test_a_header_that_could_split_the_request_is_refused_before_anything_is_sent(raw_server, headers):
    for pool in _pools().values():
        with pytest.raises(ValueError):
            _call(pool, raw_server.url + "/length", headers=headers)
    assert raw_server.seen == [] and raw_server.accepted == 0


@pytest.mark.unit
def test_a_refused_connection_never_reached_the_server_on_both_paths():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    for name, pool in _pools().items():
        out = _outcome(pool, f"http://127.0.0.1:{port}/x")
        assert out[0] == "error" and out[3] is True, (name, out)


def test_a_silent_server_is_a_read_timeout_and_the_budget_ends_a_slow_one(raw_server):
    pool = _pools()["plain"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        http.send(pool, "GET", raw_server.url + "/slow", deadline=time.monotonic() + 10, timeout=(2.0, 0.05),
                  max_bytes=100, what="t")
    from broker.errors import EPISODE_TIMEOUT, EpisodeError
    with pytest.raises(EpisodeError) as ei:
        http.send(pool, "GET", raw_server.url + "/slow", deadline=time.monotonic() + 0.05, timeout=(2.0, 5.0),
                  max_bytes=100, what="t")
    assert ei.value.reason == EPISODE_TIMEOUT


def test_connections_are_capped_and_callers_wait_for_a_free_one(raw_server):
    session = http.make_session(Settings(), pool_size=2)
    pool = http.HttpPool(session)
    results: list = []

    def worker():
        results.append(_call(pool, raw_server.url + "/slow").body)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [b"ok"] * 6
    assert raw_server.accepted == 2
    assert pool.pool_for(raw_server.url + "/slow").opened == 2


def _call_left_armed(name: str, pool: http.HttpPool, url: str, deadline: float):
    """A call over ``pool`` that stops where a call's connection is back in the pool and its
    watchdog not yet disarmed (``send`` disarms it a moment later): its watch."""
    http._calls.deadline, http._calls.watch = deadline, None
    try:
        origin_pool = pool.pool_for(url)
        if name == "plain":
            origin_pool.exchange("GET", "/length", None, None, deadline=deadline, timeout=(2.0, 2.0), max_bytes=1 << 20,
                                 error_bytes=1 << 16, what="A", arm=http._arm, too_large=http.TooLarge)
        else:
            http._exchange(origin_pool, "GET", "/length", {}, None, deadline=deadline, timeout=(2.0, 2.0),
                           max_bytes=1 << 20, what="A", started=time.monotonic())
        return http._calls.watch
    finally:
        http._calls.deadline = http._calls.watch = None


def test_a_call_ending_at_its_deadline_cannot_cut_the_next_call_on_its_connection(raw_server):
    """The watchdog of a call whose deadline passes after its connection went back to the
    pool must not shut down that socket once the next call took it."""
    for name, pool in _pools().items():
        raw_server.release.clear()
        accepted = raw_server.accepted
        a_deadline = time.monotonic() + 1.0
        a_watch = _call_left_armed(name, pool, raw_server.url + "/length", a_deadline)
        assert a_watch is not None and not a_watch.fired, name
        results: list = []
        b = threading.Thread(target=lambda: results.append(_outcome(pool, raw_server.url + "/hold")))
        b.start()  # the next call, on the same connection, answered after A's deadline
        while time.monotonic() < a_deadline + 0.5:
            time.sleep(0.05)
        assert not a_watch.fired, name
        raw_server.release.set()
        b.join(30)
        assert results and results[0][:3] == ("reply", 200, b"hello"), (name, results)
        assert raw_server.accepted == accepted + 1, name  # B took A's connection
