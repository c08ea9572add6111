"""A stand-in for the original system's env server (its ``env/app.py``: FastAPI, one Ray actor per
instance), as it answers over HTTP: what the tests of its task files and of its error answers
drive interactor against.

* Any ``env_name`` it is given serves single-turn instances: the prompt is the task (the
  dataset row's ``problem``, ``prompt`` or ``instruction``, else the params), any non-empty
  answer ends the episode with reward 1.
* Errors answer as FastAPI does, ``{"detail": ...}``: an unknown env_name 400, a step or prompt
  of an unknown instance 404 ``Env actor not found``. A constructor that raises (``fails``
  says which params do) answers 500 with the text Ray gives for an actor that died in its
  creation task: the dead actor's pid, actor id and object address, different on every try,
  and terminal colour codes, then the exception line.
* Every reset's body is kept (``resets``), in order, for the tests to count and read.

Stdlib only (the protocol's server base, envs/http.py).
"""

from __future__ import annotations

import json
import random
import threading
from typing import Callable

from envs.http import JSONHandler, QuietHTTPServer

# (env_name, env_param) -> the exception line a constructor raises with them, or None
Fails = Callable[[str, dict], "str | None"]


def ray_creation_error(actor_class: str, exception_line: str, rng: random.Random) -> str:
    """The text of Ray's error for an actor whose constructor raised, with a fresh pid, actor id
    and object address, as each try of the original server gives it."""
    pid = rng.randint(2000, 65000)
    actor_id = "%024x01000000" % rng.getrandbits(96)
    address = "0x7f%010x" % rng.getrandbits(40)
    return ("The actor died because of an error raised in its creation task, "
            f"\x1b[36mray::{actor_class}.__init__()\x1b[39m (pid={pid}, ip=127.0.0.1, actor_id={actor_id}, "
            f"repr=<env.app.{actor_class} object at {address}>)\n"
            '  File "/srv/env/app.py", line 212, in __init__\n'
            "    self.env = env_cls(**env_param)\n"
            "               ^^^^^^^^^^^^^^^^^^^^\n"
            f"{exception_line}")


class OriginalEnvServer(QuietHTTPServer):
    """The stand-in; ``start()`` serves it from a thread and returns its base URL."""

    def __init__(self, env_names: list[str], *, fails: Fails | None = None, seed: int = 0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.env_names = list(env_names)
        self.fails = fails
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.instances: dict[tuple[str, str], dict] = {}
        self.resets: list[dict] = []  # {"env_name", "env_id", "body"} of every reset, in order
        self.answered_500: list[str] = []  # the detail of every 500, in order
        self.steps = 0
        self.closes = 0

    def start(self) -> str:
        return self.serve_in_thread("original-envserver")[1]


class _Handler(JSONHandler):
    server: OriginalEnvServer

    def detail(self, status: int, text: str) -> None:
        self.send_json(status, {"detail": text})

    def dispatch(self, method: str) -> None:
        srv = self.server
        body = self.read_body() if method in ("POST", "DELETE") else b""
        parts = self.split_path()
        if parts == ["envs"] and method == "GET":
            with srv.lock:
                live = [{"env_name": n, "env_id": i} for n, i in srv.instances]
            return self.send_json(200, {"envs": live})
        if len(parts) == 2 and method == "DELETE":
            with srv.lock:
                srv.closes += 1
                srv.instances.pop((parts[0], parts[1]), None)
            return self.send_json(200, {"status": "ok", "envname": parts[0], "id": parts[1]})
        if len(parts) != 3:
            return self.detail(404, "Not Found")
        env_name, env_id, op = parts
        if (method, op) == ("POST", "reset"):
            return self.reset(env_name, env_id, body)
        with srv.lock:
            inst = srv.instances.get((env_name, env_id))
        if inst is None:
            return self.detail(404, "Env actor not found")
        if (method, op) == ("GET", "get_task_prompt"):
            return self.send_json(200, [] if inst["done"] else inst["messages"])
        if (method, op) == ("POST", "step"):
            action = json.loads(body or b"{}").get("action") or ""
            with srv.lock:
                srv.steps += 1
                inst["done"] = True
            return self.send_json(200, {"observation": {}, "reward": 1.0 if action.strip() else 0.0,
                                        "terminated": True, "truncated": False, "info": {}})
        return self.detail(405, "Method Not Allowed")

    def reset(self, env_name: str, env_id: str, body: bytes) -> None:
        srv = self.server
        payload = json.loads(body or b"{}")
        with srv.lock:
            srv.resets.append({"env_name": env_name, "env_id": env_id, "body": payload})
        if env_name not in srv.env_names:
            return self.detail(400, f"Unknown envname '{env_name}'. Available: {srv.env_names}")
        env_param = payload.get("env_param") or {}
        raised = srv.fails(env_name, env_param) if srv.fails else None
        if raised:
            with srv.lock:
                text = "Reset execution failed: " + ray_creation_error("EnvActor", raised, srv.rng)
                srv.answered_500.append(text)
            return self.detail(500, text)
        row = env_param.get("dataset") or {}
        task = next((row[k] for k in ("problem", "prompt", "instruction") if isinstance(row.get(k), str)),
                    json.dumps(env_param, sort_keys=True))
        messages = [{"role": "system", "content": f"You are solving a {env_name} task."},
                    {"role": "user", "content": task}]
        with srv.lock:
            srv.instances[(env_name, env_id)] = {"messages": messages, "done": False}
        self.send_json(200, {"observation": {"task": task}, "info": {}})
