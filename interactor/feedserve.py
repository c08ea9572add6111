"""The online-RL feed's HTTP server: routes, bodies, the bearer token, and which requests and
connections it takes (interactor/feed_service.py does the work; interactor/feedcmd.py is the command
that runs it).

Routes (JSON bodies; docs/protocol.md, "The rollout feed"):

* ``POST /take`` ``{trainer, batch, timeout}`` -> ``{groups: [...]}``
* ``POST /ack`` ``{trainer, ids}`` -> ``{acked, already}``; 404 naming an unknown or foreign group
* ``GET /version`` / ``POST /version`` ``{version}``; 409 when it goes backwards
* ``GET /stats``
* the original buffer server's ``POST /get_rollout_data``, ``POST /start_rollout`` and ``GET /health``

Bound to 127.0.0.1 unless told otherwise; bound anywhere else it requires a token
(``INTERACTOR_FEED_TOKEN``, sent as ``Authorization: Bearer <token>``), checked on every route
but ``/health``. Without a token, a request must name this server in its Host header and
nothing in it may say another site sent it (interactor/webguard.py): a web page the operator
opens could otherwise take groups, move the version or start a job, and read the answers by
DNS rebinding. POST bodies are JSON (``Content-Type: application/json``, a ``Content-Length``
up to ``MAX_BODY``), which a page cannot send to another site without a preflight we never
answer.

What one client can hold: a request's head and body must arrive within
``feed_request_timeout_s`` (in all, however slowly they trickle), and at most
``feed_max_connections`` connections are served at once; one more is answered 503 and closed.
A long-polling ``/take`` holds its connection while it waits (the wait is ours, not a read).

Groups an answer hands out are the client's once the answer is written, and go to the next take
when it could not be. A client that shut its sending side after its request (a FIN) is answered
like any other; since one that closed the connection sends the same FIN, its answer counts as
delivered once the client's end acknowledged it, not reset it.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import math
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from broker import feed
from broker.settings import SettingsError
from interactor.webguard import allowed_hosts, cross_site_refusal, is_loopback

log = logging.getLogger("interactor.feedserve")

MAX_BODY = 1 << 20
MAX_CONNECTIONS = 64  # the settings' default (feed_max_connections)
REQUEST_TIMEOUT_S = 20.0  # the settings' default (feed_request_timeout_s)
JSON_TYPE = "application/json"


class FeedApp:
    """What the routes call: a FeedService once a job is served. ``start`` (a server that runs
    its own fleet) makes one from ``/start_rollout``'s body; without it that route is refused."""

    def __init__(self, service=None, start: Callable[[dict], Any] | None = None):
        self.service = service
        self.start = start
        self.lock = threading.Lock()

    def need(self):
        if self.service is None:
            raise feed.FeedError("no rollout is running: POST /start_rollout first", 409)
        return self.service


def make_server(app: FeedApp, host: str, port: int, token: str = "", *, max_connections: int = MAX_CONNECTIONS,
                request_timeout_s: float = REQUEST_TIMEOUT_S) -> "FeedHTTPServer":
    if not is_loopback(host) and not token:
        raise SettingsError(f"the feed is bound to {host}, beyond this machine: set INTERACTOR_FEED_TOKEN")
    return FeedHTTPServer((host, port), app, token, max_connections=max_connections,
                          request_timeout_s=request_timeout_s)


class FeedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], app: FeedApp, token: str, *, max_connections: int,
                 request_timeout_s: float):
        super().__init__(address, FeedHandler)
        self.app = app
        self.token = token
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.slots = threading.BoundedSemaphore(max_connections)
        # Without a token, the Host values a request may carry (with one, the token decides).
        self.hosts = None if token else allowed_hosts(address[0], self.server_address[1])
        self.refused_busy = 0  # connections refused at the limit (logged once a minute at most)
        self._busy_logged_at = -math.inf

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused_busy += 1
            if time.monotonic() - self._busy_logged_at > 60:
                self._busy_logged_at = time.monotonic()
                log.warning("feed: %d connections open, the limit (INTERACTOR_FEED_MAX_CONNECTIONS); one from %s "
                            "refused (%d so far)", self.max_connections, client_address[0], self.refused_busy)
            _answer_busy(request, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _answer_busy(sock: socket.socket, limit: int) -> None:
    """A 503 sent without waiting (a fresh socket's buffer takes it), on the accepting thread."""
    body = json.dumps({"success": False, "error": f"the feed server has {limit} connections open, its limit "
                                                  "(INTERACTOR_FEED_MAX_CONNECTIONS); try again"}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: {JSON_TYPE}\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.setblocking(False)
        sock.send(head + body)
    except OSError:
        pass


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the handler's deadline: a client
    that trickles a byte at a time cannot stretch one request's head and body past it."""

    def __init__(self, handler: "FeedHandler"):
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        h = self.handler
        if h.deadline is not None:
            left = h.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request not received within {h.timeout:g} s")
            h.connection.settimeout(min(left, h.timeout))
        return h.connection.recv_into(buf)


def _finite(value):
    """``value`` with every float that JSON cannot carry (NaN, infinities) as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_answer(body: dict) -> bytes:
    try:
        return json.dumps(body, allow_nan=False).encode()
    except ValueError:  # a NaN or an infinity somewhere: JSON has none, so they go out as null
        log.warning("feed answer held a number JSON cannot carry (NaN or infinity); sent as null")
        return json.dumps(_finite(body), allow_nan=False).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class FeedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FeedHTTPServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # also each write's bound
        self.deadline: float | None = None
        super().setup()
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self) -> None:
        # From the first byte of a request (or of the wait for it, on a kept-alive connection)
        # to the end of its body; the route's own time (a long poll) is not bounded by it.
        self.deadline = time.monotonic() + self.timeout
        super().handle_one_request()

    def log_message(self, fmt, *args):  # noqa: A002 - the base class's name
        log.debug("feed %s " + fmt, self.client_address[0], *args)

    def _send(self, status: int, body: dict) -> bool:
        """Write the answer; whether the client has it: False when it is gone (before or while
        writing, or it answered what was written with a reset)."""
        data = _json_answer(body)
        if status >= 400:  # the body may be unread: what follows on the connection is not a request
            self.close_connection = True
        peer = _peer(self.connection)
        if peer == PEER_GONE:
            self.close_connection = True
            return False
        if peer == PEER_DONE_SENDING:  # it sends no further request
            self.close_connection = True
        try:
            self.connection.settimeout(self.timeout)
            self.send_response(status)
            self.send_header("Content-Type", JSON_TYPE)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError as exc:  # the client left, or stopped reading
            self.close_connection = True
            log.debug("feed answer to %s not sent: %s", self.client_address[0], exc)
            return False
        if peer == PEER_DONE_SENDING:
            return _taken_in(self.connection, self.timeout)
        return True

    def _content_length(self) -> int:
        """The body's length, refused before any of it is read unless it is one non-negative
        ASCII integer up to MAX_BODY."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise feed.FeedError("send the body with a Content-Length (Transfer-Encoding is not accepted)", 411)
        given = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not given:
            raise feed.FeedError("a POST needs a Content-Length", 411)
        if len(given) > 1:
            raise feed.FeedError(f"conflicting Content-Length values: {', '.join(sorted(given))}")
        (raw,) = given
        if not (raw.isascii() and raw.isdigit()):
            raise feed.FeedError(f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
        if len(raw.lstrip("0")) > len(str(MAX_BODY)) or int(raw) > MAX_BODY:
            raise feed.FeedError(f"request body of {raw[:40]} bytes is over {MAX_BODY}", 413)
        return int(raw)

    def _body(self) -> dict:
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != JSON_TYPE:
            raise feed.FeedError(f"a POST body must be JSON sent as Content-Type: {JSON_TYPE}, got "
                                 f"{ctype[:80] or 'none'}", 415)
        n = self._content_length()
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            raise feed.FeedError(f"request body not received within {self.timeout:g} s", 408) from None
        self.deadline = None
        if len(raw) < n:
            raise feed.FeedError(f"request body cut short: {len(raw)} of {n} bytes")
        if not raw:
            return {}
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except ValueError as exc:
            raise feed.FeedError(f"request body is not JSON: {exc}") from None
        except RecursionError:  # a body of nothing but "[" takes the reader down that deep
            raise feed.FeedError("request body is not JSON this server reads: nested too deeply") from None
        if not isinstance(body, dict):
            raise feed.FeedError("request body must be a JSON object")
        return body

    def _refusal(self) -> tuple[int, str] | None:
        """Why a request is refused before its route runs: a wrong or missing token, or (with
        no token) a request addressed to another name or sent by another site."""
        token = self.server.token
        if token:
            got = self.headers.get("Authorization", "")
            if got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), token.encode()):
                return None
            return 401, "missing or wrong bearer token"
        hosts = self.server.hosts
        given = self.headers.get_all("Host") or []
        host = given[0].strip().lower() if len(given) == 1 else ""
        if hosts is not None and host not in hosts:
            return 403, (f"Host {host or 'missing'!r} is not this server's address ({', '.join(sorted(hosts))}): "
                         "refused (a web page could reach a feed without a token through DNS rebinding; "
                         "set INTERACTOR_FEED_TOKEN to answer other names)")
        refused = cross_site_refusal(self.headers.get, f"http://{host}")
        if refused:
            return 403, f"{refused}: a feed without a token answers its own trainers, not web pages"
        return None

    def _handle(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        if method == "GET":
            self.deadline = None
            if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
                self.close_connection = True  # a body we do not read: the connection ends with the answer
        app = self.server.app
        try:
            refused = self._refusal()
            if refused is not None and not (path == "/health" and method == "GET" and refused[0] == 401):
                return self._send(refused[0], {"success": False, "error": refused[1]})
            if path == "/health" and method == "GET":
                svc = app.service
                return self._send(200, {"success": True, "status": "ok", "job_id": svc.job_id if svc else None})
            route = ROUTES.get((method, path))
            if route is None:
                return self._send(404, {"success": False, "error": f"no route {method} {path}"})
            body = self._body() if method == "POST" else {}
            answer = route(app, body)
            if not isinstance(answer, Handout):
                return self._send(200, answer)
            # Groups handed out: settled once the answer is written (a route without an ack),
            # given back at once when the trainer is gone before it could have it.
            delivered = self._send(200, answer.body)
            try:
                answer.sent() if delivered else answer.lost()
            except Exception:  # noqa: BLE001 - the answer is out; a late failure is only logged
                log.exception("feed route %s %s: settling its groups after the answer failed", method, path)
        except feed.FeedError as exc:
            return self._send(exc.status, {"success": False, "error": str(exc), **exc.extra})
        except Exception as exc:  # noqa: BLE001 - answered, logged, server stays up
            log.exception("feed route %s %s failed", method, path)
            return self._send(500, {"success": False, "error": f"{type(exc).__name__}: {exc}"})

    def do_GET(self):  # noqa: N802
        self._handle("GET")

    def do_POST(self):  # noqa: N802
        self._handle("POST")


@dataclass
class Handout:
    """A route's answer that hands groups to a trainer: ``sent`` runs once it was written in
    full, ``lost`` when the connection was gone (the groups then go to the next take)."""

    body: dict
    sent: Callable[[], Any] = lambda: None
    lost: Callable[[], Any] = lambda: None


PEER_OPEN, PEER_DONE_SENDING, PEER_GONE = "open", "done sending", "gone"
_TCP_CLOSE = 7  # tcp_info's state of a connection that was reset (Linux's TCP_CLOSE)


def _peer(sock) -> str:
    """What the client did since its request, without reading any of what it sent next:

    * ``PEER_OPEN``: nothing yet, or it sent its next request already;
    * ``PEER_DONE_SENDING``: it sent a FIN. Either it shut only its sending side after a complete
      request (HTTP/1.1 allows it; some clients and tools do it) and reads the answer, or it
      closed the connection (it gave up waiting): only the answer written to it tells which
      (:func:`_taken_in`);
    * ``PEER_GONE``: it reset the connection."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return PEER_OPEN
        return PEER_DONE_SENDING if sock.recv(1, socket.MSG_PEEK) == b"" else PEER_OPEN
    except (OSError, ValueError):
        return PEER_GONE


def _taken_in(sock, timeout_s: float) -> bool:
    """After an answer was written to a client that sent a FIN: whether the client's end took it.
    A client that only shut its sending side acknowledges the bytes; one that closed its socket
    answers them with a reset, so the answer is not its. Waits up to ``timeout_s`` for one or
    the other (a round trip, or as long as a half-closed client takes to read a large answer).
    Where the acknowledgements cannot be read, False: groups handed out in that answer are given
    back, never lost (at worst the client has them twice)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    try:
        while True:
            # The error first: a reset leaves the unacknowledged count where it was, never 0.
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or _tcp_state(sock) == _TCP_CLOSE:
                return False
            if _unacknowledged_bytes is None:
                return False
            unacked = _unacknowledged_bytes(sock)
            if unacked == 0:
                return True
            if time.monotonic() >= deadline:
                log.debug("feed answer to a half-closed client not acknowledged within %g s", timeout_s)
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
    except (OSError, ValueError):
        return False


def _tcp_state(sock) -> int | None:
    if not hasattr(socket, "TCP_INFO"):
        return None
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def _unacknowledged_reader() -> Callable[[socket.socket], int] | None:
    """How many bytes written to a socket its other end has not acknowledged yet (Linux's
    SIOCOUTQ, the same request number as TIOCOUTQ); None where that cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import fcntl
        import termios
    except ImportError:
        return None
    request = getattr(termios, "TIOCOUTQ", None)
    if request is None:
        return None

    def unacknowledged(sock: socket.socket) -> int:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]

    return unacknowledged


_unacknowledged_bytes = _unacknowledged_reader()


def _num(body: dict, name: str, default):
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise feed.FeedError(f"{name} must be a number, got {v!r}")
    return v


def _take(app: FeedApp, body: dict) -> Handout:
    svc, trainer = app.need(), body.get("trainer", "trainer")
    groups = svc.take(trainer, body.get("batch", 1), _num(body, "timeout", 30.0))
    ids = [g["group_id"] for g in groups]
    return Handout({"groups": groups}, lost=lambda: svc.give_back(trainer, ids))


def _ack(app: FeedApp, body: dict) -> dict:
    return app.need().ack(body.get("trainer", "trainer"), body.get("ids"))


def _get_version(app: FeedApp, body: dict) -> dict:
    svc = app.need()
    return {"version": feed.current_version(svc.r, svc.keys, svc.job_id)}


def _set_version(app: FeedApp, body: dict) -> dict:
    if "version" not in body:
        raise feed.FeedError("body must carry 'version'")
    return {"version": app.need().set_version(body["version"])}


def _stats(app: FeedApp, body: dict) -> dict:
    return app.need().stats()


def _get_rollout_data(app: FeedApp, body: dict) -> dict:
    svc = app.need()
    batch = body.get("batch_size", body.get("num_groups", 1))
    answer, ids = svc.rollout_data(batch, _num(body, "timeout", 30.0))
    trainer = svc.COMPAT_TRAINER
    return Handout(answer, sent=lambda: svc.ack(trainer, ids), lost=lambda: svc.give_back(trainer, ids))


def _start_rollout(app: FeedApp, body: dict) -> dict:
    with app.lock:
        if app.service is not None:
            raise feed.FeedError(f"a rollout is running already: job {app.service.job_id} "
                                 "(one job per feed server; start another server for another job)", 409)
        if app.start is None:
            raise feed.FeedError("this feed server serves a job a fleet runs and cannot start one", 409)
        app.service, note = app.start(body)
        return {"success": True, "message": f"Rollout started: job {app.service.job_id}{note}",
                "job_id": app.service.job_id}



ROUTES: dict[tuple[str, str], Callable[[FeedApp, dict], dict | Handout]] = {
    ("POST", "/take"): _take,
    ("POST", "/ack"): _ack,
    ("GET", "/version"): _get_version,
    ("POST", "/version"): _set_version,
    ("GET", "/stats"): _stats,
    ("POST", "/get_rollout_data"): _get_rollout_data,
    ("POST", "/start_rollout"): _start_rollout,
}
