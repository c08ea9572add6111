"""The env port of an OpenEnv server (``protocol: openenv``): one WebSocket session per episode.

An OpenEnv environment is a FastAPI app made by ``openenv.core.env_server.http_server.create_app``.
Its stateful sessions are WebSockets on ``/ws``: the client sends ``{"type": "reset" | "step" |
"state" | "close", "data": {...}}`` and each is answered by ``{"type": "observation", "data":
{"observation": {...}, "reward": ..., "done": ...}}``, ``{"type": "state", ...}`` or ``{"type":
"error", "data": {"message", "code"}}``. The server gives each socket an env instance of its
own and destroys it when the socket closes; at most ``max_concurrent_envs`` sockets at once,
past which a new one is answered ``CAPACITY_REACHED`` and closed.

What this port does with it, for the step loop (workers/loop.py):

* ``reset`` opens the socket and sends ``reset`` with the task's ``env_params``, its dataset
  row's fields and the episode's ``seed`` (the env's ``reset`` takes those its signature names).
  It is safe to repeat, on a new socket: connection failures are retried, and
  ``CAPACITY_REACHED`` is waited out (the attempt's budget paused, up to ``outage_budget_s``)
  instead of failing the episode.
* ``get_task_prompt`` calls nothing: the prompt is made from the last observation
  (workers/env_mappings.py: the observation's ``messages`` or ``prompt``, or the entry's
  ``observation_to_messages``).
* ``step`` sends the completion as the env's action (its one string field from ``GET /schema``,
  or the entry's ``completion_to_action``); reward and ``done`` come from the observation.
  It is never sent twice: the socket dropped with a step in flight ends the attempt
  (``env_instance_lost``, transient: the server destroyed the session with the socket, so there
  is nothing to reconnect to) and the episode starts afresh, as a lost instance of our own
  protocol does.
* ``close`` sends ``close`` and closes the socket, once; the session ends with it.

Answers are untrusted: a frame that is not JSON, not an object, binary, of an unknown type, or
larger than ``max_response_bytes`` (the socket's ``max_size``) fails the episode as
``env_malformed``; an ``error`` frame is classified by its code (:data:`ERROR_CODES`). A session
cannot outlive its socket, so an attempt cut off (worker killed) is followed by a fresh start
(``not_resumable``, broker/resume.py ``outlives_worker``), and nothing is left to close.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import connect

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_INSTANCE_LOST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EPISODE_TIMEOUT,
    EpisodeError,
)
from broker.records import EpisodeSpec
from broker.settings import Settings, redact_url
from workers.budget import Budget
from workers.env_mappings import Mapping
from workers.envport import StepResult, check_step_answer
from workers.retries import Retryable, run_with_retries

# websockets 17 asks connect(..., legacy=True) of a connection used outside a `with` block (else a
# deprecation warning); 16, the version openai-agents (the agents' test extra) allows, has no such
# flag and returns the connection directly: both do the same with what each accepts.
_DIRECT = {"legacy": True} if int(websockets.__version__.split(".")[0]) >= 17 else {}

log = logging.getLogger("interactor.openenv")

READINESS = "/health"
CAPACITY_REACHED = "CAPACITY_REACHED"
# An error frame's code -> (reason, transient). Codes from openenv's types.WSErrorCode.
ERROR_CODES: dict[str, tuple[str, bool]] = {
    "INVALID_JSON": (ENV_BAD_REQUEST, False),  # what we sent did not parse: never better on a retry
    "UNKNOWN_TYPE": (ENV_BAD_REQUEST, False),
    "VALIDATION_ERROR": (ENV_BAD_REQUEST, False),  # the action does not fit the env's action class
    "EXECUTION_ERROR": (ENV_SERVER_ERROR, True),  # the env raised in reset or step
    "FACTORY_ERROR": (ENV_SERVER_ERROR, True),  # the env's constructor raised
    "SESSION_ERROR": (ENV_INSTANCE_LOST, True),
}
# The observation answer's end-of-episode flag (openenv's serialize_observation): a field of a
# server's frame, not one of our ledger's states, whose "done" it happens to spell.
DONE_FIELD = "done"
INFO_OBSERVATION_BYTES = 16384  # an observation larger than this is not copied into the step's info
_CAPACITY_BACKOFF_S = (0.2, 2.0)


class SchemaCache:
    """``GET {base_url}/schema``'s action schema, asked once per server and process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schemas: dict[str, dict] = {}

    def action_schema(self, client: Any, base_url: str, *, deadline: float) -> dict:
        key = base_url.rstrip("/")
        with self._lock:
            if key in self._schemas:
                return self._schemas[key]
        what = f"GET {redact_url(key)}/schema"
        reply = client._call("GET", f"{key}/schema", what=what, deadline=deadline, idempotent=True)
        try:
            body = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer is not JSON ({len(reply.body)} bytes)") from None
        action = body.get("action") if isinstance(body, dict) else None
        if not isinstance(action, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer has no 'action' schema object")
        with self._lock:
            self._schemas[key] = action
        return action


SCHEMAS = SchemaCache()


def ws_url(base_url: str) -> str:
    """``ws://host:port/path/ws`` of ``http://host:port/path`` (``wss`` of ``https``)."""
    parts = urlsplit(base_url.rstrip("/"))
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path + "/ws", "", ""))


