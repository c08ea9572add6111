"""The env port of an Open Reward Standard server (``protocol: ors``): one session per episode,
each of the model's tool calls a ``call`` answered over server-sent events.

An ORS server (``openreward.environments.server.Server``) hosts environment classes by name. A
session is an ``X-Session-ID`` header: ``POST /create {env_name, task_spec}`` makes the env
instance, ``GET /{env}/prompt`` gives the task's prompt (text and image blocks), ``GET
/{env}/tools`` the tools the model may call, ``POST /{env}/call {name, input}`` runs one and
answers ``text/event-stream``: a ``task_id`` event, then the result (a ``RunToolOutput`` JSON
text, cut into ``chunk`` events, the last one ``end``) or an ``error`` event. ``POST /ping``
keeps a session alive (the server drops sessions idle for 15 minutes), ``POST /delete`` ends it.

What this port does with it, for the step loop (workers/loop.py):

* ``reset``: ``/create`` with the episode's instance id as the session id (ours, so that whoever
  closes the episode's instances can name it), the task spec being the entry's ``env_params``
  with the dataset row's fields over them; then ``/tools``. A ``create`` repeated after an
  answer that was lost finds the session made: it is deleted and made again.
* ``get_task_prompt``: the first turn asks ``/prompt`` (a user message); the port then keeps the
  conversation: each answer, and each tool's result as a ``tool`` message. The prompt goes to
  the model with the env's tools (OpenAI function schemas), as ``{"messages", "tools"}``.
* ``step(text, tool_calls)``: each tool call is a ``call``, in order; the step's reward is the
  sum of their rewards, and the episode ends (``terminated``) once one answers ``finished``. A
  call the env refuses (unknown tool, arguments that fail its schema: ``ok: false``) is the
  model's mistake: its error goes back to the model as the tool's result. An answer without tool
  calls goes to the env's terminal tool when it has one (ORS's rule for a plain assistant
  message), else ends the episode truncated: the model stopped acting.
* A ``call`` is never sent twice. A stream that stops before its ``end`` (or mid-event) is
  asked again by its ``task_id`` (the server keeps a finished call's result for a minute, and
  answers it without running the tool again); without one, the attempt ends (transient) and the
  episode starts afresh.
* While the session is open, a process-wide keeper pings it when it has been idle a while
  (:data:`PING_EVERY_S`), so that a model thinking for long does not lose it.
* ``close``: ``POST /delete``, once.

The conversation (tool results included) lives in the worker, so an attempt cut off is followed
by a fresh start (broker/resume.py ``outlives_worker``); its session is deleted then, or by the
orphan closers. Answers are untrusted: a body that is not JSON, a result that is not a
``RunToolOutput``, a stream larger than ``max_response_bytes`` fail the episode as
``env_malformed``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import orjson
import urllib3
from urllib3.exceptions import ConnectTimeoutError, HTTPError, NewConnectionError, ProtocolError, ReadTimeoutError

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
from broker.states import EnvProtocol
from workers.budget import Budget
from workers.envport import CLOSE_BUDGET_S, StepResult
from workers.openenv_port import reset_data

log = logging.getLogger("interactor.ors")

READINESS = "/health"
PING_EVERY_S = 120.0  # the server drops a session after 15 idle minutes
SESSION_HEADER = "X-Session-ID"
_SSE_READ_BYTES = 65536


def task_spec(spec: EpisodeSpec) -> dict:
    """The ``task_spec`` of ``/create``: the entry's params with its dataset row's fields over them."""
    data = reset_data(spec)
    data.pop("seed", None)
    return data


def prompt_messages(blocks: Any, what: str) -> list[dict]:
    """ORS prompt blocks as one user message: text blocks joined, images as ``image_url`` parts."""
    if not isinstance(blocks, list):
        raise EpisodeError(ENV_MALFORMED, f"{what}: the prompt is a {type(blocks).__name__}, not a list of blocks",
                           transient=False)
    return [{"role": "user", "content": blocks_content(blocks, what)}]


def blocks_content(blocks: list, what: str) -> str | list:
    parts: list[dict] = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: block {i} is not an object", transient=False)
        kind = block.get("type", "text")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("data"), str) and isinstance(block.get("mimeType"), str):
            parts.append({"type": "image_url",
                          "image_url": {"url": f"data:{block['mimeType']};base64,{block['data']}"}})
        else:
            raise EpisodeError(ENV_MALFORMED, f"{what}: block {i} is neither a text nor an image block",
                               transient=False)
    if all(p["type"] == "text" for p in parts):
        return "\n\n".join(p["text"] for p in parts)
    return parts


def openai_tools(listed: Any, what: str) -> tuple[list[dict], dict | None]:
    """``/tools``'s answer as OpenAI function schemas, and the terminal tool's spec (or None)."""
    if not isinstance(listed, dict) or not isinstance(listed.get("tools"), list):
        raise EpisodeError(ENV_MALFORMED, f"{what}: the answer has no 'tools' list", transient=False)
    tools = []
    for i, t in enumerate(listed["tools"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise EpisodeError(ENV_MALFORMED, f"{what}: tool {i} has no name", transient=False)
        schema = t.get("input_schema")
        tools.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description") if isinstance(t.get("description"), str) else "",
            "parameters": schema if isinstance(schema, dict) else {"type": "object", "properties": {}}}})
    terminal = listed.get("terminal_tool")
    return tools, terminal if isinstance(terminal, dict) and isinstance(terminal.get("name"), str) else None


def call_arguments(call: Any) -> tuple[str, str, dict | str]:
    """(id, name, input) of an OpenAI tool call; the input is an error text when the model's
    arguments are not a JSON object (the model is told so as the tool's result)."""
    if not isinstance(call, dict):
        return "", "", "the tool call is not an object"
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    call_id = call.get("id") if isinstance(call.get("id"), str) else ""
    name = fn.get("name") if isinstance(fn.get("name"), str) else ""
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            return call_id, name, "the arguments are not JSON"
    if not isinstance(args, dict):
        return call_id, name, "the arguments are not a JSON object"
    return call_id, name, args


class SseEvents:
    """Server-sent events parsed from a byte stream, as they complete (the WHATWG rules this
    needs: ``event:``/``data:`` fields, comments, and any of the three line ends)."""

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        self._buf += chunk
        out = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                return out
            end, nxt = cut
            line, self._buf = self._buf[:end].decode("utf-8", "replace"), self._buf[nxt:]
            if line == "":
                if self._data or self._event:
                    out.append((self._event or "message", "\n".join(self._data)))
                self._event, self._data = "", []
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                self._event = value
            elif field == "data":
                self._data.append(value)


def _line_end(buf: bytes) -> tuple[int, int] | None:
    """Where the first line of ``buf`` ends and the next begins, or None: no whole line yet (a
    ``\\r`` at the very end may be half of a ``\\r\\n``)."""
    for i, b in enumerate(buf):
        if b == 10:
            return i, i + 1
        if b == 13:
            if i + 1 == len(buf):
                return None
            return i, i + 2 if buf[i + 1] == 10 else i + 1
    return None


class KeepAlive:
    """Pings the open ORS sessions of this process that have been idle :data:`PING_EVERY_S`."""

    def __init__(self, every_s: float = PING_EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, str], tuple[Any, float]] = {}
        self._thread: threading.Thread | None = None
        self.pings = 0

    def touch(self, client: Any, base_url: str, sid: str) -> None:
        with self._lock:
            self._sessions[(base_url, sid)] = (client, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ors-keepalive", daemon=True)
                self._thread.start()

    def forget(self, base_url: str, sid: str) -> None:
        with self._lock:
            self._sessions.pop((base_url, sid), None)

    def _run(self) -> None:
        while True:
            time.sleep(min(10.0, self.every_s / 4))
            now = time.monotonic()
            with self._lock:
                due = [(k, c) for k, (c, t) in self._sessions.items() if now - t >= self.every_s]
            for (base_url, sid), client in due:
                with self._lock:
                    if (base_url, sid) not in self._sessions:
                        continue  # closed meanwhile
                try:
                    client._call("POST", f"{base_url}/ping", what=f"ors ping {sid}", deadline=time.monotonic() + 10,
                                 idempotent=True, raise_4xx=False, headers={SESSION_HEADER: sid})
                    self.pings += 1
                except Exception as exc:  # noqa: BLE001 - the next call will tell what became of the session
                    log.info("ors ping of %s at %s failed: %s", sid, redact_url(base_url), exc)
                with self._lock:
                    if (base_url, sid) in self._sessions:
                        self._sessions[(base_url, sid)] = (client, time.monotonic())


KEEPALIVE = KeepAlive()
_streams = urllib3.PoolManager(num_pools=64, maxsize=64, retries=False)


class OrsPort:
    """One episode's session on an ORS server, as the loop's env port (workers/envport.py)."""

    def __init__(self, spec: EpisodeSpec, instance: str, settings: Settings, budget: Budget, guard: Any,
                 breaker: Any, check: Any, client: Any, keepalive: KeepAlive = KEEPALIVE):
        self.spec, self.sid, self.settings, self.budget = spec, instance, settings, budget
        self.guard, self.breaker, self.check, self.client = guard, breaker, check, client
        self.keepalive = keepalive
        self.base = spec.base_url.rstrip("/")
        self.shown = redact_url(spec.base_url)
        self.env = spec.env_name
        self.messages: list[dict] = []
        self.tools: list[dict] = []
        self.terminal: dict | None = None
        self.finished = False
        self.created = False
        self.closed = False
        self.replayed = 0  # calls whose stream stopped and whose result was asked for again by task_id

    # --- the port ----------------------------------------------------------------------
    def reset(self) -> dict:
        self.guard.call(self.breaker, self._create, retry_safe=True)
        self.created, self.closed = True, False
        listed = self.guard.call(self.breaker, lambda: self._json("GET", f"/{self.env}/tools", "ors tools"),
                                 retry_safe=True)
        self.tools, self.terminal = openai_tools(listed, f"ors tools {self.env}")
        return {"observation": {}, "info": {}}

    def get_task_prompt(self) -> Any:
        if self.finished:
            return []
        if not self.messages:
            blocks = self.guard.call(self.breaker, lambda: self._json("GET", f"/{self.env}/prompt", "ors prompt"),
                                     retry_safe=True)  # a read of the task: safe to repeat
            self.messages = prompt_messages(blocks, f"ors prompt {self.env}")
        if not self.tools:
            return list(self.messages)
        return {"messages": list(self.messages), "tools": self.tools}

    def step(self, action: str, tool_calls: list | None = None) -> StepResult:
        assistant: dict = {"role": "assistant", "content": action}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        self.messages.append(assistant)
        reward, finished, truncated, results = 0.0, False, False, []
        if tool_calls:
            for call in tool_calls:
                call_id, name, args = call_arguments(call)
                if finished:
                    text = "not run: the episode finished with an earlier call"
                elif isinstance(args, str):
                    text = f"error: {args}"
                else:
                    output = self._tool(name, args)
                    text, r, finished = self._result(output)
                    reward += r
                results.append(name)
                self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif self.terminal is not None:
            arg = self.terminal.get("arg")
            output = self._tool(self.terminal["name"], {arg: action} if isinstance(arg, str) else {})
            _, reward, finished = self._result(output)
            finished = True  # a plain answer ends the rollout (ORS's terminal-tool rule)
            results.append(self.terminal["name"])
        else:
            truncated = True  # the model answered without a tool call and the env has no terminal tool
        if not math.isfinite(reward):
            raise EpisodeError(ENV_MALFORMED, f"ors call {self.env}: the rewards sum past the float range",
                               transient=False)
        self.finished = finished or truncated
        return StepResult(reward=reward, terminated=finished, truncated=truncated and not finished,
                          info={"tools_called": results})

    def close(self) -> None:
        if self.closed or not self.created:
            return
        self.closed = True
        self.keepalive.forget(self.base, self.sid)
        self.client.close(self.spec.base_url, self.env, self.sid, deadline=time.monotonic() + CLOSE_BUDGET_S,
                          protocol=EnvProtocol.ORS)

    # --- the calls ---------------------------------------------------------------------
    def _create(self) -> None:
        body = orjson.dumps({"env_name": self.env, "task_spec": task_spec(self.spec)})
        what = f"ors create {self.env}/{self.sid}"
        reply = self.client._call("POST", f"{self.base}/create", what=what, deadline=self.budget.deadline, body=body,
                                  idempotent=True, raise_4xx=False, headers={SESSION_HEADER: self.sid})
        if reply.status == 400 and b"already exists" in reply.body:
            # our own create, whose answer was lost, landed: make it again from scratch
            self.client.close(self.spec.base_url, self.env, self.sid, deadline=self.budget.deadline, protocol=EnvProtocol.ORS)
            reply = self.client._call("POST", f"{self.base}/create", what=what, deadline=self.budget.deadline,
                                      body=body, idempotent=True, headers={SESSION_HEADER: self.sid})
        if not reply.ok:
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: HTTP {reply.status}: {_text(reply.body)}",
                               status=reply.status, transient=False)
        self.keepalive.touch(self.client, self.base, self.sid)

    def _json(self, method: str, path: str, what: str) -> Any:
        what = f"{what} {self.env}/{self.sid}"
        # 503 (the env's setup() still running) is retried with back-off by the client
        reply = self.client._call(method, f"{self.base}{path}", what=what, deadline=self.budget.deadline,
                                  idempotent=True, raise_4xx=False, headers={SESSION_HEADER: self.sid})
        self.keepalive.touch(self.client, self.base, self.sid)
        if reply.status in (404, 410):
            raise EpisodeError(ENV_INSTANCE_LOST, f"{what}: HTTP {reply.status}: {_text(reply.body)} (the server no "
                                                  "longer has the session)", status=reply.status)
        if not reply.ok:
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: HTTP {reply.status}: {_text(reply.body)}",
                               status=reply.status, transient=False)
        try:
            return orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer is not JSON ({len(reply.body)} bytes)",
                               transient=False) from None

    def _tool(self, name: str, args: dict) -> Any:
        """One ``call``, its stream read to its end: the ``RunToolOutput`` it answered."""
        what = f"ors call {self.env}/{self.sid} {name[:80]!r}"
        body: dict = {"name": name, "input": args}
        try:
            return self.guard.call(self.breaker, lambda: self._stream(body, what), retry_safe=False)
        finally:
            self.keepalive.touch(self.client, self.base, self.sid)

    def _stream(self, body: dict, what: str) -> Any:
        task_id = ""
        for tries in (1, 2):
            try:
                return self._read_call(body, what, task_id)
            except _Cut as cut:
                if cut.task_id and tries == 1:
                    # the server keeps the call's result by its task id: ask again, nothing runs twice
                    task_id = cut.task_id
                    self.replayed += 1
                    log.info("%s: the stream stopped before its end (%s); asking again by task id", what, cut)
                    continue
                raise EpisodeError(ENV_UNREACHABLE, f"{what}: the event stream stopped before its end ({cut}); "
                                                    "the call may have run", transient=True, outage=True) from None
        raise AssertionError("unreachable")

    def _read_call(self, body: dict, what: str, task_id: str) -> Any:
        s = self.settings
        payload = {**body, "task_id": task_id} if task_id else body
        left = self.budget.deadline - time.monotonic()
        if left <= 0:
            raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out")
        try:
            resp = _streams.request(
                "POST", f"{self.base}/{self.env}/call", body=orjson.dumps(payload), preload_content=False,
                headers={SESSION_HEADER: self.sid, "Content-Type": "application/json", "Accept": "text/event-stream"},
                timeout=urllib3.Timeout(connect=min(s.env_connect_timeout_s, left), read=min(s.env_read_timeout_s, left)),
                redirect=False)
        except (NewConnectionError, ConnectTimeoutError) as exc:
            raise EpisodeError(ENV_UNREACHABLE, f"{what}: {type(exc).__name__} ({self.shown})", outage=True,
                               maybe_applied=False) from None
        except HTTPError as exc:
            if task_id:
                raise _Cut(f"{type(exc).__name__}", task_id) from None
            raise EpisodeError(ENV_UNREACHABLE, f"{what}: {type(exc).__name__}: {exc} ({self.shown})",
                               outage=True) from None
        try:
            if resp.status != 200:
                text = _text(resp.read(4096))
                if resp.status in (404, 410):
                    raise EpisodeError(ENV_INSTANCE_LOST, f"{what}: HTTP {resp.status}: {text}", status=resp.status)
                if resp.status in (429, 503):
                    raise EpisodeError(ENV_SERVER_ERROR, f"{what}: HTTP {resp.status}: {text}", status=resp.status,
                                       outage=True, maybe_applied=False)
                if resp.status >= 500:
                    raise EpisodeError(ENV_SERVER_ERROR, f"{what}: HTTP {resp.status}: {text}", status=resp.status,
                                       outage=resp.status in (502, 504))
                raise EpisodeError(ENV_BAD_REQUEST, f"{what}: HTTP {resp.status}: {text}", status=resp.status,
                                   transient=False)
            return self._events(resp, what, task_id)
        finally:
            # not kept alive: what a stream leaves unread (its last chunk, a keep-alive comment)
            # would be read as the next answer on the connection
            resp.close()
            resp.release_conn()

    def _events(self, resp: Any, what: str, task_id: str) -> Any:
        s = self.settings
        events, result, size = SseEvents(), [], 0
        try:
            while True:
                if time.monotonic() >= self.budget.deadline:
                    raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out mid-stream")
                chunk = resp.read1(_SSE_READ_BYTES) if hasattr(resp, "read1") else resp.read(_SSE_READ_BYTES)
                if not chunk:
                    raise _Cut("the server closed the stream", task_id)
                size += len(chunk)
                if size > s.max_response_bytes:
                    raise EpisodeError(ENV_MALFORMED, f"{what}: a stream larger than max_response_bytes="
                                                      f"{s.max_response_bytes}", transient=False)
                for event, data in events.feed(chunk):
                    if event == "task_id":
                        task_id = data.strip()
                    elif event == "chunk":
                        result.append(data)
                    elif event == "end":
                        result.append(data)
                        return _run_tool_output("".join(result), what)
                    elif event == "error":
                        raise EpisodeError(ENV_SERVER_ERROR, f"{what}: the env's error event: {data[:500]}",
                                           transient=True)
        except ReadTimeoutError:
            raise _Cut(f"no event within {s.env_read_timeout_s:g}s", task_id) from None
        except (ProtocolError, HTTPError, OSError) as exc:
            raise _Cut(f"{type(exc).__name__}", task_id) from None

    def _result(self, output: dict) -> tuple[str, float, bool]:
        """(the text the model sees, the reward, finished) of a ``RunToolOutput``."""
        if output.get("ok") is True:
            out = output["output"]
            return (blocks_content(out.get("blocks") or [], f"ors call {self.env}"), out["reward"],
                    bool(out.get("finished")))
        return f"error: {output.get('error')}", 0.0, output.get("reason") == "episode_finished"


