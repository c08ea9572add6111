"""``interactor gateway``: the model gateway's front for agents that run elsewhere (another
machine, a sandbox, a CI job), stateless, its state in Redis (docs/deployment.md).

A worker whose agents are given ``gateway_url`` (this service's URL) writes, while an agent runs,
``<prefix>:gateway:<session>`` = the URL its own gateway (workers/gateway.py, listening on
``gateway_host``) is reached at, and removes it when the agent's session ends. This service
forwards each call of a session, as it came (method, path, the agent's key, body), to that
gateway, which checks the key, calls the model and records the call, and sends its answer back.
So any number of these may run behind one address: what they know is in Redis.

A session with no route (never opened, or ended) is answered 410; a body larger than
``gateway_max_body_bytes`` 413 unread; a worker gateway that does not answer 502. The agent's key
is passed on, never logged.
"""

from __future__ import annotations

import http.client
import logging
from urllib.parse import urlsplit

import redis

from broker.keys import Keys
from broker.settings import Settings
from envs.http import JSONHandler, QuietHTTPServer
from workers.gateway import _error, _route

log = logging.getLogger("interactor.gateway")

_PASSED_HEADERS = ("Authorization", "Content-Type", "Accept")


class GatewayRouter(QuietHTTPServer):
    def __init__(self, settings: Settings, client: redis.Redis, host: str = "127.0.0.1", port: int = 8600):
        super().__init__((host, port), _RouterHandler)
        self.settings, self.redis, self.keys = settings, client, Keys(settings.key_prefix)

    def route(self, session_id: str) -> str | None:
        url = self.redis.get(self.keys.gateway_route(session_id))
        return url.decode() if url else None


class _RouterHandler(JSONHandler):
    server: GatewayRouter
    server_version = "interactor-gateway-router/1"

    def dispatch(self, method: str) -> None:
        try:
            self._dispatch(method)
        except (ConnectionError, TimeoutError):
            raise
        except redis.RedisError as exc:
            self.close_connection = True
            self.send_json(503, _error(f"the gateway's Redis is unreachable ({type(exc).__name__}); try again",
                                       "service_unavailable"))
        except Exception as exc:  # noqa: BLE001 - no request may take the service down
            log.exception("gateway router: %s %s failed", method, self.path[:200])
            self.close_connection = True
            self.send_json(500, _error(f"gateway error: {type(exc).__name__}", "server_error"))

    def _dispatch(self, method: str) -> None:
        route = _route(self.split_path())
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if route is None or length < 0 or length > self.server.settings.gateway_max_body_bytes or \
                self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            if route is None:
                return self.send_json(404, _error(f"no route for {method} {self.path[:200]}", "not_found"))
            if length > self.server.settings.gateway_max_body_bytes:
                return self.send_json(413, _error(f"body of {length} bytes is larger than the gateway takes "
                                                  f"({self.server.settings.gateway_max_body_bytes})", "request_too_large"))
            return self.send_json(400, _error("send the body with a Content-Length", "invalid_request_error"))
        body = self.rfile.read(length) if length else b""
        target = self.server.route(route[0])
        if target is None:
            return self.send_json(410, _error("no open session of that id: it has ended, or never was",
                                              "session_ended"))
        self._forward(method, target, body)

    def _forward(self, method: str, target: str, body: bytes) -> None:
        s = self.server.settings
        parts = urlsplit(target)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=s.llm_read_timeout_s + 30)
        try:
            headers = {k: self.headers[k] for k in _PASSED_HEADERS if self.headers.get(k)}
            conn.request(method, self.path, body=body or None, headers=headers)
            reply = conn.getresponse()
            data = reply.read(s.max_response_bytes + 1)
            if len(data) > s.max_response_bytes:
                raise ValueError(f"answer larger than max_response_bytes={s.max_response_bytes}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.warning("gateway router: the worker gateway at %s did not answer: %s", target, exc)
            return self.send_json(502, _error(f"the worker serving this session did not answer ({type(exc).__name__})",
                                              "upstream_error"))
        finally:
            conn.close()
        self.send_bytes(reply.status, data, reply.getheader("Content-Type") or "application/json")
