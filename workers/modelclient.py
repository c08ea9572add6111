"""HTTP client for the policy: any OpenAI-compatible chat-completions endpoint (docs/protocol.md#model-endpoint).

``complete`` POSTs ``{base_url}/chat/completions`` with ``{"model", "messages", "temperature",
**params}`` (``params`` carries ``max_tokens``, ``top_p``, ``stop`` and any extra body fields) and
``Authorization: Bearer <api_key>`` when a key is given.

Retry rule: a chat completion has no side effects we care about, so 429, 5xx, connection errors
and timeouts are retried: at most ``1 + settings.llm_retries`` tries, capped exponential back-off
with full jitter (``llm_backoff_initial_s`` .. ``llm_backoff_max_s``), a ``Retry-After`` header
(seconds or HTTP date) replacing the back-off when present, capped at ``llm_backoff_max_s``.
Exhausted: ``MODEL_UNAVAILABLE`` (transient). A job whose model cap adapts to the server
(``--concurrency auto``, workers/adaptive_caps.py) retries 429, 502/503/504 and read timeouts until
the attempt's budget ends instead: the cap shrinks until the server copes, and the episode must
not fail meanwhile; its other failures keep the ``llm_retries`` bound. An error answer saying that the prompt is longer
than the model's context window (:func:`context_overflow`): ``ContextOverflow`` at once, which
the step loop turns into the episode's truncated end. Any other 4xx: ``MODEL_BAD_REQUEST`` at once
(permanent: a malformed request, a bad parameter). Not JSON, no choices, wrong types, or an answer
larger than ``settings.max_response_bytes``: ``MODEL_MALFORMED`` (permanent).

Deadline: as in :mod:`workers.envclient`, ``deadline`` is an absolute ``time.monotonic()``; no
request starts and no back-off sleep is taken that would pass it (``EPISODE_TIMEOUT``).

The api key is never put into an exception message, a log line or a repr (error texts quoted
from the server are scrubbed of it too); URLs are logged through ``redact_url``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import orjson
import requests

from broker.errors import (
    EPISODE_TIMEOUT,
    MODEL_BAD_REQUEST,
    MODEL_MALFORMED,
    MODEL_UNAVAILABLE,
    ContextOverflow,
    EpisodeError,
)
from broker.settings import Secret, redact_url
from broker.tokens import TOK_PROMPT_IDS
from workers.token_answers import TokenAnswer, read_tokens, request_fields, set_prompt_ids
from workers.deadlines import deadline_passed, timeouts
from workers.http_errors import describe, error_text, retry_after_s
from workers.http_transport import PooledClient, Reply, TooLarge, parse_json, send
from workers.retries import Retryable, run_with_retries

log = logging.getLogger(__name__)


@dataclass
class Completion:
    content: str  # null content -> ""
    finish_reason: str  # absent -> "stop"
    weight_version: str | None  # top-level metadata.weight_version, stringified
    latency_s: float  # wall time of the request that answered (not counting failed tries)
    attempts: int = 1  # how many requests it took
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server reports usage
    completion_tokens: int | None = None  # usage.completion_tokens, likewise
    tokens: TokenAnswer | None = None  # what the server sampled, when the job asked (workers/token_answers.py)
    tool_calls: list | None = None  # choices[0].message.tool_calls, when the answer calls tools (a list of objects)
    reasoning_content: str = ""  # choices[0].message.reasoning_content (or .reasoning): the answer's reasoning


class ModelClient(PooledClient):
    """Calls the policy endpoint. One instance per worker process, shared by its threads."""

    def complete(self, base_url: str, messages: list, *, model: str, temperature: float, params: dict | None = None,
                 deadline: float, api_key: str = "", tokens: str = "", pacer: Any = None) -> Completion:
        """``tokens``: the job's token mode (broker/tokens.py TOKEN_MODES): the request asks
        for token ids and logprobs in that server's way and ``Completion.tokens`` holds them.
        ``pacer``: the endpoint's fleet-wide rate limits (workers/pacing.py), asked before each
        try and told each answer's status and headers and the tokens used; None: not paced."""
        s = self.settings
        url = f"{base_url.rstrip('/')}/chat/completions"
        shown = redact_url(url)
        what = f"chat completion ({model} at {shown})"
        key = api_key.reveal() if isinstance(api_key, Secret) else str(api_key or "")
        key = key.strip()

        headers = {"Accept": "application/json"}
        if key:
            # requests would quote a bad header value in its exception message: check it here.
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key) or not key.isascii():
                raise EpisodeError(MODEL_BAD_REQUEST, f"{what}: the api key contains characters not allowed in a header")
            headers["Authorization"] = f"Bearer {key}"
        try:
            # The token fields go first: a job's own llm_params (say, top_logprobs: 5) win.
            data = orjson.dumps({"model": model, "messages": messages, "temperature": temperature,
                                 **request_fields(tokens), **(params or {})})
        except (TypeError, ValueError) as exc:
            raise EpisodeError(MODEL_BAD_REQUEST, f"{what}: request body is not JSON-serialisable ({type(exc).__name__})") from None
        tries = 0
        bound = _TryBound(pacer, s.llm_retries)

        def attempt() -> Reply:
            nonlocal tries
            if pacer is not None:
                pacer.before_try()
            timeout = timeouts(deadline, s.llm_connect_timeout_s, s.llm_read_timeout_s, what=what)
            tries += 1
            try:
                reply = send(
                    self.http, "POST", url, deadline=deadline, timeout=timeout,
                    max_bytes=s.max_response_bytes, what=what, body=data, headers=headers,
                )
            except TooLarge as exc:
                raise EpisodeError(
                    MODEL_MALFORMED, f"{what}: answer larger than max_response_bytes={s.max_response_bytes} ({exc})"
                ) from None
            except requests.exceptions.RequestException as exc:
                if deadline_passed(deadline):
                    raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out") from None
                # The request exception's text holds host/port/path only, but it is not chained
                # (belt and braces: nothing of the request can leak through a traceback).
                error = Retryable(EpisodeError(MODEL_UNAVAILABLE, f"{what}: {describe(exc)}", outage=True))
                if bound.adaptive and isinstance(exc, requests.exceptions.ReadTimeout):
                    pacer.after_failure("read timeout")
                    raise error from None
                raise bound.other(error) from None
            except EpisodeError:
                raise  # the budget ran out mid-answer (workers/http_watchdog.py)
            except Exception as exc:  # e.g. InvalidHeader/InvalidURL, whose text may quote values
                raise EpisodeError(MODEL_BAD_REQUEST, f"{what}: request could not be sent ({type(exc).__name__})") from None
            if pacer is not None:
                pacer.after_reply(reply.status, reply.headers)
            if reply.ok:
                return reply
            text = error_text(reply, scrub=key)
            if reply.status not in _OUTAGE_STATUSES:
                server = context_overflow(reply.body)
                if server:
                    raise ContextOverflow(f"{what}: the prompt is longer than the model's context ({server}): "
                                          f"HTTP {reply.status}: {text}", server=server, status=reply.status)
            if reply.status == 429 or reply.status >= 500:
                error = Retryable(
                    EpisodeError(MODEL_UNAVAILABLE, f"{what}: HTTP {reply.status}: {text}", status=reply.status,
                                 outage=reply.status in _OUTAGE_STATUSES),
                    retry_after=retry_after_s(reply.headers, s.llm_backoff_max_s),
                )
                raise error if reply.status in _OUTAGE_STATUSES else bound.other(error)
            raise EpisodeError(MODEL_BAD_REQUEST, f"{what}: HTTP {reply.status}: {text}", status=reply.status)

        reply = run_with_retries(
            attempt,
            attempts=bound.attempts,
            backoff_initial_s=s.llm_backoff_initial_s,
            backoff_max_s=s.llm_backoff_max_s,
            deadline=deadline,
            what=what,
            log_target=shown,
            logger=log,
        )
        completion = _parse(reply, what, tries, tokens)
        if pacer is not None:
            pacer.charge((completion.prompt_tokens or 0) + (completion.completion_tokens or 0))
        ans = completion.tokens
        if ans is not None and ans.needs_prompt_tokenize:
            self._llama_prompt_ids(base_url, messages, ans, completion.prompt_tokens, headers, deadline, what)
        return completion

    def _llama_prompt_ids(self, base_url: str, messages: list, ans: TokenAnswer, usage_prompt: int | None,
                          headers: dict, deadline: float, what: str) -> None:
        """llama.cpp's prompt ids: its own template (``/apply-template``) and tokenizer
        (``/tokenize``, special tokens parsed and added as its chat route does). A failure
        marks the step's tokens invalid; it never fails the step (the answer is already had)."""
        root = base_url.rstrip("/")
        root = root[:-3] if root.endswith("/v1") else root
        try:
            prompt = self._post_json(f"{root}/apply-template", {"messages": messages}, headers, deadline)["prompt"]
            ids = self._post_json(f"{root}/tokenize", {"content": prompt, "add_special": True, "parse_special": True},
                                  headers, deadline)["tokens"]
        except EpisodeError:
            raise  # the attempt's budget ran out: as for any call
        except Exception as exc:
            ans.invalid(TOK_PROMPT_IDS, f"{what}: prompt ids from /apply-template + /tokenize failed: "
                                        f"{type(exc).__name__}: {str(exc)[:120]}")
            return
        set_prompt_ids(ans, ids, usage_prompt)

    def _post_json(self, url: str, body: dict, headers: dict, deadline: float) -> Any:
        s = self.settings
        timeout = timeouts(deadline, s.llm_connect_timeout_s, s.llm_read_timeout_s, what=url)
        reply = send(self.http, "POST", url, deadline=deadline, timeout=timeout, max_bytes=s.max_response_bytes,
                     what=redact_url(url), body=orjson.dumps(body), headers=headers)
        if not reply.ok:
            raise ValueError(f"HTTP {reply.status}")
        obj = parse_json(reply.body)
        if not isinstance(obj, dict):
            raise ValueError("answer is not an object")
        return obj


