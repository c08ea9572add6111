"""The model gateway: an OpenAI-compatible proxy in front of a job's model endpoint for agents
that own their loop (docs/protocol.md#agent-episodes), recording every call as a step.

An agent episode (workers/agent_episode.py) opens an :class:`AgentSession` here and hands the
agent a base URL ending in ``/v1`` and a per-session key. The agent's calls arrive as

* ``POST /sessions/{session}/v1/chat/completions`` (the base-URL form an OpenAI client builds),
* ``POST /v1/{session}/chat/completions`` (the original system's proxy path),
* ``GET /sessions/{session}/v1/models`` and ``GET /v1/{session}/models``,

and each is forwarded through the attempt's model port (the job's model, key, sampling, caps,
rate limits, retries and outage waits: workers/port_layers.py), then recorded as one step of the
episode, in the order the answers came back (calls made at once are each their own step).

Trust: what an agent sends is untrusted input. Its key is valid for its own session only, and
only while the session is open (the attempt holds the lease and the agent has not ended): a key
of another session is answered 401, a key of an ended session 410. Bodies are bounded
(``gateway_max_body_bytes``: 413 before reading), must be a JSON object with a non-empty list of
message objects (400 otherwise), and nothing an agent sends can stop anything but its own call.
The model's real key never leaves the worker: the port holds it, and error texts are redacted.

Streaming (``stream: true``): the model is asked without streaming and the complete answer is
sent back as server-sent events (one content chunk, one tool-call chunk, a finishing chunk and
``[DONE]``): the agent's client reads a stream, and the step is recorded once, complete.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from broker import errors
from envs.http import JSONHandler, QuietHTTPServer

log = logging.getLogger("interactor.gateway")

#: The request fields an agent may set, passed through to the model; the job's model,
#: temperature and token options are the job's (what the trajectory is trained on says so).
PASSED_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "stop", "max_tokens",
                 "max_completion_tokens", "top_p", "seed", "frequency_penalty", "presence_penalty")
#: Errors that end the session: the attempt cannot go on, so neither can its agent.
ENDING_REASONS = frozenset({errors.LEASE_LOST, errors.CANCELLED, errors.WORKER_SHUTDOWN, errors.EPISODE_TIMEOUT,
                            errors.BROKER_OUTAGE})
_ENDED_KEPT = 10_000  # ended sessions' keys remembered, for their 410


@dataclass
class Answer:
    """One forwarded call as the gateway recorded it: what the agent gets back."""

    step_id: int
    content: str | None
    tool_calls: list | None
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(eq=False)
class AgentSession:
    """One agent's session: its key, the model port its calls go through, and where each answered
    call goes (``record(messages, request, completion, seconds) -> step_id``, called under the
    session's lock so steps are numbered and published in the order answered). ``check`` raises
    when the attempt may not call anything any more (its lease, budget, cancel, shutdown)."""

    session_id: str
    model: str
    policy: Any
    record: Callable[[list, dict, Any, float], int]
    check: Callable[[], None] = lambda: None
    redact: Callable[[str], str] = lambda text: text
    key: str = field(default_factory=lambda: "ixs-" + secrets.token_urlsafe(24))
    calls: int = 0  # calls answered and recorded
    refused: int = 0  # calls refused (bad body, model error)
    error: errors.EpisodeError | None = None  # what ended the session or failed its model calls
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0


class SessionTable:
    """The open sessions of a gateway, by key, and the keys of ended ones (for their 410)."""

    def __init__(self):
        self._by_key: dict[str, AgentSession] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, session: AgentSession) -> AgentSession:
        with self._lock:
            self._by_key[session.key] = session
        return session

    def end(self, session: AgentSession, why: str = "the episode has ended") -> None:
        """No call with its key is answered from now on (410); one in flight finishes unrecorded."""
        with session.lock:
            session.ended = True
        with self._lock:
            self._by_key.pop(session.key, None)
            self._ended[session.key] = why
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)

    def find(self, key: str) -> tuple[AgentSession | None, str]:
        """(the open session of ``key``, "") or (None, why it ended) or (None, "")."""
        with self._lock:
            session = self._by_key.get(key)
            if session is not None:
                return session, ""
            return None, self._ended.get(key, "")

    def __len__(self) -> int:
        return len(self._by_key)


class Gateway(QuietHTTPServer):
    """The gateway's HTTP server (stdlib, keep-alive, a thread per connection)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_body_bytes: int = 16 << 20,
                 table: SessionTable | None = None, public_url: str = ""):
        super().__init__((host, port), _GatewayHandler)
        self.table = table if table is not None else SessionTable()
        self.max_body_bytes = max_body_bytes
        self.public_url = public_url.rstrip("/")

    def session_url(self, session: AgentSession) -> str:
        """The base URL an agent's OpenAI client is given (ends in /v1)."""
        return f"{self.public_url or self.base_url}/sessions/{session.session_id}/v1"


