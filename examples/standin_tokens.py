"""The model stand-in's token answers (examples/model_standin.py), without a model.

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
"""

from __future__ import annotations

import re

from .standin_policy import message_text

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
