"""A STAND-IN for an OpenAI-compatible chat-completions server (docs/protocol.md#model-endpoint).

This is not a model.  It is a small scripted policy behind the OpenAI wire format so the
demo, the tests and the benchmarks run without a GPU.  For real runs point
``--llm-base-url`` at vLLM, SGLang, a hosted API or a trainer-side proxy instead.

Routes (stdlib only, keep-alive HTTP/1.1):

* ``POST /v1/chat/completions`` and ``POST /v1/{session_id}/chat/completions``
  (session routing: a base URL of ``{root}/{session_id}``).  Any path ending in
  ``/chat/completions`` is accepted; the segment just before ``chat/completions``
  is taken as the session id unless it is ``v1`` (or absent).
* ``GET /v1/models`` (also ``/models``): the one model.
* ``GET /stats``: request counters (see :meth:`ModelStandin.stats`).

The scripted policy:

* ``guess_number`` (see ``examples.envserver``): reads the range ("between LOW and HIGH")
  and the feedback ("N is too low/high") from the conversation and binary-searches.  Like
  a model thinking aloud, each reply restates the remaining range
  (``"The number is in range [26, 49]. My guess: 37"``) so the search survives the
  driver trimming old turns; the guess is always the last number of the reply.
* ``arithmetic``: evaluates the "What is <expression>?" of the last user message and
  answers correctly with probability ``skill`` (default 0.7), else off by one.  The die
  is seeded from the messages, the temperature, ``fault_seed`` and a request counter, so
  identical requests (the samples of one group) may get different answers.
* ``<answer>`` prompts (reasoning-gym's system prompts): the last arithmetic expression of the
  last user message, evaluated like ``arithmetic`` (right with probability ``skill``) and
  answered as ``<answer>N</answer>``.
* textarena's GuessTheNumber ("wrapped in square brackets", "The target number is
  higher/lower."): the same binary search, the guess written as ``[N]``.
* anything else: ``"I don't know"``.
* the bundled tool task (``examples/agents/``): a request that offers a function tool named
  ``calculator`` and whose last message is the user's "What is <expression>?" is answered with
  a ``tool_calls`` call of ``calculator`` on that expression (``finish_reason: "tool_calls"``,
  no content); one whose last message is that tool's result (role ``tool``) is answered
  ``"The answer is R. <answer>R</answer>"`` with R the result, as a model that trusts its tool.

``POST /weights`` ``{"version": N}`` stands for a trainer pushing new weights (the online-RL demo,
``examples/rl_trainer.py``): the server reports ``metadata.weight_version`` ``"vN"`` from then on,
and with ``skill_per_version`` (0: off) its ``skill`` becomes ``min(0.99, skill + N *
skill_per_version)`` of the skill it started with, so rewards rise as the trainer "trains".

``GET /stats`` also reports ``request_params``: for each request body key other than
``model``, ``messages`` and ``temperature``, the distinct values seen (JSON, at most 5).

``unavailable`` (an attribute): when True every request but ``/stats`` is answered 503.

``hold()`` / ``release()``: chat requests wait, counted in ``held``, until released: a model that
stalls as long as a test needs (every episode of a worker inside a model call, say).

``replies`` (an attribute, ``{text: reply}``): a request whose last user message contains
``text`` is answered ``reply`` instead of the scripted policy's answer (tests choose an answer,
say one full of markup, for the results browser to show).

``context_tokens`` (0: no limit) gives the stand-in a context window, counted in its own tokens
(whitespace-separated words, as its ``usage`` counts them): a request whose prompt plus
``max_tokens`` does not fit is answered 400 the way real servers answer it, in the wording of
``overflow_style``: ``vllm`` (default), ``sglang``, ``llama.cpp`` (which, like the real one,
checks the prompt alone) or ``openai``. ``GET /stats`` counts them as ``context_overflows``.

Tokens (docs/protocol.md#token-options): a deterministic toy tokenizer (:class:`ToyTokenizer`:
one id per UTF-8 byte, three special tokens, a ChatML-like template that only appends) lets
the stand-in answer as the real servers do when asked. ``logprobs: true`` adds
``choices[0].logprobs.content`` (token, logprob, bytes; and ``id`` in ``tokens_style``
``llama.cpp``); ``return_token_ids: true`` adds vLLM's ``prompt_token_ids`` and
``choices[0].token_ids`` (``tokens_style`` ``vllm``, the default). ``openai`` and ``sglang``
styles give no ids. ``POST /tokenize``, ``/detokenize`` and ``/apply-template`` answer like
llama-server's routes. ``token_fault`` (an attribute) spoils the token answer the way a
broken server would: ``ids_not_text``, ``length``, ``non_integer``, ``nan``, ``positive``,
``below_float32`` (a logprob of -1e39, finite but past what float32 holds).
With tokens asked for, ``usage`` counts toy tokens.

Fault knobs (constructor, CLI flags, and plain attributes on a running server):
``latency_ms``, ``error_rate`` (answered 429/500/503 in turn), ``drop_rate`` (connection
closed without an answer), ``malformed_rate`` (200 without ``choices``), ``length_rate``
(``finish_reason: "length"`` with a cut reply), ``weight_version`` (top-level
``metadata.weight_version``; empty string = no metadata) and ``fault_seed``.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
import sys
import threading
import time
from typing import Any

from envs.http import FaultDice, JSONHandler, QuietHTTPServer, serve_until_signal

from .envserver import add_fault_args

__all__ = ["ModelStandin", "ToyTokenizer", "context_refusal", "scripted_reply", "start_in_thread", "main"]


# ---------------------------------------------------------------------------
# The scripted policy
# ---------------------------------------------------------------------------

# The name GET /models lists: interactor's --model default, so that a run against the stand-in
# needs no --model, while one against a real server that lists other names is refused without it
# (interactor/preflight.py).
STANDIN_MODEL_NAME = "stand-in"

_RANGE_RE = re.compile(r"between\s+(-?\d+)\s+and\s+(-?\d+)", re.I)
_STATE_RE = re.compile(r"range\s*\[\s*(-?\d+)\s*,\s*(-?\d+)\s*\]", re.I)
_FEEDBACK_RE = re.compile(r"(-?\d+)\s+is\s+too\s+(low|high)", re.I)
_INT_RE = re.compile(r"-?\d+")
_EXPR_RE = re.compile(r"[-+*/×÷()\d\s.]*\d[-+*/×÷()\d\s.]*")
_QUESTION_RE = re.compile(r"what\s+is\s+([-+*/×÷xX()\d\s.]*\d[-+*/×÷xX()\d\s.]*)", re.I)


def message_text(content: Any) -> str:
    """Text of a message content: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
        return "\n".join(texts)
    return str(content)


