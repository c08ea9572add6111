"""A bundled stand-in environment server speaking PROTOCOL.md section 1.

Stdlib only.  One process hosts many environment *instances* addressed by
``(env_name, env_id)``:

=====================================  =========================================
``POST   /{env_name}/{env_id}/reset``  create (or re-create) + reset
``GET    /{env_name}/{env_id}/get_task_prompt``  chat messages; ``[]`` when over
``POST   /{env_name}/{env_id}/step``   ``{"action": str}``
``DELETE /{env_name}/{env_id}``        close; 200 even for an unknown id
``POST   /{env_name}/{env_id}/close``  close, the old servers' spelling
``GET    /envs``                       readiness: the list of env names
``GET    /stats``                      counters for tests and benchmarks
=====================================  =========================================

Environments:

``guess_number`` (multi-turn)
    env_param ``low`` (1), ``high`` (100), ``max_turns`` (10); a dataset row
    (``env_param["dataset"]``) may override any of them.  The target comes from
    ``random.Random(seed)``.  The env owns the conversation and, like real
    environments, ``get_task_prompt`` is *not* idempotent: asking twice without
    a step in between appends a user nudge to the history.

``arithmetic`` (single-turn)
    env_param ``dataset`` = ``{"question": str, "answer": number or str}``.
    The last number in the action is compared with the answer.

Fault knobs (constructor arguments of :class:`EnvServer`, CLI flags, and plain
attributes that may be changed on a running server): ``latency_ms``,
``error_rate`` (500), ``drop_rate`` (connection closed, no answer) and
``garbage_rate`` (200 with a non-JSON body).  Faults hit only ``reset``,
``get_task_prompt`` and ``step`` and are decided *before* anything is applied,
so a faulted call never changed the instance.  They draw from one
``random.Random(fault_seed)``, so a sequential test is reproducible.

Run it with ``python -m examples.envserver --port 0``; it prints
``listening on http://HOST:PORT`` once bound.  In-process:
``server, base_url = start_in_thread(error_rate=0.1)`` ... ``server.shutdown()``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

__all__ = [
    "ENV_NAMES",
    "EnvServer",
    "EnvError",
    "GuessNumberEnv",
    "ArithmeticEnv",
    "start_in_thread",
    "main",
]


# ---------------------------------------------------------------------------
# HTTP plumbing shared with examples.model_standin
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------


class EnvError(Exception):
    """Bad parameters or a bad request: answered 400 with ``{"error": msg}``."""


_INT_RE = re.compile(r"-?\d+")
_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _int_param(params: dict, key: str, default: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
            return int(value.strip())
        raise EnvError(f"env_param {key!r} must be an integer, got {value!r}")
    return value


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


class GuessNumberEnv:
    """Multi-turn: guess an integer in [low, high] within max_turns."""

    name = "guess_number"

    def __init__(self, env_param: dict, seed: int | None):
        row = env_param.get("dataset")
        if row is not None and not isinstance(row, dict):
            raise EnvError("env_param 'dataset' must be an object (one dataset row)")
        params = dict(env_param)
        if row:
            params.update({k: row[k] for k in ("low", "high", "max_turns") if k in row})
        self.low = _int_param(params, "low", 1)
        self.high = _int_param(params, "high", 100)
        self.max_turns = _int_param(params, "max_turns", 10)
        if self.low > self.high:
            raise EnvError(f"env_param 'low' ({self.low}) must be <= 'high' ({self.high})")
        if self.max_turns < 1:
            raise EnvError("env_param 'max_turns' must be >= 1")
        self.target = random.Random(seed).randint(self.low, self.high)
        self.turns = 0
        self.done = False
        self.history = [
            _msg("system",
                 "You are playing a number-guessing game. The secret number is an integer "
                 f"between {self.low} and {self.high} (inclusive). You have {self.max_turns} "
                 "guesses. After each guess you are told whether it is too low or too high."),
            _msg("user", "Guess the number. Reply with your guess as a single integer."),
        ]
        self.pending: list[dict] = []
        self.served = False  # the current history was already handed out

    def reset_answer(self) -> dict:
        return {
            "observation": {"low": self.low, "high": self.high, "max_turns": self.max_turns},
            "info": {"max_turns": self.max_turns},
        }

    def prompt(self) -> list[dict]:
        if self.done:
            return []
        if self.pending:
            self.history.extend(self.pending)
            self.pending = []
        elif self.served:
            # Like real envs: asking again without answering adds a turn.
            self.history.append(_msg(
                "user",
                "You have not answered yet. Reply with a single integer between "
                f"{self.low} and {self.high}."))
        self.served = True
        return list(self.history)

    def step(self, action: str) -> dict:
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.turns += 1
        numbers = _INT_RE.findall(action)
        reward = 0.0
        terminated = False
        if not numbers:
            result = "not a number"
            feedback = "That is not a number. Reply with a single integer."
        else:
            guess = int(numbers[-1])
            if guess < self.target:
                result, feedback = "too low", f"{guess} is too low."
            elif guess > self.target:
                result, feedback = "too high", f"{guess} is too high."
            else:
                result, feedback = "correct", f"{guess} is correct!"
                reward, terminated = 1.0, True
        truncated = not terminated and self.turns >= self.max_turns
        left = self.max_turns - self.turns
        if not terminated and not truncated:
            feedback += f" Guess again ({left} guess{'es' if left != 1 else ''} left)."
        elif truncated:
            feedback += f" No guesses left; the number was {self.target}."
        self.done = terminated or truncated
        self.pending.extend([_msg("assistant", action), _msg("user", feedback)])
        self.served = False
        info: dict[str, Any] = {"turn": self.turns, "result": result}
        if self.done:
            info["target"] = self.target
        return {
            "observation": {"feedback": feedback, "turn": self.turns},
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": info,
        }


class ArithmeticEnv:
    """Single-turn: answer the question of one dataset row."""

    name = "arithmetic"

    def __init__(self, env_param: dict, seed: int | None):  # noqa: ARG002
        row = env_param.get("dataset")
        if not isinstance(row, dict):
            raise EnvError("env_param 'dataset' (an object with 'question' and 'answer') "
                           "is required for arithmetic")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise EnvError("env_param 'dataset.question' (a non-empty string) is required")
        if "answer" not in row or row["answer"] is None or isinstance(row["answer"], bool) \
                or not isinstance(row["answer"], (int, float, str)):
            raise EnvError("env_param 'dataset.answer' (a number or a string) is required")
        self.question = question
        self.answer = row["answer"]
        self.done = False
        self.history = [
            _msg("system", "You are a careful calculator. Solve the problem and end your "
                           "reply with the final number."),
            _msg("user", question),
        ]

    def reset_answer(self) -> dict:
        return {"observation": {"question": self.question}, "info": {}}

    def prompt(self) -> list[dict]:
        return [] if self.done else list(self.history)

    def _correct(self, action: str) -> bool:
        try:
            expected = float(self.answer)
        except (TypeError, ValueError):
            return action.strip().lower().rstrip(".") == str(self.answer).strip().lower()
        numbers = _NUM_RE.findall(action.replace(",", ""))
        return bool(numbers) and abs(float(numbers[-1]) - expected) < 1e-6

    def step(self, action: str) -> dict:
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.done = True
        correct = self._correct(action)
        return {
            "observation": {"correct": correct},
            "reward": 1.0 if correct else 0.0,
            "terminated": True,
            "truncated": False,
            "info": {"correct": correct, "expected": self.answer},
        }


ENVS = {GuessNumberEnv.name: GuessNumberEnv, ArithmeticEnv.name: ArithmeticEnv}
ENV_NAMES = list(ENVS)


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class EnvServer(QuietHTTPServer):
    """Hosts env instances keyed by (env_name, env_id).  Knobs are attributes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, latency_ms: float = 0.0,
                 error_rate: float = 0.0, drop_rate: float = 0.0, garbage_rate: float = 0.0,
                 fault_seed: int | None = 0, verbose: bool = False, log_requests: bool = False):
        super().__init__((host, port), _EnvHandler, verbose=verbose)
        # (time.time(), op, env_name, env_id) of every instance call, when asked for: tests
        # check which attempt touched which instance when.
        self.request_log: list[tuple[float, str, str, str]] | None = [] if log_requests else None
        # Also when asked for: per instance id, what it served and was sent, in order
        # ({"prompt": messages} or {"action": text, "reward": r}): the conversation as the env
        # saw it, which tests compare with what the results browser shows.
        self.exchanges: dict[str, list[dict]] | None = {} if log_requests else None
        self.latency_ms = latency_ms
        self.error_rate = error_rate
        self.drop_rate = drop_rate
        self.garbage_rate = garbage_rate
        self.dice = FaultDice(fault_seed)
        self.lock = threading.Lock()
        self.instances: dict[tuple[str, str], Any] = {}
        self.counters = {
            "requests": 0, "resets": 0, "prompts": 0, "steps": 0, "closes": 0,
            "closed_ids": 0, "episodes_done": 0, "not_found": 0, "bad_request": 0,
            "internal_errors": 0,
        }
        self.faults = {"error": 0, "drop": 0, "garbage": 0}
        self.rewards_total = 0.0
        self.steps_by_env: dict[str, int] = {}

    def env_names(self) -> list[str]:
        return list(ENV_NAMES)

    def stats(self) -> dict:
        with self.lock:
            out: dict[str, Any] = dict(self.counters)
            out["live"] = len(self.instances)
            out["faults"] = dict(self.faults)
            out["rewards_total"] = self.rewards_total
            out["steps_by_env"] = dict(self.steps_by_env)
        return out

    def bump(self, key: str) -> None:
        with self.lock:
            self.counters[key] += 1

    def log_request(self, op: str, env_name: str, env_id: str) -> None:
        if self.request_log is not None:
            with self.lock:
                self.request_log.append((time.time(), op, env_name, env_id))