_local: Gateway | None = None
_local_lock = threading.Lock()


def local_gateway(max_body_bytes: int, host: str = "127.0.0.1", public_url: str = "") -> Gateway:
    """This process's gateway, started on first use: on loopback for the agents the worker runs
    itself; on ``host`` with agents given ``public_url`` (``interactor gateway``, which routes each
    session's calls here: workers/gateway_router.py) for agents that run elsewhere."""
    global _local
    with _local_lock:
        if _local is None:
            gateway = Gateway(host or "127.0.0.1", 0, max_body_bytes=max_body_bytes, public_url=public_url)
            gateway.serve_in_thread("agent-gateway")
            _local = gateway
        return _local


def advertised_url(gateway: Gateway, advertise_host: str = "") -> str:
    """Where another host reaches ``gateway``: ``advertise_host``, else the address it listens on,
    else (listening on every interface) this machine's address as its name resolves here."""
    host, port = gateway.server_address[:2]
    if not advertise_host and host in ("0.0.0.0", "::", ""):
        import socket

        advertise_host = socket.gethostbyname(socket.gethostname())
    return f"http://{advertise_host or host}:{port}"


def _error(message: str, etype: str, code: str = "") -> dict:
    return {"error": {"message": message, "type": etype, "code": code or etype}}