def _guess_number(msgs: list[tuple[str, str]]) -> str | None:
    if not any(r in ("system", "user") and "guess" in t.lower() for r, t in msgs):
        return None
    orig = None
    for role, text in msgs:
        if role in ("system", "user"):
            m = _RANGE_RE.search(text)
            if m:
                orig = (int(m.group(1)), int(m.group(2)))
                break
    state = None
    for role, text in msgs:
        if role == "assistant":
            found = _STATE_RE.findall(text)
            if found:
                state = (int(found[-1][0]), int(found[-1][1]))
                break
    if orig is None and state is None:
        return None
    lo, hi = orig if orig is not None else state
    last_guess = None
    for role, text in msgs:
        if role == "assistant":
            found = _STATE_RE.findall(text)
            if found:  # the range it had before its guess: tighten, never widen
                lo, hi = max(lo, int(found[-1][0])), min(hi, int(found[-1][1]))
            ints = _INT_RE.findall(text)
            last_guess = int(ints[-1]) if ints else None
        elif role == "user":
            fb = _FEEDBACK_RE.findall(text)
            if not fb and last_guess is not None:
                low = text.lower()
                if "too low" in low or "number is higher" in low:
                    fb = [(str(last_guess), "low")]
                elif "too high" in low or "number is lower" in low:
                    fb = [(str(last_guess), "high")]
            for g, direction in fb:
                if direction.lower() == "low":
                    lo = max(lo, int(g) + 1)
                else:
                    hi = min(hi, int(g) - 1)
    if lo > hi:  # inconsistent (trimmed or odd feedback): start over
        lo, hi = orig if orig is not None else state
    guess = (lo + hi) // 2
    if any("square brackets" in t.lower() for r, t in msgs if r in ("system", "user")):
        return f"The number is in range [{lo}, {hi}]. My guess: [{guess}]"  # textarena's format
    return f"The number is in range [{lo}, {hi}]. My guess: {guess}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("unsupported expression")


