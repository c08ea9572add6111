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

The scripted policy: examples/standin_policy.py.

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

Tokens (docs/protocol.md#token-options): examples/standin_tokens.py (a toy tokenizer, one id per
UTF-8 byte) lets the stand-in answer as the real servers do when asked.

Fault knobs (constructor, CLI flags, and plain attributes on a running server):
``latency_ms``, ``error_rate`` (answered 429/500/503 in turn), ``drop_rate`` (connection
closed without an answer), ``malformed_rate`` (200 without ``choices``), ``length_rate``
(``finish_reason: "length"`` with a cut reply), ``weight_version`` (top-level
``metadata.weight_version``; empty string = no metadata) and ``fault_seed``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

from envs.http import FaultDice, JSONHandler, QuietHTTPServer, serve_until_signal

from .envserver import add_fault_args
from .standin_policy import STANDIN_MODEL_NAME, message_text, scripted_reply, tool_reply
from .standin_tokens import OVERFLOW_STYLES, TOKEN_STYLES, ToyTokenizer, context_refusal

__all__ = ["ModelStandin", "build_parser", "main", "start_in_thread"]


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
            return self.injected_fault(fault, counter)

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

    def injected_fault(self, fault: str, counter: int) -> None:
        """A request the fault knobs spoil: the connection dropped, an error status (429, 500
        and 503 in turn), or a 200 without ``choices``."""
        srv = self.server
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