class _GatewayHandler(JSONHandler):
    server: Gateway
    server_version = "interactor-gateway/1"

    def dispatch(self, method: str) -> None:
        self._body_read = False  # one handler serves a keep-alive connection's requests in turn
        try:
            self._dispatch(method)
        except (ConnectionError, TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - no request may take the server down
            log.exception("gateway: %s %s failed", method, self.path[:200])
            self.close_connection = True
            try:
                self.send_json(500, _error(f"gateway error: {type(exc).__name__}", "server_error"))
            except OSError:
                pass

    def _dispatch(self, method: str) -> None:
        parts = self.split_path()
        route = _route(parts)
        if route is None:
            return self._refuse(404, f"no route for {method} {self.path[:200]}", "not_found")
        session_id, what = route
        if (what == "chat") != (method == "POST") or method not in ("GET", "POST"):
            return self._refuse(405, f"use {'POST' if what == 'chat' else 'GET'} for this route", "method_not_allowed")
        session = self._authorised(session_id)
        if session is None:
            return
        if what == "models":
            self._drain()
            return self.send_json(200, {"object": "list", "data": [
                {"id": session.model, "object": "model", "created": 0, "owned_by": "interactor"}]})
        body = self._body()
        if body is None:
            return
        request = _chat_request(body)
        if isinstance(request, str):
            with session.lock:
                session.refused += 1
            return self._refuse(400, request, "invalid_request_error")
        self._forward(session, request)

    # --- who is calling -------------------------------------------------------------------
    def _authorised(self, session_id: str) -> AgentSession | None:
        auth = self.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        session, ended = self.server.table.find(key) if key else (None, "")
        if session is not None and hmac.compare_digest(session.session_id.encode(), session_id.encode()):
            return session
        if session is None and ended:
            self._refuse(410, f"this session has ended ({ended}); its key is no longer valid", "session_ended")
            return None
        self._refuse(401, "the key is not valid for this session", "invalid_api_key")
        return None

    def _refuse(self, status: int, message: str, etype: str) -> None:
        self._drain()
        self.send_json(status, _error(message, etype))

    def _drain(self) -> None:
        """Read a small unread body so the connection stays usable; a large one closes it."""
        if getattr(self, "_body_read", False):
            return
        self._body_read = True
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if 0 < length <= 65536:
            self.rfile.read(length)
        elif length or self.headers.get("Transfer-Encoding"):
            self.close_connection = True

    def _body(self) -> bytes | None:
        limit = self.server.max_body_bytes
        self._body_read = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True  # agents' clients send lengths; chunked bodies are not read
            self.send_json(411, _error("send the body with a Content-Length", "invalid_request_error"))
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self.send_json(400, _error("Content-Length is not a number", "invalid_request_error"))
            return None
        if length > limit:
            self.close_connection = True
            self.send_json(413, _error(f"body of {length} bytes is larger than the gateway takes ({limit})",
                                       "request_too_large"))
            return None
        return self.rfile.read(length) if length else b""

    # --- the call -------------------------------------------------------------------------
    def _forward(self, session: AgentSession, request: dict) -> None:
        messages = request["messages"]
        passed = {k: request[k] for k in PASSED_FIELDS if k in request}
        t0 = time.perf_counter()
        with session.lock:
            session.in_flight += 1
        try:
            session.check()
            completion = session.policy.complete(messages, **passed)
        except errors.EpisodeError as exc:
            return self._model_failed(session, exc)
        finally:
            with session.lock:
                session.in_flight -= 1
        seconds = time.perf_counter() - t0
        with session.lock:
            if session.ended:
                return self._refuse(410, "this session ended while the call was in flight; it was not recorded",
                                    "session_ended")
            step_id = session.record(messages, passed, completion, seconds)
            session.calls += 1
        answer = Answer(step_id, completion.content if completion.content or not completion.tool_calls else None,
                        completion.tool_calls, completion.finish_reason, completion.prompt_tokens,
                        completion.completion_tokens)
        if request.get("stream"):
            include_usage = isinstance(request.get("stream_options"), dict) and bool(
                request["stream_options"].get("include_usage"))
            return self.send_bytes(200, _sse(session, answer, include_usage), "text/event-stream",
                                   headers={"Cache-Control": "no-cache"})
        self.send_bytes(200, orjson.dumps(_completion_json(session, answer)))

    def _model_failed(self, session: AgentSession, exc: errors.EpisodeError) -> None:
        message = session.redact(str(exc))
        if exc.reason in ENDING_REASONS:
            with session.lock:
                session.error = session.error or exc
            self.server.table.end(session, exc.reason)
            return self._refuse(410, f"the episode cannot go on: {message}", "session_ended")
        with session.lock:
            session.refused += 1
            if exc.reason != errors.MODEL_BAD_REQUEST:
                # the model failed the call (retries and outage waits spent): the attempt ends for
                # this reason, whatever the agent makes of the error it gets
                session.error = session.error or exc
        if exc.reason == errors.MODEL_BAD_REQUEST:
            code = "context_length_exceeded" if isinstance(exc, errors.ContextOverflow) else "invalid_request_error"
            return self._refuse(400, message, code)
        self._refuse(502, message, "upstream_error")


def _route(parts: list[str]) -> tuple[str, str] | None:
    """(session id, "chat" | "models") of a gateway path, or None."""
    if len(parts) == 5 and parts[0] == "sessions" and parts[2] == "v1" and parts[3:] == ["chat", "completions"]:
        return parts[1], "chat"
    if len(parts) == 4 and parts[0] == "sessions" and parts[2:] == ["v1", "models"]:
        return parts[1], "models"
    if len(parts) == 4 and parts[0] == "v1" and parts[2:] == ["chat", "completions"]:
        return parts[1], "chat"
    if len(parts) == 3 and parts[0] == "v1" and parts[2] == "models":
        return parts[1], "models"
    return None


def _chat_request(body: bytes) -> dict | str:
    """The request as a dict, or why it is refused (one line for the agent)."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"the body is not JSON ({len(body)} bytes)"
    if not isinstance(request, dict):
        return f"the body is a JSON {type(request).__name__}, not an object"
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role'"
    n = request.get("n", 1)
    if n not in (1, None):
        return "'n' must be 1: each call is one step of the episode"
    if "tools" in request and request["tools"] is not None and not isinstance(request["tools"], list):
        return "'tools' must be a list"
    return request


def _message(answer: Answer) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    return message


def _usage(answer: Answer) -> dict | None:
    if answer.prompt_tokens is None and answer.completion_tokens is None:
        return None
    p, c = answer.prompt_tokens or 0, answer.completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _completion_json(session: AgentSession, answer: Answer) -> dict:
    out: dict[str, Any] = {
        "id": f"chatcmpl-{session.session_id}-{answer.step_id}", "object": "chat.completion",
        "created": int(time.time()), "model": session.model,
        "choices": [{"index": 0, "message": _message(answer), "finish_reason": answer.finish_reason,
                     "logprobs": None}]}
    usage = _usage(answer)
    if usage is not None:
        out["usage"] = usage
    return out


def _sse(session: AgentSession, answer: Answer, include_usage: bool) -> bytes:
    """The complete answer as an OpenAI chat-completion stream."""
    base = {"id": f"chatcmpl-{session.session_id}-{answer.step_id}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": session.model}
    chunks: list[dict] = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": answer.content or ""},
                                                "finish_reason": None}]}]
    if answer.tool_calls:
        deltas = [{"index": i, **{k: v for k, v in call.items() if k in ("id", "type", "function")}}
                  for i, call in enumerate(answer.tool_calls)]
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": answer.finish_reason}]})
    usage = _usage(answer)
    if include_usage and usage is not None:
        chunks.append({**base, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