def _arithmetic(msgs: list[tuple[str, str]], rng: random.Random, skill: float) -> str | None:
    user_texts = [t for r, t in msgs if r == "user"]
    if not user_texts:
        return None
    m = _QUESTION_RE.search(user_texts[-1])
    if not m:
        return None
    expr = m.group(1).replace("×", "*").replace("÷", "/").replace("x", "*").replace("X", "*")
    try:
        value = _eval(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    value = _with_skill(value, rng, skill)
    return f"Let me compute {m.group(1).strip()}. The answer is {value}"


def _with_skill(value: float, rng: random.Random, skill: float) -> float:
    """The right answer with probability ``skill``, else off by one (so group rewards vary)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if rng.random() >= skill:
        value = value + rng.choice((-1, 1))
    if isinstance(value, float):
        value = round(value, 6)
    return value


def _tagged_answer(msgs: list[tuple[str, str]], rng: random.Random, skill: float) -> str | None:
    if not any("<answer>" in t for r, t in msgs if r in ("system", "user")):
        return None
    user_texts = [t for r, t in msgs if r == "user"]
    if not user_texts:
        return None
    value = None
    for m in reversed(list(_EXPR_RE.finditer(user_texts[-1].replace("×", "*").replace("÷", "/")))):
        expr = m.group(0).strip().rstrip(".").strip()
        if not any(op in expr[1:] for op in "+-*/"):
            continue
        try:
            value = _eval(ast.parse(expr, mode="eval"))
            break
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            continue
    if value is None:
        return "I don't know. <answer>unknown</answer>"
    value = _with_skill(value, rng, skill)
    return f"Let me compute it step by step. <answer>{value}</answer>"


TOOL_NAME = "calculator"


def offers_tool(tools: Any, name: str = TOOL_NAME) -> bool:
    """Whether a request's ``tools`` offers a function tool called ``name``."""
    return isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name
        for t in tools)


