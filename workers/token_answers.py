"""Asking the model server for what it sampled, and reading its answer (docs/protocol.md#token-options).

:data:`TOKEN_ANSWERS` says, server by server, which request fields ask for token ids and
logprobs and where the answer puts them, like :data:`workers.modelclient.CONTEXT_OVERFLOW_SIGNS`
for context overflows. :func:`read_tokens` reads one chat-completion answer into a
:class:`TokenAnswer`; :func:`check` validates it against the answer text;
:func:`step_token_fields` is the step loop's bookkeeping of one (the record's token fields, the
job's warnings, the ids the next turn's prompt must extend). Nothing here raises
for a bad token answer: the step keeps its text and its tokens are marked invalid with the
reason (broker/tokens.py TOKEN_ERRORS), and the episode goes on.

llama.cpp's chat answer has no prompt ids: the model client asks the same server for them
(``/apply-template`` then ``/tokenize``, the server's own template and tokenizer, the very
steps its chat route takes) and checks their count against the answer's ``usage.prompt_tokens``.
That is the server tokenizing its own rendering of the prompt, not us re-tokenizing text.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from broker.tokens import (
    MIN_LOGPROB,
    SERVER_LLAMA_CPP,
    SERVER_OPENAI,
    SERVER_SGLANG,
    SERVER_VLLM,
    TOK_BAD_LOGPROB,
    TOK_IDS_NOT_TEXT,
    TOK_LENGTH_MISMATCH,
    TOK_NOT_INTEGER,
    TOK_PROMPT_IDS,
    TOKENS_AUTO,
    TOKENS_INVALID,
    TOKENS_MISSING,
    TOKENS_NO_IDS,
    TOKENS_OK,
    first_difference,
    pack_ids,
    pack_logprobs,
    valid_id,
    valid_logprob,
)

log = logging.getLogger("interactor.tokens")


@dataclass(frozen=True)
class TokenWay:
    """One server's way: the request fields that ask, and where the answer puts things.

    ``prompt_ids`` / ``completion_ids``: "answer.prompt_token_ids" (top level of the answer),
    "choice.token_ids" (``choices[0]``), "logprobs.id" (each ``choices[0].logprobs.content[i]``),
    "tokenize" (asked of the server's ``/apply-template`` + ``/tokenize``), or "" (not given).
    Logprobs and token strings always come from ``choices[0].logprobs.content[i]`` (``logprob``,
    ``token``, ``bytes``): the OpenAI shape every one of them answers in.
    """

    server: str
    request: dict
    prompt_ids: str
    completion_ids: str


# How each server answers. The shapes quoted are recorded answers (tests/test_tokens.py replays them).
TOKEN_ANSWERS: tuple[TokenWay, ...] = (
    # vLLM >= 0.10.2: {"logprobs": true, "return_token_ids": true} ->
    # {"prompt_token_ids": [151644, 872, ...], "choices": [{"message": {...}, "token_ids": [9707, 0, 151645],
    #  "logprobs": {"content": [{"token": "Hello", "logprob": -0.01, "bytes": [72, ...], "top_logprobs": []}, ...]}}]}
    # (token_ids end with the EOS / end-of-turn token when the answer stopped on it.)
    TokenWay(SERVER_VLLM, {"logprobs": True, "top_logprobs": 1, "return_token_ids": True},
             "answer.prompt_token_ids", "choice.token_ids"),
    # SGLang: the OpenAI logprobs shape; its chat route gives ids only where it is built or
    # patched to (the same prompt_token_ids / token_ids fields as vLLM, read when present).
    # Without them: logprobs and token strings only, ids unavailable (a warning once per job).
    TokenWay(SERVER_SGLANG, {"logprobs": True, "top_logprobs": 1, "return_token_ids": True},
             "answer.prompt_token_ids", "choice.token_ids"),
    # llama.cpp llama-server: {"logprobs": true, "top_logprobs": 1} (n_probs must be > 0 for it
    # to compute probabilities at all) -> choices[0].logprobs.content[i] =
    # {"id": 28120, "token": "Hello", "bytes": [72, ...], "logprob": -0.35, "top_logprobs": [...]};
    # prompt ids from POST /apply-template {"messages"} -> {"prompt"}, then POST /tokenize
    # {"content", "add_special": true, "parse_special": true} -> {"tokens": [...]}.
    TokenWay(SERVER_LLAMA_CPP, {"logprobs": True, "top_logprobs": 1}, "tokenize", "logprobs.id"),
    # OpenAI: {"logprobs": true} -> content[i] = {"token", "logprob", "bytes", "top_logprobs"};
    # no ids anywhere (and unknown request fields are refused, so none are sent).
    TokenWay(SERVER_OPENAI, {"logprobs": True}, "", ""),
)
WAYS = {w.server: w for w in TOKEN_ANSWERS}
# "auto": fields vLLM, SGLang and llama.cpp all accept (each ignores what it does not know);
# the server is then told from the answer's shape. OpenAI refuses return_token_ids: name it.
AUTO_REQUEST = {"logprobs": True, "top_logprobs": 1, "return_token_ids": True}


def request_fields(mode: str) -> dict:
    """The body fields to add to a chat request for the job's ``tokens`` mode."""
    if not mode:
        return {}
    if mode == TOKENS_AUTO:
        return dict(AUTO_REQUEST)
    return dict(WAYS[mode].request)


# Text a tokenizer's end-of-turn or EOS token may decode to: the answer's content never holds
# it, the completion ids (vLLM) do, so a token text ending in one still matches the content.
_SPECIAL_TAIL = re.compile(r"(<\|[^|<>]{1,40}\|>|</s>|<eos>|<end_of_turn>|\[/INST\])+\s*$")


@dataclass
class TokenAnswer:
    """One step's tokens as read from the answer (lists; packed by :meth:`record_fields`)."""

    source: str = ""
    status: str = ""
    error: str = ""
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None
    needs_prompt_tokenize: bool = False  # llama.cpp: the client asks /apply-template + /tokenize
    warnings: list[str] = field(default_factory=list)

    def invalid(self, code: str, detail: str) -> "TokenAnswer":
        if self.status != TOKENS_INVALID:  # the first fault is the reason
            self.status, self.error = TOKENS_INVALID, f"{code}: {detail}"
        return self

    def record_fields(self) -> dict:
        """The StepRecord token fields (broker/records.py v3). Invalid or missing steps keep no
        ids: a trainer must never pick up numbers that failed a check."""
        out = {"token_source": self.source, "token_status": self.status, "token_error": self.error}
        if self.status == TOKENS_OK:
            out.update(prompt_ids=pack_ids(self.prompt_ids or []), completion_ids=pack_ids(self.completion_ids or []),
                       completion_logprobs=pack_logprobs(self.logprobs or []))
            # the sampled tokens' strings, for people reading them (the results browser); only
            # when there is one per id (llama.cpp leaves the end-of-generation token unlisted)
            if self.token_texts is not None and len(self.token_texts) == len(self.completion_ids or []):
                out["completion_token_texts"] = self.token_texts
        elif self.status == TOKENS_NO_IDS:
            out.update(completion_logprobs=pack_logprobs(self.logprobs or []), completion_token_texts=self.token_texts)
        return out


def _content_entries(choice: dict) -> list | None:
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        content = lp.get("content")
        if isinstance(content, list):
            return content
    return None


def _ints(value: Any, what: str, ans: TokenAnswer) -> list[int] | None:
    if not isinstance(value, list):
        ans.invalid(TOK_NOT_INTEGER, f"{what} is a {type(value).__name__}, not a list")
        return None
    for i, v in enumerate(value):
        if not valid_id(v):
            ans.invalid(TOK_NOT_INTEGER, f"{what}[{i}] = {v!r:.40} is not a token id")
            return None
    return value


def read_tokens(mode: str, obj: dict, content: str | None) -> TokenAnswer:
    """The tokens of one chat-completion answer ``obj`` (already checked to have choices[0]
    with a message) for the job's ``tokens`` mode, checked against the answer text ``content``
    (None: not checked against it, see below)."""
    choice = obj["choices"][0]
    entries = _content_entries(choice)
    if mode == TOKENS_AUTO:
        if "prompt_token_ids" in obj or "token_ids" in choice:
            way = WAYS[SERVER_VLLM]
        elif entries and isinstance(entries[0], dict) and "id" in entries[0]:
            way = WAYS[SERVER_LLAMA_CPP]
        else:
            way = WAYS[SERVER_OPENAI]
    else:
        way = WAYS[mode]
    ans = TokenAnswer(source=way.server)

    # logprobs and token strings: the OpenAI shape, which every server answers in
    if entries is None:
        if way.completion_ids != "choice.token_ids" or "token_ids" not in choice:
            ans.status, ans.error = TOKENS_MISSING, "the answer has no choices[0].logprobs.content"
            return ans
        entries = []
    logprobs: list[float] = []
    texts: list[str] = []
    raw = bytearray()
    have_bytes = True
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            return ans.invalid(TOK_LENGTH_MISMATCH, f"logprobs.content[{i}] is not an object")
        lp = e.get("logprob")
        if not valid_logprob(lp):
            return ans.invalid(TOK_BAD_LOGPROB, f"logprobs.content[{i}].logprob = {lp!r:.40} is not a number in "
                                                f"[{MIN_LOGPROB:.4g}, 0] (what float32 stores)")
        logprobs.append(float(lp))
        tok = e.get("token")
        texts.append(tok if isinstance(tok, str) else "")
        b = e.get("bytes")
        if isinstance(b, list) and all(isinstance(x, int) and 0 <= x < 256 for x in b):
            raw.extend(b)
        else:
            have_bytes = False
    ans.logprobs, ans.token_texts = logprobs, texts

    # completion ids
    ids = None
    if way.completion_ids == "choice.token_ids" and "token_ids" in choice:
        ids = _ints(choice.get("token_ids"), "choices[0].token_ids", ans)
        if ids is None:
            return ans
        if entries and len(ids) != len(entries):
            return ans.invalid(TOK_LENGTH_MISMATCH, f"{len(ids)} token ids but {len(entries)} logprobs")
        if not entries and ids:
            ans.status, ans.error = TOKENS_MISSING, "token ids without logprobs (was logprobs refused?)"
            return ans
    elif way.completion_ids == "logprobs.id":
        got = [e.get("id") for e in entries]
        ids = _ints(got, "logprobs.content[].id", ans)
        if ids is None:
            return ans
    ans.completion_ids = ids

    # the tokens must spell the answer text
    joined = bytes(raw).decode("utf-8", "replace") if have_bytes and entries else "".join(texts)
    # None: an answer with tool calls, whose sampled text (the call in the model's own markup) the
    # server parsed out of the content: the tokens cannot spell it, and are not compared with it
    if entries and content is not None and not _spells(joined, content):
        return ans.invalid(TOK_IDS_NOT_TEXT, f"the tokens spell {joined[:60]!r}, the answer is {content[:60]!r}")

    # prompt ids
    if way.prompt_ids == "answer.prompt_token_ids" and "prompt_token_ids" in obj:
        pids = _ints(obj.get("prompt_token_ids"), "prompt_token_ids", ans)
        if pids is None:
            return ans
        usage = obj.get("usage")
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n != len(pids):
            return ans.invalid(TOK_PROMPT_IDS, f"{len(pids)} prompt ids but usage.prompt_tokens = {n}")
        ans.prompt_ids = pids
    elif way.prompt_ids == "tokenize":
        ans.needs_prompt_tokenize = True

    if ids is None:
        ans.status = TOKENS_NO_IDS
        ans.warnings.append(f"the model server ({way.server} answer shape) gives logprobs but no token ids; "
                            "storing logprobs and token strings, ids marked unavailable")
    elif ans.prompt_ids is None and not ans.needs_prompt_tokenize:
        ans.invalid(TOK_PROMPT_IDS, "the answer has completion ids but no prompt_token_ids")
    else:
        ans.status = TOKENS_OK
    return ans


def _spells(joined: str, content: str) -> bool:
    if joined == content:
        return True
    if joined.startswith(content) and _SPECIAL_TAIL.fullmatch(joined[len(content):].lstrip() or "<||>"):
        return True
    # servers strip the answer's surrounding whitespace (a leading space token, a trailing newline)
    stripped = _SPECIAL_TAIL.sub("", joined).strip()
    return stripped == content.strip()


def set_prompt_ids(ans: TokenAnswer, ids: Any, usage_prompt_tokens: int | None) -> None:
    """llama.cpp: the ids ``/tokenize`` gave for the server's rendering of the prompt, checked
    against the count the chat answer reported."""
    pids = _ints(ids, "/tokenize tokens", ans)
    if pids is None:
        return
    if usage_prompt_tokens is not None and usage_prompt_tokens != len(pids):
        ans.invalid(TOK_PROMPT_IDS, f"/tokenize gave {len(pids)} ids, the answer's usage.prompt_tokens = "
                                    f"{usage_prompt_tokens}")
        return
    ans.prompt_ids = pids


# Warnings a job should see once, not once a step (per worker process: each logs it once).
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(job_id: str, text: str, key: str = "") -> bool:
    """Log ``text`` unless this job already logged it (or another text of the same ``key``)."""
    with _warned_lock:
        key = (job_id, key or text)
        if key in _warned:
            return False
        if len(_warned) > 10_000:  # a long-lived worker: forget old jobs rather than grow
            _warned.clear()
        _warned.add(key)
    log.warning("job %s: %s", job_id, text)
    return True


def step_token_fields(job_id: str, episode_id: str, step_id: int, tok: TokenAnswer | None,
                      prev_tokens: list[int] | None) -> tuple[dict, list[int] | None]:
    """One step's token bookkeeping: its StepRecord token fields (none when the job asked for
    no tokens) and the ids the next turn's prompt must start with (``prev_tokens``: this turn's
    prompt + completion ids, an append-only template; where the next prompt does not start with
    them, its step records ``token_drift``, docs/protocol.md). The answer's warnings are logged
    once per job."""
    if tok is None:
        return {}, prev_tokens
    fields = tok.record_fields()
    for text in tok.warnings:
        warn_once(job_id, text)
    if tok.status in (TOKENS_INVALID, TOKENS_MISSING):
        # once per job and reason; each step's own reason is stored with it
        code = tok.error.split(":", 1)[0]
        warn_once(job_id, f"token answers {tok.status} ({code}), e.g. episode {episode_id} "
                          f"step {step_id}: {tok.error}; the steps keep their text",
                  key=f"{tok.status}:{code}")
    if tok.status != TOKENS_OK:
        return fields, None  # nothing to compare the next turn with
    if prev_tokens is not None:
        fields["token_drift"] = first_difference(prev_tokens, tok.prompt_ids)
    return fields, list(tok.prompt_ids) + list(tok.completion_ids)
