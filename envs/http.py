"""The env server side of the protocol (docs/protocol.md#environment-server), for every server
this project ships: the example server (examples/envserver.py), ``interactor serve-env``
(envs/serve_env.py) and the model stand-in's plumbing (examples/model_standin.py).

* :class:`QuietHTTPServer`: a threading HTTP server for many keep-alive clients whose
  ``shutdown()`` really looks dead (listening socket and open connections closed).
* :class:`JSONHandler`: body reading (chunked too), JSON answers, dropping a connection.
* :class:`EnvProtocolHandler`: the route table and request-body validation of the protocol;
  a server supplies ``close_instance`` and ``env_call``.
* :class:`FaultDice` and :func:`serve_until_signal`: fault knobs and a clean foreground run.

Stdlib only.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

__all__ = ["QuietHTTPServer", "JSONHandler", "EnvProtocolHandler", "FaultDice", "serve_until_signal"]




class QuietHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer tuned for many keep-alive clients.

    ``shutdown()`` stops accepting, closes the listening socket and cuts the
    open keep-alive connections, so a stopped server really looks dead.
    """

    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, server_address, handler_class, *, verbose: bool = False):
        super().__init__(server_address, handler_class)
        self.verbose = verbose
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopped = False

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_in_thread(self, name: str) -> tuple["QuietHTTPServer", str]:
        """Serve from a daemon thread; ``(self, base_url)``. Stop with ``shutdown()``."""
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                       name=f"{name}:{self.server_address[1]}", daemon=True)
        self.thread.start()
        return self, self.base_url

    def track(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    def shutdown(self) -> None:  # noqa: D401 - same contract as the base class
        if self._stopped:
            return
        self._stopped = True
        super().shutdown()
        self.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)) and not self.verbose:
            return  # clients going away mid-answer are routine under load
        super().handle_error(request, client_address)


class JSONHandler(BaseHTTPRequestHandler):
    """Keep-alive JSON request handler: body reading, answers, dropping."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    timeout = 300  # idle keep-alive connections are closed after this
    sys_version = ""
    server: QuietHTTPServer

    # -- plumbing ----------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if self.server.verbose:
            super().log_message(format, *args)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def send_bytes(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj, separators=(",", ":")).encode(), headers=headers)

    def drop(self) -> None:
        """Close the connection without answering anything."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def split_path(self) -> list[str]:
        path = self.path.split("?", 1)[0].split("#", 1)[0]
        return [unquote(p) for p in path.split("/") if p]

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def do_PUT(self) -> None:
        self.dispatch("PUT")

    def do_PATCH(self) -> None:
        self.dispatch("PATCH")

    def dispatch(self, method: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def serve_until_signal(server: QuietHTTPServer) -> int:
    """Print the listening line, serve until SIGTERM/SIGINT, then stop cleanly."""
    print(f"listening on {server.base_url}", flush=True)

    def _stop(signum, frame):  # noqa: ARG001
        # shutdown() blocks until serve_forever returns: never call it from the
        # thread that runs serve_forever.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


class FaultDice:
    """One seeded die for all fault knobs; thread-safe."""

    def __init__(self, seed: int | None):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def roll(self, *rates: tuple[str, float]) -> str | None:
        """Return the name of the fault that hits, or None.  Rates add up."""
        if not any(r > 0 for _, r in rates):
            return None
        with self._lock:
            x = self._rng.random()
        acc = 0.0
        for name, rate in rates:
            acc += max(0.0, rate)
            if x < acc:
                return name
        return None


class EnvProtocolHandler(JSONHandler):
    """Routes the env protocol (docs/protocol.md#environment-server) for the example server and
    ``interactor serve-env``.

    Subclasses provide ``close_instance`` and ``env_call``; the server provides ``env_names``,
    ``stats``, ``bump`` and ``verbose``. Exceptions of ``bad_request_errors`` answer 400, any
    other exception inside an env 500.
    """

    bad_request_errors: tuple[type[BaseException], ...] = ()

    def fail(self, status: int, message: str) -> None:
        self.server.bump("not_found" if status == 404 else "bad_request" if status < 500 else "internal_errors")
        self.send_json(status, {"error": message})

    def dispatch(self, method: str) -> None:
        srv = self.server
        body = self.read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else b""
        parts = self.split_path()
        srv.bump("requests")
        try:
            if parts == ["envs"] and method == "GET":
                return self.send_json(200, srv.env_names())
            if parts == ["stats"] and method == "GET":
                return self.send_json(200, srv.stats())
            if len(parts) == 2 and method == "DELETE":
                return self.close_instance(parts[0], parts[1])
            if len(parts) == 3:
                env_name, env_id, op = parts
                if (method, op) == ("POST", "close"):
                    return self.close_instance(env_name, env_id)
                if (method, op) in (("POST", "reset"), ("GET", "get_task_prompt"), ("POST", "step")):
                    return self.env_call(op, env_name, env_id, body)
                if op in ("close", "reset", "get_task_prompt", "step"):
                    return self.fail(405, f"method {method} not allowed for {op}")
            return self.fail(404, f"no route for {method} {self.path}")
        except (ConnectionError, TimeoutError):
            raise
        except self.bad_request_errors as exc:
            return self.fail(400, f"{exc}")
        except Exception as exc:  # noqa: BLE001 - a failure inside the env is a 500
            if srv.verbose:
                traceback.print_exc()
            return self.fail(500, f"internal error: {type(exc).__name__}: {exc}"[:2000])

    def parse_payload(self, op: str, body: bytes) -> dict | None:
        """The request's JSON object ({} for none); None once a 400 has been answered."""
        if op == "get_task_prompt" or not body.strip():
            return {}
        try:
            payload = json.loads(body)
        except ValueError:
            self.fail(400, "request body is not valid JSON")
            return None
        if not isinstance(payload, dict):
            self.fail(400, "request body must be a JSON object")
            return None
        return payload

    def reset_args(self, payload: dict) -> tuple[dict, int | None] | None:
        """``(env_param, seed)`` of a reset body; None once a 400 has been answered."""
        env_param = payload.get("env_param")
        if env_param is None:
            env_param = {}
        if not isinstance(env_param, dict):
            self.fail(400, "body field 'env_param' must be an object")
            return None
        seed = payload.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            self.fail(400, f"body field 'seed' must be an integer or null, got {seed!r}")
            return None
        return env_param, seed

    def close_instance(self, env_name: str, env_id: str) -> None:
        raise NotImplementedError

    def env_call(self, op: str, env_name: str, env_id: str, body: bytes) -> None:
        raise NotImplementedError
