"""``interactor serve-env``: env classes (adapters or your own) behind docs/protocol.md#environment-server.

The HTTP plumbing is :mod:`envs.http`, shared with the example server; what differs is that
instances are env classes (:mod:`envs.base`), found by env_name in a registry
(exact name, else the part before the first dot), each with its own lock, so that a slow
instance holds up only its own episode.

=====================================  =====================================================
``POST   /{env_name}/{env_id}/reset``  create (or re-create) + ``reset(env_param, seed)``
``GET    /{env_name}/{env_id}/get_task_prompt``
``POST   /{env_name}/{env_id}/step``   ``{"action": str}``
``DELETE /{env_name}/{env_id}``        ``close()``; 200 even for an unknown id
``POST   /{env_name}/{env_id}/close``  the same, old spelling
``GET    /envs``                       the env names served (readiness)
``GET    /stats``                      counters
=====================================  =====================================================

A step body's ``tool_calls`` (the model's, when the prompt offered tools: docs/protocol.md#tools)
go to the class's ``step(action, tool_calls=...)``. A ``ValueError`` (``EnvError``) from an instance is answered 400, any other exception 500, an
unknown instance 404.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from envs.http import EnvProtocolHandler, FaultDice, QuietHTTPServer
from envs import ADAPTERS, adapter_for, installed
from envs.base import construct, import_object, normalize_answer

__all__ = ["AdapterEnvServer", "start_in_thread", "default_registry"]


def default_registry(only: list[str] | None = None) -> dict[str, str]:
    """The bundled adapters whose library is installed (``only``: just these names)."""
    names = only if only else list(ADAPTERS)
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise ValueError(f"unknown adapters {unknown}; known: {list(ADAPTERS)}")
    return {n: ADAPTERS[n] for n in names if installed(n)}


class _Instance:
    __slots__ = ("env", "lock")

    def __init__(self, env: Any):
        self.env = env
        self.lock = threading.Lock()


class AdapterEnvServer(QuietHTTPServer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, registry: dict[str, str] | None = None,
                 latency_ms: float = 0.0, error_rate: float = 0.0, fault_seed: int | None = 0,
                 verbose: bool = False):
        super().__init__((host, port), _AdapterHandler, verbose=verbose)
        self.registry = dict(default_registry() if registry is None else registry)
        self.latency_ms = latency_ms
        self.error_rate = error_rate
        self.dice = FaultDice(fault_seed)
        self.lock = threading.Lock()
        self.instances: dict[tuple[str, str], _Instance] = {}
        self.counters = {"requests": 0, "resets": 0, "prompts": 0, "steps": 0, "closes": 0, "closed_ids": 0,
                         "episodes_done": 0, "not_found": 0, "bad_request": 0, "internal_errors": 0}
        self.rewards_total = 0.0

    def env_names(self) -> list[str]:
        return sorted(self.registry)

    def stats(self) -> dict:
        with self.lock:
            out: dict[str, Any] = dict(self.counters)
            out["live"] = len(self.instances)
            out["rewards_total"] = self.rewards_total
            out["envs"] = self.env_names()
        return out

    def bump(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n


class _AdapterHandler(EnvProtocolHandler):
    server: AdapterEnvServer
    server_version = "interactor-serve-env/0.1"
    bad_request_errors = (ValueError,)  # EnvError and friends: a bad request

    def env_call(self, op: str, env_name: str, env_id: str, body: bytes) -> None:
        srv = self.server
        if srv.latency_ms:
            time.sleep(srv.latency_ms / 1000.0)
        if srv.dice.roll(("error", srv.error_rate)):
            return self.send_json(500, {"error": "injected fault (nothing was applied)"})
        payload = self.parse_payload(op, body)
        if payload is None:
            return None
        if op == "reset":
            return self.reset(env_name, env_id, payload)
        with srv.lock:
            inst = srv.instances.get((env_name, env_id))
        if inst is None:
            return self.fail(404, f"unknown env instance {env_name}/{env_id}")
        if op == "get_task_prompt":
            with inst.lock:
                answer = normalize_answer(inst.env.get_task_prompt())
            srv.bump("prompts")
            return self.send_json(200, answer)
        action = payload.get("action")
        if not isinstance(action, str):
            return self.fail(400, "body field 'action' (a string) is required")
        tool_calls = payload.get("tool_calls")  # the model's, when the prompt offered tools (docs/protocol.md#tools)
        if tool_calls is not None and (not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls)):
            return self.fail(400, "body field 'tool_calls' must be a list of objects")
        with inst.lock:
            answer = normalize_answer(inst.env.step(action, tool_calls=tool_calls) if tool_calls else inst.env.step(action))
        with srv.lock:
            srv.counters["steps"] += 1
            if isinstance(answer, dict):
                r = answer.get("reward")
                if isinstance(r, (int, float)) and not isinstance(r, bool):
                    srv.rewards_total += r
                if answer.get("terminated") or answer.get("truncated"):
                    srv.counters["episodes_done"] += 1
        return self.send_json(200, answer)

    def reset(self, env_name: str, env_id: str, payload: dict) -> None:
        srv = self.server
        path = adapter_for(env_name, srv.registry)
        if path is None:
            return self.fail(400, f"unknown env_name {env_name!r}; served: {srv.env_names()}")
        args = self.reset_args(payload)
        if args is None:
            return None
        env_param, seed = args
        try:
            cls = import_object(path)
        except (ImportError, AttributeError) as exc:
            return self.fail(400, f"env {env_name!r}: cannot import {path!r} here: {type(exc).__name__}: {exc}")
        env = construct(cls, env_name)
        try:
            answer = env.reset(env_param, seed)
            answer = {} if answer is None else normalize_answer(answer)
        except BaseException:
            _close_quietly(env)
            raise
        with srv.lock:
            old = srv.instances.pop((env_name, env_id), None)
            srv.instances[(env_name, env_id)] = _Instance(env)
            srv.counters["resets"] += 1
        if old is not None:
            _close_quietly(old.env)
        self.send_json(200, answer)

    def close_instance(self, env_name: str, env_id: str) -> None:
        srv = self.server
        with srv.lock:
            srv.counters["closes"] += 1
            inst = srv.instances.pop((env_name, env_id), None)
            if inst is not None:
                srv.counters["closed_ids"] += 1
        if inst is not None:
            with inst.lock:
                _close_quietly(inst.env)
        self.send_json(200, {"status": "ok"})


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001
        pass


def start_in_thread(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> tuple[AdapterEnvServer, str]:
    """Start an :class:`AdapterEnvServer` in a daemon thread; stop it with ``server.shutdown()``."""
    return AdapterEnvServer(host, port, **kwargs).serve_in_thread("serve-env")