class EnvProtocolHandler(JSONHandler):
    """Routes PROTOCOL.md section 1 (shared by this server and ``interactor serve-env``).

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


class _EnvHandler(EnvProtocolHandler):
    server: EnvServer
    server_version = "interactor-envserver/0.1"

    def close_instance(self, env_name: str, env_id: str) -> None:
        srv = self.server
        srv.log_request("close", env_name, env_id)
        if srv.latency_ms:
            time.sleep(srv.latency_ms / 1000.0)
        with srv.lock:
            srv.counters["closes"] += 1
            if srv.instances.pop((env_name, env_id), None) is not None:
                srv.counters["closed_ids"] += 1
        self.send_json(200, {"status": "ok"})

    def env_call(self, op: str, env_name: str, env_id: str, body: bytes) -> None:
        srv = self.server
        srv.log_request(op, env_name, env_id)
        if srv.latency_ms:
            time.sleep(srv.latency_ms / 1000.0)
        fault = srv.dice.roll(("error", srv.error_rate), ("drop", srv.drop_rate),
                              ("garbage", srv.garbage_rate))
        if fault is not None:
            with srv.lock:
                srv.faults[fault] += 1
            if fault == "error":
                return self.send_json(500, {"error": "injected fault (nothing was applied)"})
            if fault == "drop":
                return self.drop()
            return self.send_bytes(200, b"<html>502 Bad Gateway: injected garbage</html>",
                                   content_type="text/html")

        payload = self.parse_payload(op, body)
        if payload is None:
            return None
        if op == "reset":
            return self.reset(env_name, env_id, payload)

        key = (env_name, env_id)
        if op == "step":
            action = payload.get("action")
            if not isinstance(action, str):
                with srv.lock:
                    known = key in srv.instances
                if not known:
                    return self.fail(404, f"unknown env instance {env_name}/{env_id}")
                return self.fail(400, "body field 'action' (a string) is required")

        with srv.lock:
            env = srv.instances.get(key)
            if env is None:
                srv.counters["not_found"] += 1
                answer, status = {"error": f"unknown env instance {env_name}/{env_id}"}, 404
            elif op == "get_task_prompt":
                answer, status = env.prompt(), 200
                srv.counters["prompts"] += 1
                if srv.exchanges is not None:
                    srv.exchanges.setdefault(env_id, []).append({"prompt": answer})
            else:
                try:
                    answer, status = env.step(action), 200
                except EnvError as exc:
                    srv.counters["bad_request"] += 1
                    answer, status = {"error": str(exc)}, 400
                else:
                    if srv.exchanges is not None:
                        srv.exchanges.setdefault(env_id, []).append({"action": action, "reward": answer["reward"]})
                    srv.counters["steps"] += 1
                    srv.steps_by_env[env_id] = srv.steps_by_env.get(env_id, 0) + 1
                    srv.rewards_total += answer["reward"]
                    if answer["terminated"] or answer["truncated"]:
                        srv.counters["episodes_done"] += 1
        self.send_json(status, answer)

    def reset(self, env_name: str, env_id: str, payload: dict) -> None:
        srv = self.server
        cls = ENVS.get(env_name)
        if cls is None:
            return self.fail(400, f"unknown env_name {env_name!r}; known: {ENV_NAMES}")
        args = self.reset_args(payload)
        if args is None:
            return None
        env_param, seed = args
        try:
            env = cls(env_param, seed)
        except EnvError as exc:
            return self.fail(400, str(exc))
        with srv.lock:
            srv.instances[(env_name, env_id)] = env
            srv.counters["resets"] += 1
        self.send_json(200, env.reset_answer())


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def start_in_thread(host: str = "127.0.0.1", port: int = 0, **knobs: Any) -> tuple[EnvServer, str]:
    """Start an :class:`EnvServer` in a daemon thread; stop it with ``server.shutdown()``."""
    return EnvServer(host, port, **knobs).serve_in_thread("envserver")


def add_fault_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="sleep per call")
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0,
                        help="fraction of calls whose connection is closed without an answer")
    parser.add_argument("--fault-seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.envserver",
        description="Stand-in environment server (guess_number, arithmetic).")
    add_fault_args(parser)
    parser.add_argument("--garbage-rate", type=float, default=0.0,
                        help="fraction of calls answered 200 with a non-JSON body")
    args = parser.parse_args(argv)
    server = EnvServer(args.host, args.port, latency_ms=args.latency_ms,
                       error_rate=args.error_rate, drop_rate=args.drop_rate,
                       garbage_rate=args.garbage_rate, fault_seed=args.fault_seed,
                       verbose=args.verbose)
    return serve_until_signal(server)


if __name__ == "__main__":
    sys.exit(main())