# How each server says that a prompt does not fit the model's context window (all answer HTTP
# 400). A sign is (server, field, text): for "code" and "type" the error object's field equals
# ``text``; for "message" the error message contains it (case ignored). The error object is
# the answer's ``error`` (OpenAI, llama.cpp) or the answer itself (vLLM, SGLang). Only the
# server's own words count: a 400 that says nothing of the context stays a bad request.
CONTEXT_OVERFLOW_SIGNS: tuple[tuple[str, str, str], ...] = (
    # OpenAI: {"error": {"message": "This model's maximum context length is 8192 tokens. However,
    # your messages resulted in 9000 tokens. ...", "type": "invalid_request_error",
    # "param": "messages", "code": "context_length_exceeded"}}
    ("OpenAI", "code", "context_length_exceeded"),
    # llama.cpp llama-server: {"error": {"code": 400, "message": "request (2057 tokens) exceeds the
    # available context size (2048 tokens), try increasing it", "type": "exceed_context_size_error"}};
    # older builds: "the request exceeds the available context size, try increasing it".
    ("llama.cpp", "type", "exceed_context_size_error"),
    ("llama.cpp", "message", "exceeds the available context size"),
    # vLLM: {"object": "error", "message": "This model's maximum context length is 4096 tokens.
    # However, you requested 5000 tokens (4000 in the messages, 1000 in the completion). ...",
    # "type": "BadRequestError", "code": 400} (newer: the same under "error"); its engine's own
    # check: "The decoder prompt (length 5000) is longer than the maximum model length of 4096."
    ("vLLM", "message", "maximum context length is"),
    ("vLLM", "message", "is longer than the maximum model length"),
    # SGLang: {"object": "error", "message": "The input (5000 tokens) is longer than the model's
    # context length (4096 tokens).", ...}; with max_tokens counted in: "Requested token count
    # exceeds the model's maximum context length of 4096 tokens. You requested a total of ..."
    ("SGLang", "message", "is longer than the model's context length"),
    ("SGLang", "message", "exceeds the model's maximum context length"),
)
# 429 and 502/503/504 are a busy or absent server whatever the body says (a proxy's page).
_OUTAGE_STATUSES = frozenset({429, 502, 503, 504})
_UNTIL_DEADLINE = 1 << 30  # the tries of an adaptive job's call: its overloads end only with the attempt's budget