def tool_reply(messages: list, tools: Any, call_id: str) -> tuple[str | None, list | None] | None:
    """The bundled tool task's answer, (content, tool_calls), or None when the request is not
    one of it (see the module docstring)."""
    if not offers_tool(tools) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") == "tool":
        result = message_text(last.get("content")).strip()
        return f"The answer is {result}. <answer>{result}</answer>", None
    if last.get("role") != "user":
        return None
    m = _QUESTION_RE.search(message_text(last.get("content")))
    if not m:
        return None
    expression = m.group(1).strip().rstrip(".")
    call = {"id": call_id, "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
    return None, [call]


def scripted_reply(messages: list[dict], rng: random.Random, skill: float = 0.7) -> str:
    """The stand-in policy: the reply text for a list of chat messages."""
    msgs = [(str(m.get("role", "")), message_text(m.get("content")))
            for m in messages if isinstance(m, dict)]
    for attempt in (lambda: _guess_number(msgs), lambda: _tagged_answer(msgs, rng, skill),
                    lambda: _arithmetic(msgs, rng, skill)):
        reply = attempt()
        if reply is not None:
            return reply
    return "I don't know"



# ---------------------------------------------------------------------------
# The toy tokenizer (token answers without a model)
# ---------------------------------------------------------------------------


class ToyTokenizer:
    """Deterministic and exact: id = byte + 3 for every UTF-8 byte, ids 0..2 special. The chat
    template appends only (``<|im_start|>role\ncontent<|im_end|>\n`` per message), so a full-history
    episode's turns extend one another token for token; trimming (``message_cut``) does not."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    END_OF_TURN = 2
    _SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIALS) + ")")

    @classmethod
    def encode(cls, text: str, parse_special: bool = True) -> list[int]:
        if not parse_special:
            return [b + 3 for b in text.encode("utf-8")]
        out: list[int] = []
        for piece in cls._SPLIT.split(text):
            if piece in cls.SPECIALS:
                out.append(cls.SPECIALS.index(piece))
            elif piece:
                out.extend(b + 3 for b in piece.encode("utf-8"))
        return out

    @classmethod
    def piece(cls, i: int) -> bytes:
        return cls.SPECIALS[i].encode() if i < 3 else bytes([i - 3])

    @classmethod
    def decode(cls, ids: list[int]) -> str:
        return b"".join(cls.piece(i) for i in ids).decode("utf-8", "replace")

    @staticmethod
    def render(messages: list, add_generation_prompt: bool = True) -> str:
        out = "".join(f"<|im_start|>{m.get('role', '')}\n{message_text(m.get('content'))}<|im_end|>\n"
                      for m in messages if isinstance(m, dict))
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    @staticmethod
    def logprob(token: int, position: int) -> float:
        """A made-up, reproducible logprob in (-2, 0]."""
        return -(((token * 2654435761) ^ (position * 40503)) % 1000) / 500.0


TOKEN_STYLES = ("vllm", "llama.cpp", "openai", "sglang")
TOKEN_FAULTS = ("", "ids_not_text", "length", "non_integer", "nan", "positive", "below_float32")

# ---------------------------------------------------------------------------
# Context overflow, in real servers' words
# ---------------------------------------------------------------------------

OVERFLOW_STYLES = ("vllm", "sglang", "llama.cpp", "openai")


def context_refusal(style: str, context: int, prompt: int, max_tokens: int) -> dict | None:
    """The 400 body a real server of ``style`` answers when ``prompt`` tokens plus ``max_tokens``
    do not fit a context of ``context`` tokens, or None when they fit. llama.cpp checks the
    prompt alone (it stops the answer at the context's end instead)."""
    total = prompt + max_tokens
    if style == "llama.cpp":
        if prompt < context:
            return None
        return {"error": {"code": 400, "message": f"request ({prompt} tokens) exceeds the available context size "
                                                  f"({context} tokens), try increasing it",
                          "type": "exceed_context_size_error", "n_prompt_tokens": prompt, "n_ctx": context}}
    if total <= context and prompt < context:
        return None
    if style == "sglang":
        message = (f"The input ({prompt} tokens) is longer than the model's context length ({context} tokens)."
                   if prompt >= context else
                   f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                   f"requested a total of {total} tokens: {prompt} tokens from the input messages and {max_tokens} "
                   "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                   "completion to fit within the limit.")
        return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    if style == "openai":
        return {"error": {"message": f"This model's maximum context length is {context} tokens. However, your "
                                     f"messages resulted in {prompt} tokens. Please reduce the length of the messages.",
                          "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    return {"object": "error", "message": f"This model's maximum context length is {context} tokens. However, you "
            f"requested {total} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the "
            "length of the messages or completion.", "type": "BadRequestError", "param": None, "code": 400}


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class ModelStandin(QuietHTTPServer):
    """The stand-in chat-completions server.  Knobs are plain attributes."""

    ERROR_STATUSES = (429, 500, 503)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, latency_ms: float = 0.0,
                 error_rate: float = 0.0, length_rate: float = 0.0, weight_version: str = "v1",
                 drop_rate: float = 0.0, malformed_rate: float = 0.0, skill: float = 0.7,
                 model_name: str = STANDIN_MODEL_NAME, fault_seed: int | None = 0,
                 context_tokens: int = 0, overflow_style: str = "vllm", tokens_style: str = "vllm",
                 skill_per_version: float = 0.0, verbose: bool = False):
        super().__init__((host, port), _ModelHandler, verbose=verbose)
        self.latency_ms = latency_ms
        self.error_rate = error_rate
        self.length_rate = length_rate
        self.weight_version = weight_version
        self.drop_rate = drop_rate
        self.malformed_rate = malformed_rate
        self.skill = skill
        self.base_skill = skill
        self.skill_per_version = skill_per_version
        self.model_name = model_name
        self.fault_seed = fault_seed
        self.dice = FaultDice(fault_seed)
        self.lock = threading.Lock()
        self.counter = 0
        self.error_turn = 0
        self.requests = 0
        self.by_status: dict[str, int] = {}
        self.by_session: dict[str, int] = {}
        self.by_finish_reason: dict[str, int] = {}
        self.faults = {"error": 0, "drop": 0, "malformed": 0, "length": 0}
        self.auth_headers_seen = 0
        # True: answer every request, /models included, 503 (a server that is up but not
        # serving: loading weights, draining). Not a fault die: a switch tests flip.
        self.unavailable = False
        # hold(): chat requests wait (counted in ``held``) until release(): a model stalled for as
        # long as a test needs, e.g. to kill a worker while every episode is inside a model call
        self._hold = threading.Condition()
        self._holding = False
        self.held = 0
        self.sessionless = 0
        self.request_params: dict[str, list[str]] = {}
        self.replies: dict[str, str] = {}
        if overflow_style not in OVERFLOW_STYLES:
            raise ValueError(f"overflow_style must be one of {sorted(OVERFLOW_STYLES)}, not {overflow_style!r}")
        self.context_tokens = context_tokens
        self.overflow_style = overflow_style
        self.context_overflows = 0
        if tokens_style not in TOKEN_STYLES:
            raise ValueError(f"tokens_style must be one of {sorted(TOKEN_STYLES)}, not {tokens_style!r}")
        self.tokens_style = tokens_style
        self.token_fault = ""  # one of TOKEN_FAULTS: spoil every token answer that way
        self.token_answers = 0

    def stats(self) -> dict:
        with self.lock:
            return {
                "requests": self.requests,
                "by_status": dict(self.by_status),
                "by_session": dict(self.by_session),
                "sessionless": self.sessionless,
                "by_finish_reason": dict(self.by_finish_reason),
                "faults": dict(self.faults),
                "auth_headers_seen": self.auth_headers_seen,
                "request_params": {k: list(v) for k, v in self.request_params.items()},
                "context_overflows": self.context_overflows,
                "token_answers": self.token_answers,
                "skill": self.skill,
                "weight_version": self.weight_version,
            }

    def hold(self) -> None:
        """Chat requests from now on wait (counted in ``held``) until :meth:`release`."""
        with self._hold:
            self._holding = True

    def release(self) -> None:
        with self._hold:
            self._holding = False
            self._hold.notify_all()

    def wait_while_held(self) -> None:
        with self._hold:
            if not self._holding:
                return
            self.held += 1
            while self._holding:
                self._hold.wait()
            self.held -= 1

    def load_weights(self, version: int) -> dict:
        """``POST /weights``: what a trainer's weight sync does to a real server, in miniature."""
        with self.lock:
            self.weight_version = f"v{version}"
            if self.skill_per_version:
                self.skill = min(0.99, self.base_skill + version * self.skill_per_version)
            return {"weight_version": self.weight_version, "skill": self.skill}


class _ModelHandler(JSONHandler):
    server: ModelStandin
    server_version = "interactor-model-standin/0.1"

    def answer(self, status: int, obj: Any) -> None:
        with self.server.lock:
            key = str(status)
            self.server.by_status[key] = self.server.by_status.get(key, 0) + 1
        self.send_json(status, obj)

    def error(self, status: int, message: str, etype: str) -> None:
        self.answer(status, {"error": {"message": message, "type": etype, "code": status}})

    def dispatch(self, method: str) -> None:
        srv = self.server
        body = self.read_body() if method in ("POST", "PUT", "PATCH", "DELETE") else b""
        parts = self.split_path()
        if method == "GET" and parts == ["stats"]:
            return self.send_json(200, srv.stats())
        if srv.unavailable:
            return self.error(503, "the server is not serving now (unavailable)", "service_unavailable")
        if method == "GET" and parts in (["v1", "models"], ["models"]):
            return self.send_json(200, {"object": "list", "data": [
                {"id": srv.model_name, "object": "model", "created": 0,
                 "owned_by": "interactor-standin"}]})
        if method == "POST" and parts == ["weights"]:
            try:
                version = json.loads(body or b"{}").get("version")
            except (ValueError, AttributeError):
                version = None
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                return self.error(400, "body must be {\"version\": an integer >= 0}", "invalid_request_error")
            return self.send_json(200, srv.load_weights(version))
        if method == "POST" and parts and parts[-1] in ("tokenize", "detokenize", "apply-template"):
            return self.llama_route(parts[-1], body)
        if len(parts) >= 2 and parts[-2:] == ["chat", "completions"]:
            if method != "POST":
                return self.send_json(405, {"error": {"message": "use POST",
                                                      "type": "invalid_request_error"}})
            prefix = parts[:-2]
            session = prefix[-1] if prefix and prefix[-1] != "v1" else None
            return self.chat(session, body)
        return self.send_json(404, {"error": {"message": f"no route for {method} {self.path}",
                                              "type": "invalid_request_error"}})

    def chat(self, session: str | None, body: bytes) -> None:
        srv = self.server
        with srv.lock:
            srv.requests += 1
            srv.counter += 1
            counter = srv.counter
            if session is None:
                srv.sessionless += 1
            else:
                srv.by_session[session] = srv.by_session.get(session, 0) + 1
            if self.headers.get("Authorization") is not None:
                srv.auth_headers_seen += 1
        if srv.latency_ms:
            time.sleep(srv.latency_ms / 1000.0)
        srv.wait_while_held()

        fault = srv.dice.roll(("drop", srv.drop_rate), ("error", srv.error_rate),
                              ("malformed", srv.malformed_rate), ("length", srv.length_rate))
        if fault in ("drop", "error", "malformed"):
            with srv.lock:
                srv.faults[fault] += 1
                turn = srv.error_turn
                if fault == "error":
                    srv.error_turn += 1
            if fault == "drop":
                with srv.lock:
                    srv.by_status["dropped"] = srv.by_status.get("dropped", 0) + 1
                return self.drop()
            if fault == "error":
                status = srv.ERROR_STATUSES[turn % len(srv.ERROR_STATUSES)]
                return self.error(status, f"injected fault {status} (stand-in)",
                                  "rate_limit_error" if status == 429 else "server_error")
            return self.answer(200, {"id": f"chatcmpl-standin-{counter}",
                                     "object": "chat.completion", "oops": "no choices here"})

        try:
            req = json.loads(body) if body.strip() else None
        except ValueError:
            req = None
        if not isinstance(req, dict):
            return self.error(400, "request body must be a JSON object", "invalid_request_error")
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return self.error(400, "'messages' must be a non-empty list", "invalid_request_error")
        if req.get("stream"):
            return self.error(400, "the stand-in does not stream", "invalid_request_error")
        temperature = req.get("temperature")
        model = req.get("model") or srv.model_name
        with srv.lock:
            for key, value in req.items():
                if key in ("model", "messages", "temperature"):
                    continue
                seen = srv.request_params.setdefault(key, [])
                text = json.dumps(value, sort_keys=True)
                if text not in seen and len(seen) < 5:
                    seen.append(text)

        texts = [message_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        prompt_tokens = sum(len(t.split()) for t in texts)
        if srv.context_tokens > 0:
            max_tokens = req.get("max_tokens")
            max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
            refusal = context_refusal(srv.overflow_style, srv.context_tokens, prompt_tokens, max_tokens)
            if refusal is not None:
                with srv.lock:
                    srv.context_overflows += 1
                return self.answer(400, refusal)
        rng = random.Random(f"{srv.fault_seed}|{temperature}|{counter}|" + "\x1e".join(texts))
        content = scripted_reply(messages, rng, srv.skill)
        last_user = next((t for m, t in zip(reversed(messages), reversed(texts))
                          if isinstance(m, dict) and m.get("role") == "user"), "")
        for text, reply in list(srv.replies.items()):
            if text in last_user:
                content = reply
                break
        finish_reason = "stop"
        tool_calls = None
        with_tool = tool_reply(messages, req.get("tools"), f"call_standin_{counter}")
        if with_tool is not None:
            content, tool_calls = with_tool
            finish_reason = "tool_calls" if tool_calls else "stop"
        if fault == "length" and content is not None:
            finish_reason = "length"
            content = content[: max(1, len(content) // 2)]
        with srv.lock:
            if fault == "length":
                srv.faults["length"] += 1
            srv.by_finish_reason[finish_reason] = srv.by_finish_reason.get(finish_reason, 0) + 1

        completion_tokens = len((content or json.dumps(tool_calls)).split())
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        out: dict[str, Any] = {
            "id": f"chatcmpl-standin-{counter}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0,
                         "message": message,
                         "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        if srv.weight_version:
            out["metadata"] = {"weight_version": str(srv.weight_version)}
        if req.get("logprobs") or req.get("return_token_ids"):
            self.add_tokens(req, messages, content if content is not None else json.dumps(tool_calls),
                            finish_reason, out)
        self.answer(200, out)

    def add_tokens(self, req: dict, messages: list, content: str, finish_reason: str, out: dict) -> None:
        """What a real server adds when asked for tokens, in ``tokens_style``'s shape."""
        srv = self.server
        tk = ToyTokenizer
        prompt_ids = tk.encode(tk.render(messages))
        # the end-of-turn token is sampled too, unless the answer was cut off
        ids = tk.encode(content, parse_special=False) + ([tk.END_OF_TURN] if finish_reason == "stop" else [])
        entries = [{"token": tk.piece(i).decode("utf-8", "replace"), "logprob": tk.logprob(i, n),
                    "bytes": list(tk.piece(i)), "top_logprobs": []} for n, i in enumerate(ids)]
        style = srv.tokens_style
        if style == "llama.cpp":
            for e, i in zip(entries, ids):
                e["id"] = i
            if entries and ids[-1] == tk.END_OF_TURN:  # llama-server does not list the end-of-generation token
                entries.pop()
        fault = srv.token_fault
        with srv.lock:
            srv.token_answers += 1
        if fault == "ids_not_text" and ids:
            ids[0] = ids[0] + 1 if ids[0] + 1 >= 3 else 3
            if style == "llama.cpp":
                entries[0]["id"] = ids[0]
            entries[0]["bytes"] = list(tk.piece(ids[0]))
            entries[0]["token"] = tk.piece(ids[0]).decode("utf-8", "replace")
        elif fault == "length":
            ids = ids + [tk.END_OF_TURN]
        elif fault == "non_integer" and ids:
            ids[0] = str(ids[0])  # type: ignore[call-overload]
            if style == "llama.cpp":
                entries[0]["id"] = ids[0]
        elif fault == "nan" and entries:
            entries[0]["logprob"] = float("nan")  # json.dumps writes the bare word NaN, as a C++ server might
        elif fault == "positive" and entries:
            entries[0]["logprob"] = 0.5
        elif fault == "below_float32" and entries:
            entries[0]["logprob"] = -1e39
        choice = out["choices"][0]
        if req.get("logprobs"):
            choice["logprobs"] = {"content": entries}
        if req.get("return_token_ids") and style == "vllm":
            out["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = ids
        # a real server counts its own tokens
        out["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                        "total_tokens": len(prompt_ids) + len(ids)}

    def llama_route(self, route: str, body: bytes) -> None:
        """llama-server's /tokenize, /detokenize and /apply-template, over the toy tokenizer."""
        try:
            req = json.loads(body) if body.strip() else {}
        except ValueError:
            req = None
        if not isinstance(req, dict):
            return self.error(400, "request body must be a JSON object", "invalid_request_error")
        tk = ToyTokenizer
        if route == "apply-template":
            messages = req.get("messages")
            if not isinstance(messages, list):
                return self.error(400, "'messages' must be a list", "invalid_request_error")
            return self.answer(200, {"prompt": tk.render(messages)})
        if route == "tokenize":
            content = req.get("content")
            if not isinstance(content, str):
                return self.error(400, "'content' must be a string", "invalid_request_error")
            return self.answer(200, {"tokens": tk.encode(content, parse_special=bool(req.get("parse_special")))})
        tokens = req.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 259 for t in tokens):
            return self.error(400, "'tokens' must be a list of token ids", "invalid_request_error")
        return self.answer(200, {"content": tk.decode(tokens)})


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def start_in_thread(host: str = "127.0.0.1", port: int = 0,
                    **knobs: Any) -> tuple[ModelStandin, str]:
    """Start a :class:`ModelStandin` in a daemon thread; stop it with ``server.shutdown()``.

    The returned base URL is the server root; the OpenAI base URL is ``base_url + "/v1"``.
    """
    return ModelStandin(host, port, **knobs).serve_in_thread("model-standin")


def build_parser(prog: str = "python -m examples.model_standin") -> argparse.ArgumentParser:
    """The stand-in's flags; ``prog``: the command that runs it (``interactor serve-model``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Stand-in OpenAI-compatible chat-completions server (scripted policy; "
                    "use vLLM/SGLang/a hosted API for real runs).")
    add_fault_args(parser)
    parser.add_argument("--length-rate", type=float, default=0.0,
                        help='fraction answered with finish_reason "length" (default: 0)')
    parser.add_argument("--malformed-rate", type=float, default=0.0,
                        help='fraction answered 200 without "choices" (default: 0)')
    parser.add_argument("--weight-version", default="v1",
                        help="metadata.weight_version to report; empty = no metadata (default: %(default)s)")
    parser.add_argument("--skill", type=float, default=0.7,
                        help="probability of a correct arithmetic answer (default: %(default)s)")
    parser.add_argument("--skill-per-version", type=float, default=0.0,
                        help="POST /weights {version: N} raises skill by N times this, the online-RL demo "
                             "(default: 0)")
    parser.add_argument("--model-name", default=STANDIN_MODEL_NAME,
                        help="the model GET /models lists (any name is answered; default: %(default)s)")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="context window in words (prompt + max_tokens); longer requests are answered 400 "
                             "as a real server does (default: 0, no limit)")
    parser.add_argument("--overflow-style", choices=OVERFLOW_STYLES, default="vllm",
                        help="whose wording the context-overflow 400 uses (default: %(default)s)")
    parser.add_argument("--tokens-style", choices=TOKEN_STYLES, default="vllm",
                        help="whose shape token answers take, ids and logprobs when a request asks "
                             "(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m examples.model_standin") -> int:
    args = build_parser(prog).parse_args(argv)
    server = ModelStandin(args.host, args.port, latency_ms=args.latency_ms,
                          error_rate=args.error_rate, length_rate=args.length_rate,
                          weight_version=args.weight_version, drop_rate=args.drop_rate,
                          malformed_rate=args.malformed_rate, skill=args.skill,
                          model_name=args.model_name, fault_seed=args.fault_seed,
                          context_tokens=args.context_tokens, overflow_style=args.overflow_style,
                          tokens_style=args.tokens_style, skill_per_version=args.skill_per_version,
                          verbose=args.verbose)
    return serve_until_signal(server)


if __name__ == "__main__":
    sys.exit(main())
