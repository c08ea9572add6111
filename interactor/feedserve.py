"""The online-RL feed's HTTP server: routes, bodies, the bearer token (interactor/feed.py
does the work; interactor/feedcmd.py is the command that runs it).

Routes (JSON bodies; docs/protocol.md, "The rollout feed"):

* ``POST /take`` ``{trainer, batch, timeout}`` -> ``{groups: [...]}``
* ``POST /ack`` ``{trainer, ids}`` -> ``{acked, already}``; 404 naming an unknown or foreign group
* ``GET /version`` / ``POST /version`` ``{version}``; 409 when it goes backwards
* ``GET /stats``
* the original buffer server's ``POST /get_rollout_data``, ``POST /start_rollout`` and ``GET /health``

Bound to 127.0.0.1 unless told otherwise; bound anywhere else it requires a token
(``INTERACTOR_FEED_TOKEN``, sent as ``Authorization: Bearer <token>``), checked on every route
but ``/health``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from broker import feed
from broker.settings import SettingsError

log = logging.getLogger("interactor.feedserve")

MAX_BODY = 1 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def make_server(app: FeedApp, host: str, port: int, token: str = "") -> ThreadingHTTPServer:
    if not is_loopback(host) and not token:
        raise SettingsError(f"the feed is bound to {host}, beyond this machine: set INTERACTOR_FEED_TOKEN")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # noqa: A002 - the base class's name
            log.debug("feed %s " + fmt, self.client_address[0], *args)

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise feed.FeedError(f"request body of {n} bytes is over {MAX_BODY}", 413)
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise feed.FeedError(f"request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise feed.FeedError("request body must be a JSON object")
            return body

        def _authorized(self) -> bool:
            if not token:
                return True
            got = self.headers.get("Authorization", "")
            return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), token.encode())

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/health" and method == "GET":
                    svc = app.service
                    return self._send(200, {"success": True, "status": "ok",
                                            "job_id": svc.job_id if svc else None})
                if not self._authorized():
                    return self._send(401, {"success": False, "error": "missing or wrong bearer token"})
                route = ROUTES.get((method, path))
                if route is None:
                    return self._send(404, {"success": False, "error": f"no route {method} {path}"})
                body = self._body() if method == "POST" else {}
                return self._send(200, route(app, body))
            except feed.FeedError as exc:
                return self._send(exc.status, {"success": False, "error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - answered, logged, server stays up
                log.exception("feed route %s %s failed", method, path)
                return self._send(500, {"success": False, "error": f"{type(exc).__name__}: {exc}"})

        def do_GET(self):  # noqa: N802
            self._handle("GET")

        def do_POST(self):  # noqa: N802
            self._handle("POST")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _num(body: dict, name: str, default):
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise feed.FeedError(f"{name} must be a number, got {v!r}")
    return v


def _take(app: FeedApp, body: dict) -> dict:
    return {"groups": app.need().take(body.get("trainer", "trainer"), body.get("batch", 1),
                                      _num(body, "timeout", 30.0))}


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
    return svc.rollout_data(batch, _num(body, "timeout", 30.0))


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



ROUTES: dict[tuple[str, str], Callable[[FeedApp, dict], dict]] = {
    ("POST", "/take"): _take,
    ("POST", "/ack"): _ack,
    ("GET", "/version"): _get_version,
    ("POST", "/version"): _set_version,
    ("GET", "/stats"): _stats,
    ("POST", "/get_rollout_data"): _get_rollout_data,
    ("POST", "/start_rollout"): _start_rollout,
}