class _TryBound:
    """How many tries a call gets: ``1 + llm_retries``; under an adaptive cap
    (workers/adaptive_caps.py), overloads until the attempt's budget ends (the cap is cut until the
    server copes) and other failures still ``1 + llm_retries``."""

    def __init__(self, pacer: Any, retries: int):
        self.adaptive = bool(getattr(pacer, "adaptive", False))
        self.retries = max(0, retries)
        self.others = 0

    @property
    def attempts(self) -> int:
        return _UNTIL_DEADLINE if self.adaptive else 1 + self.retries

    def other(self, error: Retryable) -> Retryable:
        """``error`` (not an overload) to retry, or its final error once the bound is reached."""
        if self.adaptive:
            self.others += 1
            if self.others > self.retries:
                raise error.error
        return error


def context_overflow(body: bytes) -> str | None:
    """The server whose context-overflow wording the error answer ``body`` carries (a name from
    :data:`CONTEXT_OVERFLOW_SIGNS`), or None when it is some other error."""
    try:
        obj: Any = parse_json(body)
    except ValueError:
        obj = body.decode("utf-8", "replace")  # a plain-text error page
    objects: list[dict] = []
    messages: list[str] = []
    for candidate in (obj, obj.get("error") if isinstance(obj, dict) else None):
        if isinstance(candidate, dict):
            objects.append(candidate)
            for key in ("message", "detail"):
                if isinstance(candidate.get(key), str):
                    messages.append(candidate[key])
        elif isinstance(candidate, str):
            messages.append(candidate)
    lowered = [m.lower() for m in messages]
    for server, where, sign in CONTEXT_OVERFLOW_SIGNS:
        if where == "message":
            if any(sign.lower() in m for m in lowered):
                return server
        elif any(o.get(where) == sign for o in objects):
            return server
    return None


