"""A bundled stand-in environment server speaking the env protocol (docs/protocol.md).

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
    a step in between appends a user nudge to the history.  ``feedback_pad`` (0)
    adds that many filler words to each feedback message, for prompts that grow
    as fast as a verbose real environment's (tests of context limits).

``arithmetic`` (single-turn)
    env_param ``dataset`` = ``{"question": str, "answer": number or str}``.
    The last number in the action is compared with the answer.

``antonym`` (single-turn)
    a dataset row ``{"word": "hot"}``: "What is the opposite of "hot"? Answer with one word.",
    rewarded 1 when the answer's first line holds an accepted antonym (envs/antonyms.py).

``slow_step_at`` / ``slow_step_s`` (attributes): an instance's step of that number waits that
long before it is applied (a step call in flight, for a test to kill its worker in).
``on_step`` (attribute): called with the instance id as each step call arrives, before anything
is applied (for a test to look at what the fleet had written by then).

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
import sys
import threading
import time
from typing import Any, Callable

from envs.bundled import ENV_NAMES, ENVS, ArithmeticEnv, EnvError, GuessNumberEnv
from envs.http import EnvProtocolHandler, FaultDice, QuietHTTPServer, serve_until_signal

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
            "internal_errors": 0, "slow_steps": 0,
        }
        # slow_step_at (0: off): an instance's step of that number waits slow_step_s before it is
        # applied, so that a test can kill a worker with a step call in flight
        self.slow_step_at = 0
        self.slow_step_s = 0.0
        self.on_step: Callable[[str], None] | None = None
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
        if op == "step" and srv.on_step is not None:
            srv.on_step(env_id)
        if op == "step" and srv.slow_step_at and srv.steps_by_env.get(env_id, 0) + 1 == srv.slow_step_at:
            with srv.lock:
                srv.counters["slow_steps"] += 1
            time.sleep(srv.slow_step_s)  # a step call in flight for a while; applied after it
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
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="sleep per call, ms (default: 0)")
    parser.add_argument("--error-rate", type=float, default=0.0, help="fraction of calls answered 500 (default: 0)")
    parser.add_argument("--drop-rate", type=float, default=0.0,
                        help="fraction of calls whose connection is closed without an answer (default: 0)")
    parser.add_argument("--fault-seed", type=int, default=0,
                        help="seed of the injected faults' random choices (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.envserver",
        description="Stand-in environment server (guess_number, arithmetic, antonym).")
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
