"""Token-exact trajectories (docs/protocol.md#token-options): the names and the compact
encoding every role shares, defined once.

A step asked for tokens (the job's ``tokens`` setting) carries, in its :class:`StepRecord`
(broker/records.py, version 3), the prompt's token ids, the completion's token ids and each
sampled token's logprob. They travel and are stored *packed*, not as JSON numbers:

* ids: little-endian int32, 4 bytes a token (every tokenizer in use has < 2**31 ids);
* logprobs: little-endian float32, 4 bytes a token (a float32 logprob is exact to ~1e-7
  relative, far below sampling noise; float64 would double the bytes for nothing).

msgpack carries them as ``bin`` and the database stores the same bytes (BLOB / BYTEA): the
worker packs once and nothing in between decodes them.
"""

from __future__ import annotations

import struct
from array import array
from typing import Sequence

# The job's ``tokens`` setting: which server's way of answering to ask for. "" = off;
# "auto" = ask in the way vLLM, SGLang and llama.cpp all accept and tell the server from the
# answer (workers/token_answers.py TOKEN_SERVERS); the others force one row of that table.
TOKENS_OFF = ""
TOKENS_AUTO = "auto"
SERVER_VLLM = "vllm"
SERVER_SGLANG = "sglang"
SERVER_LLAMA_CPP = "llama.cpp"
SERVER_OPENAI = "openai"
TOKEN_SERVERS = (SERVER_VLLM, SERVER_SGLANG, SERVER_LLAMA_CPP, SERVER_OPENAI)
TOKEN_MODES = (TOKENS_OFF, TOKENS_AUTO) + TOKEN_SERVERS

# StepRecord.token_status: what the step's token fields hold.
TOKENS_OK = "ok"  # prompt ids, completion ids and logprobs, checked
TOKENS_NO_IDS = "no_ids"  # the server gave logprobs and token strings but no ids (OpenAI-style)
TOKENS_INVALID = "invalid"  # the server's answer failed a check (token_error says which); text kept
TOKENS_MISSING = "missing"  # asked, but the answer carried nothing usable (no logprobs at all)
TOKEN_STATUSES = (TOKENS_OK, TOKENS_NO_IDS, TOKENS_INVALID, TOKENS_MISSING)

# token_error reason codes (a code, then ": " and the detail).
TOK_IDS_NOT_TEXT = "ids_not_text"  # the completion ids do not spell the answer text
TOK_LENGTH_MISMATCH = "length_mismatch"  # ids, logprobs and token strings of different lengths
TOK_NOT_INTEGER = "not_integer"  # an id that is not an int in [0, MAX_ID]
TOK_BAD_LOGPROB = "bad_logprob"  # a logprob that is not a number in [MIN_LOGPROB, 0]
TOK_PROMPT_IDS = "prompt_ids"  # the prompt's ids could not be had or disagree with the usage count
TOKEN_ERRORS = (TOK_IDS_NOT_TEXT, TOK_LENGTH_MISMATCH, TOK_NOT_INTEGER, TOK_BAD_LOGPROB, TOK_PROMPT_IDS)

ID_BYTES = 4
LOGPROB_BYTES = 4
# What the packing can hold, which is what the checks accept (valid_id, valid_logprob): a value
# past these would pass a check and then fail the step when packed. Ids are signed int32 (no
# id is negative); a logprob below -float32's largest finite value overflows float32.
MAX_ID = 2**31 - 1
MIN_LOGPROB = -struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]  # -3.4028234663852886e+38


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the caller has checked the range)."""
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_ids(data: bytes | memoryview | None) -> list[int] | None:
    if data is None:
        return None
    data = bytes(data)
    return list(struct.unpack(f"<{len(data) // ID_BYTES}i", data))


def pack_logprobs(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack_logprobs(data: bytes | memoryview | None) -> list[float] | None:
    if data is None:
        return None
    data = bytes(data)
    return list(struct.unpack(f"<{len(data) // LOGPROB_BYTES}f", data))


def valid_id(v: object) -> bool:
    """An id :func:`pack_ids` stores: an int (not a bool) in [0, MAX_ID]."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ID


def valid_logprob(v: object) -> bool:
    """A logprob :func:`pack_logprobs` stores: a number (not a bool) in [MIN_LOGPROB, 0]. NaN
    and infinities fail the comparison; so does an int of any size (compared exactly, never
    converted to float, which would overflow)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_LOGPROB <= v <= 0.0


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """The first position where ``actual`` does not start with ``expected`` (None: it does).
    A shorter ``actual`` differs at its own length."""
    n = min(len(expected), len(actual))
    # array comparison is C speed; only a mismatch pays for the Python scan
    if array("i", expected[:n]) == array("i", actual[:n]):
        return None if len(actual) >= len(expected) else n
    for i in range(n):
        if expected[i] != actual[i]:
            return i
    return n  # pragma: no cover - unreachable