def _parse(reply: Reply, what: str, tries: int, tokens: str = "") -> Completion:
    def bad(detail: str) -> EpisodeError:
        return EpisodeError(MODEL_MALFORMED, f"{what}: {detail}")

    try:
        obj: Any = parse_json(reply.body)
    except ValueError:
        # A server may write a NaN logprob as the bare word NaN, which JSON does not allow: with
        # tokens asked for, such an answer is read with the constants as strings, so the step
        # keeps its text and the check marks its tokens invalid (bad_logprob).
        obj = _lenient_json(reply.body) if tokens else None
        if obj is None:
            raise bad(f"answer is not JSON ({len(reply.body)} bytes)") from None
    if not isinstance(obj, dict):
        raise bad(f"answer is a JSON {type(obj).__name__}, not an object")
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad("answer has no choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise bad(f"choices[0] is a {type(choice).__name__}, not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise bad("choices[0].message is missing or not an object")
    content = message.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, str):
        raise bad(f"choices[0].message.content is a {type(content).__name__}, not a string")
    finish = choice.get("finish_reason")
    if finish is None:
        finish = "stop"
    elif not isinstance(finish, str):
        raise bad(f"choices[0].finish_reason is a {type(finish).__name__}, not a string")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and (not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls)):
        raise bad("choices[0].message.tool_calls is not a list of objects")
    # vLLM's reasoning parser and llama.cpp name it reasoning_content, some servers reasoning;
    # anything but a string is no reasoning (kept, never a reason to refuse the answer).
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = message.get("reasoning")
    reasoning = reasoning if isinstance(reasoning, str) else ""
    metadata = obj.get("metadata")
    weight_version = _version_text(metadata.get("weight_version")) if isinstance(metadata, dict) else None
    usage = obj.get("usage")
    prompt_tokens = completion_tokens = None
    if isinstance(usage, dict):
        prompt_tokens = _count(usage.get("prompt_tokens"))
        completion_tokens = _count(usage.get("completion_tokens"))
    return Completion(
        content=content,
        finish_reason=finish,
        weight_version=weight_version,
        latency_s=reply.elapsed_s,
        attempts=tries,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        tokens=read_tokens(tokens, obj, None if tool_calls else content) if tokens else None,
        tool_calls=tool_calls or None,
        reasoning_content=reasoning,
    )


def _version_text(wv: Any) -> str | None:
    """``metadata.weight_version`` as the text stored with the step; None when there is none, or
    when it cannot be written back as JSON (nested past orjson's depth limit): a version nobody
    could order or compare anyway, and no reason to fail a step whose answer is good."""
    if wv is None or isinstance(wv, str):
        return wv
    if not isinstance(wv, (dict, list)):
        return str(wv)
    try:
        return orjson.dumps(wv).decode()
    except orjson.JSONEncodeError:
        return None


def _lenient_json(body: bytes) -> Any:
    """JSON with NaN/Infinity/-Infinity read as the strings they spell (None if still not JSON)."""
    try:
        obj = json.loads(body, parse_constant=str)
        orjson.dumps(obj)  # refuses what orjson refuses on reading (lone surrogates, huge ints)
        return obj
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError, orjson.JSONEncodeError):
        return None


def _count(value: Any) -> int | None:
    """A token count as the server reported it, or None for anything but a sane integer (a
    malformed ``usage`` is not worth failing a step over)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        return None
    return value