def reset_data(spec: EpisodeSpec) -> dict:
    """What ``reset`` sends: the entry's params, the dataset row's fields over them, and the seed
    (an OpenEnv env's ``reset`` takes the keywords its signature names; the server drops the rest)."""
    params = dict(spec.env_params or {})
    row = params.pop("dataset", None)
    data = {**params, **(row if isinstance(row, dict) else {})}
    if spec.seed is not None:
        data["seed"] = spec.seed
    return data


class OpenEnvPort:
    """One episode's session on an OpenEnv server, as the loop's env port (workers/envport.py)."""

    def __init__(self, spec: EpisodeSpec, settings: Settings, budget: Budget, guard: Any, breaker: Any,
                 check: Any, client: Any, mapping: Mapping | None = None, schemas: SchemaCache = SCHEMAS):
        self.spec, self.settings, self.budget = spec, settings, budget
        self.guard, self.breaker, self.check, self.client = guard, breaker, check, client
        self.mapping = mapping or Mapping()
        self.schemas = schemas
        self.url = ws_url(spec.base_url)
        self.shown = redact_url(spec.base_url)
        self.ws = None
        self.observation: dict = {}
        self.done = False
        self.conversation: list[dict] = []  # the last prompt and the answer to it
        self.prompt: list = []
        self.action_schema: dict = {}
        self.capacity_waits = 0  # times a reset found the server full
        self.closed = False

    # --- the port ----------------------------------------------------------------------
    def reset(self) -> dict:
        return self.guard.call(self.breaker, self._reset, retry_safe=True)

    def get_task_prompt(self) -> list:
        if self.done:
            return []
        self.prompt = self.mapping.messages(self.observation, self.conversation, f"openenv {self.spec.env_name}")
        return self.prompt

    def step(self, action: str, tool_calls: list | None = None) -> StepResult:
        what = f"openenv step {self.spec.env_name}"
        data = self.mapping.action(action, tool_calls, self.action_schema, what)
        result = self.guard.call(self.breaker, lambda: self._exchange({"type": "step", "data": data}, what),
                                 retry_safe=False)
        self.conversation = [*self.prompt, {"role": "assistant", "content": action}]
        return result

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        ws, self.ws = self.ws, None
        if ws is None:
            return
        try:
            ws.send(orjson.dumps({"type": "close", "data": {}}).decode())
        except Exception:  # noqa: BLE001 - the session ends with the socket either way
            pass
        try:
            ws.close()
        except Exception:  # noqa: BLE001
            log.debug("openenv %s: closing the socket failed", self.shown, exc_info=True)

    # --- the calls ---------------------------------------------------------------------
    def _reset(self) -> dict:
        what = f"openenv reset {self.spec.env_name}"
        s = self.settings
        # asked once per server and process, under the breaker as the reset is (a server down waits)
        self.action_schema = self.schemas.action_schema(self.client, self.spec.base_url, deadline=self.budget.deadline)
        waited_since: float | None = None
        delay = _CAPACITY_BACKOFF_S[0]
        while True:
            self._drop_socket()
            run_with_retries(self._open, attempts=1 + max(0, s.env_retries), backoff_initial_s=s.env_backoff_initial_s,
                             backoff_max_s=s.env_backoff_max_s, deadline=self.budget.deadline, what=what,
                             log_target=self.shown)
            try:
                self._exchange({"type": "reset", "data": reset_data(self.spec)}, what)
            except _Full as full:
                # The server holds max_concurrent_envs sessions: wait for one to end, the budget
                # paused (other episodes' sessions are not this episode's doing).
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    self.capacity_waits += 1
                    log.info("%s at %s: %s; waiting for a free session", what, self.shown, full)
                if now - waited_since > s.outage_budget_s:
                    raise EpisodeError(ENV_SERVER_ERROR, f"{what}: the server stayed at capacity for "
                                                         f"{now - waited_since:.0f}s ({full})", transient=True) from None
                self._drop_socket()
                self.check()
                t0 = time.monotonic()
                time.sleep(delay)
                self.budget.pause(time.monotonic() - t0)
                delay = min(_CAPACITY_BACKOFF_S[1], delay * 2)
                continue
            self.closed = False
            return {"observation": self.observation, "info": {}}

    def _open(self) -> None:
        s = self.settings
        left = self.budget.deadline - time.monotonic()
        if left <= 0:
            raise EpisodeError(EPISODE_TIMEOUT, f"openenv connect {self.shown}: the attempt's time budget ran out")
        try:
            self.ws = connect(self.url, open_timeout=min(s.env_connect_timeout_s, left),
                              max_size=s.max_response_bytes, close_timeout=2, compression=None,
                              **_DIRECT)  # one socket for the episode's life, not a `with` block
        except InvalidStatus as exc:
            status = exc.response.status_code
            error = EpisodeError(ENV_SERVER_ERROR if status >= 500 else ENV_BAD_REQUEST,
                                 f"openenv connect {self.shown}: the WebSocket handshake was answered HTTP {status} "
                                 "(is this an OpenEnv server? protocol: openenv needs its /ws route)",
                                 status=status, transient=status >= 500, outage=status in (502, 503, 504))
            if status >= 500:
                raise Retryable(error) from exc
            raise error from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            if isinstance(exc, InvalidURI):
                raise EpisodeError(ENV_BAD_REQUEST, f"openenv connect: bad URL {self.shown}", transient=False) from exc
            raise Retryable(EpisodeError(ENV_UNREACHABLE, f"openenv connect {self.shown}: {type(exc).__name__}: {exc}",
                                         outage=True, maybe_applied=False)) from exc

    def _exchange(self, message: dict, what: str) -> Any:
        ws = self.ws
        if ws is None:
            raise EpisodeError(ENV_INSTANCE_LOST, f"{what}: the session's socket is closed", transient=True)
        s = self.settings
        try:
            try:
                ws.send(orjson.dumps(message).decode())
            except ConnectionClosed:
                # The server may have answered before reading anything (CAPACITY_REACHED comes
                # at once, then the close): that answer is still to be read.
                raw = ws.recv(timeout=1.0)
                return self._answer(raw, what)
            raw = ws.recv(timeout=max(0.01, min(s.env_read_timeout_s, self.budget.deadline - time.monotonic())))
        except TimeoutError:
            self._drop_socket()
            if self.budget.deadline - time.monotonic() <= 0:
                raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out waiting for "
                                                    f"{self.shown}") from None
            raise EpisodeError(ENV_UNREACHABLE, f"{what}: no answer within {s.env_read_timeout_s:g}s ({self.shown})",
                               transient=True, outage=True) from None
        except ConnectionClosed as exc:
            self._drop_socket()
            sent = getattr(exc, "sent", None)
            if sent is not None and getattr(sent, "code", None) == 1009:
                raise EpisodeError(ENV_MALFORMED, f"{what}: a frame larger than max_response_bytes="
                                                  f"{s.max_response_bytes}", transient=False) from None
            raise EpisodeError(ENV_INSTANCE_LOST, f"{what}: the socket closed ({exc}); the session went with it "
                                                  f"({self.shown})", transient=True, outage=True) from None
        except OSError as exc:
            self._drop_socket()
            raise EpisodeError(ENV_INSTANCE_LOST, f"{what}: {type(exc).__name__}: {exc} ({self.shown})",
                               transient=True, outage=True) from None
        return self._answer(raw, what)

    def _answer(self, raw: Any, what: str) -> Any:
        if not isinstance(raw, str):
            raise EpisodeError(ENV_MALFORMED, f"{what}: a binary frame ({len(raw)} bytes), not a JSON text frame",
                               transient=False)
        try:
            frame = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EpisodeError(ENV_MALFORMED, f"{what}: a frame that is not JSON ({len(raw)} characters)",
                               transient=False) from None
        if not isinstance(frame, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: a JSON {type(frame).__name__} frame, not an object",
                               transient=False)
        kind, data = frame.get("type"), frame.get("data")
        if kind == "error":
            raise self._error(data, what)
        if kind != "observation" or not isinstance(data, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: a frame of type {str(kind)[:40]!r} where an observation "
                                              "was expected", transient=False)
        observation = data.get("observation")
        if not isinstance(observation, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: the observation is a {type(observation).__name__}, "
                                              "not an object", transient=False)
        reward = data.get("reward")
        if isinstance(reward, bool):
            reward = float(reward)
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise EpisodeError(ENV_MALFORMED, f"{what}: reward is not a finite number or null", transient=False)
        result = check_step_answer({"reward": reward, "terminated": data.get(DONE_FIELD), "truncated": False,
                                    "info": _info(observation)}, what)
        self.observation, self.done = observation, result.terminated
        return result

    def _error(self, data: Any, what: str) -> Exception:
        data = data if isinstance(data, dict) else {}
        code = str(data.get("code") or "")
        message = str(data.get("message") or "")[:500]
        if code == CAPACITY_REACHED:
            return _Full(f"{code}: {message}")
        self._drop_socket()  # the server closes it after a session-level error; ours never goes on after one
        reason, transient = ERROR_CODES.get(code, (ENV_SERVER_ERROR, True))
        return EpisodeError(reason, f"{what}: the server answered {code or 'an error'}: {message}", transient=transient)

    def _drop_socket(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:  # noqa: BLE001
                pass


class _Full(Exception):
    """``CAPACITY_REACHED``: the server holds as many sessions as it may."""


def _info(observation: dict) -> dict:
    """The step's info: the observation, unless it is large (it is in the next prompt anyway)."""
    try:
        size = len(orjson.dumps(observation))
    except TypeError:
        return {}
    if size > INFO_OBSERVATION_BYTES:
        return {"observation_bytes": size}
    return {"observation": observation}