class _Cut(Exception):
    """A call's stream that stopped before its ``end`` event; ``task_id`` to ask for it again."""

    def __init__(self, why: str, task_id: str):
        super().__init__(why)
        self.task_id = task_id


def _run_tool_output(text: str, what: str) -> dict:
    """A ``RunToolOutput`` (``{"ok": true, "output": {blocks, reward, finished}}`` or ``{"ok":
    false, "error", "reason"}``), checked; the reward a finite number (null: 0)."""
    try:
        out = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise EpisodeError(ENV_MALFORMED, f"{what}: the call's result is not JSON ({len(text)} characters)",
                           transient=False) from None
    if not isinstance(out, dict) or not isinstance(out.get("ok"), bool):
        raise EpisodeError(ENV_MALFORMED, f"{what}: the call's result is not a RunToolOutput", transient=False)
    if out["ok"]:
        inner = out.get("output")
        if not isinstance(inner, dict) or not isinstance(inner.get("blocks", []), list):
            raise EpisodeError(ENV_MALFORMED, f"{what}: the call's output has no blocks", transient=False)
        reward = inner.get("reward")
        if reward is None:
            reward = 0.0
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EpisodeError(ENV_MALFORMED, f"{what}: the call's reward is not a finite number or null",
                               transient=False)
        if not isinstance(inner.get("finished", False), bool):
            raise EpisodeError(ENV_MALFORMED, f"{what}: the call's 'finished' is not a boolean", transient=False)
        inner["reward"] = float(reward)
    return out


def _text(body: bytes) -> str:
    return body[:500].decode("utf-8", "replace").strip() or "<empty body>"
