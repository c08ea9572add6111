"""Cheap stand-ins for the benchmark: an env server and a model on one asyncio loop each.

The bundled examples (examples/envserver.py, examples/model_standin.py) run a thread per
keep-alive connection and parse every request with ``http.server``: at 1,000 concurrent
episodes they cost about as much CPU as the system under test, on the same two cores, and the
figures would measure them instead of us. These speak the same wire protocol (docs/protocol.md,
environment server and model endpoint) from one asyncio loop: a request costs some tens of microseconds, and a
latency is a timer, not a sleeping thread.

Env ``countdown``: ``env_param`` ``steps`` (20), ``system_bytes`` (1500), ``turn_bytes`` (300),
``keep_turns`` (3). Every step is accepted; reward 1/steps per step; ``terminated`` at the
last step. The prompt is a system message plus the last ``keep_turns`` exchanges, so it stays a
few KB however long the episode runs (a realistic multi-turn prompt, no dataset needed).

Model: any ``POST .../chat/completions`` is answered with a fixed-size reply (``reply_bytes``)
after ``latency_ms``; the body is not parsed (the stand-in is not what we measure).

Run: ``python -m bench.standins env|model --port 0 --latency-ms 20``; prints
``listening on http://HOST:PORT`` once bound, stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from urllib.parse import unquote

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class App:
    """Route one request; answer with ``conn.respond(status, body, delay)``."""

    latency_s = 0.0

    def __init__(self) -> None:
        self.counters: dict[str, int] = {"requests": 0}

    def handle(self, conn: "HTTPConnection", method: bytes, path: str, body: bytes) -> None:
        raise NotImplementedError


class HTTPConnection(asyncio.Protocol):
    """Keep-alive HTTP/1.1 with Content-Length bodies; one request in flight per connection
    (what ``requests``/urllib3 do); pipelined bytes wait in the buffer."""

    __slots__ = ("app", "loop", "transport", "buf", "busy", "close_after")

    def __init__(self, app: App, loop: asyncio.AbstractEventLoop):
        self.app = app
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.close_after = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > 65536:
                self._bad()
            return
        head = buf[:end].split(b"\r\n")
        try:
            method, target, _ = head[0].split(b" ", 2)
        except ValueError:
            return self._bad()
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                self.close_after = True
            elif name == b"transfer-encoding":
                return self._bad()  # the clients under test always send Content-Length
        start = end + 4
        if len(buf) < start + length:
            return
        body = buf[start : start + length]
        self.buf = buf[start + length :]
        self.busy = True
        self.app.counters["requests"] += 1
        path = target.decode("latin-1").split("?", 1)[0]
        self.app.handle(self, method, path, body)

    def respond(self, status: int, body: bytes, delay: float = 0.0) -> None:
        if delay > 0:
            self.loop.call_later(delay, self._write, status, body)
        else:
            self._write(status, body)

    def respond_json(self, status: int, obj, delay: float = 0.0) -> None:
        self.respond(status, _dumps(obj).encode(), delay)

    def _write(self, status: int, body: bytes) -> None:
        t = self.transport
        if t is None:
            return
        t.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (status, _REASONS.get(status, b"Status"), len(body), body))
        self.busy = False
        if self.close_after:
            t.close()
            return
        if self.buf:
            self._next()

    def _bad(self) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()


# --------------------------------------------------------------------------- the env server


def _filler(n: int, seed: str) -> str:
    words = ("state", "observation", "inventory", "north", "door", "key", "lamp", "score", "move",
             "table", "window", "garden", "river", "bridge", "token", "value")
    out, i = [], len(seed)
    size = 0
    while size < n:
        w = words[i % len(words)]
        out.append(w)
        size += len(w) + 1
        i = i * 7 + 3
    return " ".join(out)[:n]


class Countdown:
    __slots__ = ("steps", "turn", "history", "system", "keep", "turn_text", "done")

    def __init__(self, env_param: dict, system_cache: dict):
        row = env_param.get("dataset")
        if isinstance(row, dict):  # a dataset row may set the episode's length
            env_param = {**env_param, **row}
        self.steps = max(1, int(env_param.get("steps", 20)))
        sb = int(env_param.get("system_bytes", 1500))
        tb = int(env_param.get("turn_bytes", 300))
        self.keep = 2 * int(env_param.get("keep_turns", 3))
        if sb not in system_cache:
            system_cache[sb] = {"role": "system", "content": "You are an agent in a text world. " + _filler(sb, "system")}
        self.system = system_cache[sb]
        self.turn_text = _filler(tb, "turn")
        self.turn = 0
        self.done = False
        self.history: list[dict] = [{"role": "user", "content": f"Turn 1 of {self.steps}. {self.turn_text}"}]

    def prompt(self) -> list:
        if self.done:
            return []
        return [self.system, *self.history[-self.keep - 1 :]]

    def step(self, action: str) -> dict:
        self.turn += 1
        last = self.turn >= self.steps
        self.done = last
        self.history.append({"role": "assistant", "content": action})
        self.history.append({"role": "user", "content": f"Turn {self.turn + 1} of {self.steps}. {self.turn_text}"})
        if len(self.history) > 4 * self.keep:
            del self.history[: -self.keep - 1]
        return {"observation": {"turn": self.turn}, "reward": 1.0 / self.steps, "terminated": last,
                "truncated": False, "info": {"turn": self.turn}}


class EnvApp(App):
    def __init__(self, latency_s: float):
        super().__init__()
        self.latency_s = latency_s
        self.instances: dict[tuple[str, str], Countdown] = {}
        self.system_cache: dict[int, dict] = {}
        self.counters.update(resets=0, prompts=0, steps=0, closes=0, not_found=0, bad_request=0)

    def handle(self, conn, method, path, body) -> None:
        parts = [unquote(p) for p in path.split("/") if p]
        c = self.counters
        d = self.latency_s
        if len(parts) == 3:
            name, eid, op = parts
            key = (name, eid)
            if op == "get_task_prompt" and method == b"GET":
                env = self.instances.get(key)
                if env is None:
                    c["not_found"] += 1
                    return conn.respond_json(404, {"error": "unknown instance"}, d)
                c["prompts"] += 1
                return conn.respond_json(200, env.prompt(), d)
            if op == "step" and method == b"POST":
                env = self.instances.get(key)
                if env is None:
                    c["not_found"] += 1
                    return conn.respond_json(404, {"error": "unknown instance"}, d)
                try:
                    action = json.loads(body)["action"]
                except (ValueError, KeyError, TypeError):
                    c["bad_request"] += 1
                    return conn.respond_json(400, {"error": "body field 'action' is required"}, d)
                if env.done:
                    c["bad_request"] += 1
                    return conn.respond_json(400, {"error": "the episode is over"}, d)
                c["steps"] += 1
                return conn.respond_json(200, env.step(str(action)), d)
            if op == "reset" and method == b"POST":
                if name != "countdown":
                    c["bad_request"] += 1
                    return conn.respond_json(400, {"error": f"unknown env_name {name!r}"}, d)
                try:
                    payload = json.loads(body) if body else {}
                    param = payload.get("env_param") or {}
                    if isinstance(param, str):  # the original driver sends its DB column's JSON text as is
                        param = json.loads(param)
                    env = Countdown(param, self.system_cache)
                except (ValueError, TypeError, AttributeError) as exc:
                    c["bad_request"] += 1
                    return conn.respond_json(400, {"error": f"bad reset: {exc}"}, d)
                self.instances[key] = env
                c["resets"] += 1
                return conn.respond_json(200, {"observation": {"steps": env.steps}, "info": {}}, d)
            if op == "close" and method == b"POST":
                return self._close(conn, key)
        if len(parts) == 2 and method == b"DELETE":
            return self._close(conn, (parts[0], parts[1]))
        if parts == ["envs"]:
            return conn.respond_json(200, ["countdown"])
        if parts == ["stats"]:
            return conn.respond_json(200, {**c, "live": len(self.instances)})
        return conn.respond_json(404, {"error": f"no route for {method.decode()} {path}"})

    def _close(self, conn, key) -> None:
        self.counters["closes"] += 1
        self.instances.pop(key, None)
        conn.respond_json(200, {"status": "ok"}, self.latency_s)


# --------------------------------------------------------------------------- the model


class ModelApp(App):
    def __init__(self, latency_s: float, reply_bytes: int = 200, weight_version: str = "v1"):
        super().__init__()
        self.latency_s = latency_s
        self.reply = _filler(reply_bytes, "reply")
        self.weight_version = weight_version
        self.counters.update(completions=0)

    def handle(self, conn, method, path, body) -> None:
        if method == b"POST" and path.endswith("/chat/completions"):
            n = self.counters["completions"] = self.counters["completions"] + 1
            out = {"id": f"chatcmpl-bench-{n}", "object": "chat.completion", "model": "stand-in",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": f"Action {n}: {self.reply}"},
                                "finish_reason": "stop"}]}
            if self.weight_version:
                out["metadata"] = {"weight_version": self.weight_version}
            return conn.respond_json(200, out, self.latency_s)
        if path.rstrip("/").endswith("/models"):
            return conn.respond_json(200, {"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
        if path == "/stats":
            return conn.respond_json(200, dict(self.counters))
        return conn.respond_json(404, {"error": {"message": f"no route for {path}"}})


# --------------------------------------------------------------------------- entry point


async def serve(app: App, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HTTPConnection(app, loop), host, port, backlog=4096,
                                      reuse_address=True)
    bound = server.sockets[0].getsockname()
    print(f"listening on http://{bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.standins", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["env", "model"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--reply-bytes", type=int, default=200)
    args = p.parse_args(argv)
    app: App = EnvApp(args.latency_ms / 1000) if args.role == "env" else ModelApp(args.latency_ms / 1000, args.reply_bytes)
    try:
        asyncio.run(serve(app, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
