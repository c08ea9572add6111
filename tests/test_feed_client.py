"""The trainers' client of the rollout feed (interactor/feed_client.py) against real HTTP
servers on loopback: where its token may go."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from interactor.feed_client import Feed, FeedHTTPError

TOKEN = "s3cret-feed-token"


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with the server's ``answer`` (status, headers, JSON body) and
    records the method, path and Authorization header it came with."""

    def log_message(self, *args):  # quiet
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        srv = self.server
        with srv.lock:
            srv.seen.append((self.command, self.path, self.headers.get("Authorization")))
        status, headers, body = srv.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def servers():
    made = []

    def serve(status: int, body: dict, headers: dict | None = None) -> ThreadingHTTPServer:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        srv.daemon_threads = True
        srv.lock, srv.seen, srv.answer = threading.Lock(), [], (status, headers or {}, body)
        srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        made.append(srv)
        return srv

    yield serve
    for srv in made:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_an_error_naming_where_and_the_token_goes_nowhere_else(servers, status):
    """urllib.request copies Authorization to the host a redirect names: another port on
    loopback received the feed's token. Now no redirect is followed."""
    other = servers(200, {"groups": [{"group_id": "g-from-elsewhere"}], "version": 9})
    feed = servers(status, {}, {"Location": other.url + "/take"})
    client = Feed(feed.url, trainer="t1", token=TOKEN, timeout_s=10)
    with pytest.raises(FeedHTTPError) as err:
        client.take(1, timeout=0)
    assert err.value.status == status
    assert other.url + "/take" in str(err.value) and "not followed" in str(err.value)
    with pytest.raises(FeedHTTPError):
        client.version()  # a GET, which urllib follows on every redirect code
    assert other.seen == []
    assert [(m, p, a) for m, p, a in feed.seen] == [("POST", "/take", f"Bearer {TOKEN}"),
                                                    ("GET", "/version", f"Bearer {TOKEN}")]


def test_answers_and_error_answers_still_read(servers):
    ok = servers(200, {"version": 4})
    assert Feed(ok.url, token=TOKEN).version() == 4
    refused = servers(401, {"error": "bad token"})
    with pytest.raises(FeedHTTPError) as err:
        Feed(refused.url, token="wrong").stats()
    assert err.value.status == 401 and "bad token" in str(err.value)
