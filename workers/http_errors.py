"""Transport errors and server error answers, in words and classified: what the server said
(:func:`error_text`), what stays of it when the parts that differ between two failures alike are
masked (:func:`error_signature`), whether a failed call provably never reached the server
(:func:`never_reached_server`, the condition for retrying a call that is not safe to repeat),
whether it timed out, a short key-free description, and a ``Retry-After`` hint.

Whichever path a call took (workers/http_transport.py), its failures arrive as ``requests``
exceptions, so these rules judge all of them alike.
"""

from __future__ import annotations

import email.utils
import http.client
import math
import re
import time
from typing import TYPE_CHECKING, Any, Mapping

import orjson
import requests
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError, ReadTimeoutError

try:  # urllib3 >= 2 (a subclass of NewConnectionError there; listed for clarity)
    from urllib3.exceptions import NameResolutionError
except ImportError:  # pragma: no cover
    NameResolutionError = NewConnectionError  # type: ignore[misc,assignment]

if TYPE_CHECKING:
    from workers.http_transport import Reply

ERROR_TEXT_CHARS = 600  # server error text quoted in messages, at most: its head and its tail
_ERROR_HEAD_CHARS = 200  # ... of which the head; the rest is the tail, where a traceback says why
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")  # terminal colour and cursor codes


def error_text(reply: Reply, *, scrub: str = "") -> str:
    """The server's error message, readable: JSON ``error``/``detail``/``message`` or the raw
    text, terminal colour codes stripped, whitespace folded, and when long its head and its
    tail (the cause of a Python traceback is at its end)."""
    return shorten(full_error_text(reply, scrub=scrub)) or "<empty body>"


def full_error_text(reply: Reply, *, scrub: str = "") -> str:
    """:func:`error_text` before it is shortened ("" for an empty body)."""
    text = reply.body.decode("utf-8", "replace")
    try:
        obj = orjson.loads(text)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        for key in ("error", "detail", "message"):
            if key in obj:
                val = obj[key]
                if isinstance(val, dict) and "message" in val:
                    val = val["message"]
                text = val if isinstance(val, str) else orjson.dumps(val, default=str).decode()
                break
    text = " ".join(_ANSI.sub("", text).split())
    if scrub:
        text = text.replace(scrub, "***")
    return text


# What differs between two failures alike of one server: a Ray actor's creation error, as the
# original system's env server (one Ray actor per instance) answers a constructor that raised,
# names the dead actor's process, id and object address, and logs add times. Masked, the same
# bad parameters read the same on every try; the exception line at the end still tells
# different failures apart.
_VOLATILE = (
    (re.compile(r"\b(pid|tid|ip|actor_id|node_id|worker_id)=[^\s,;)\]]+"), r"\1=*"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x*"),
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"\b[0-9a-fA-F]{16,}\b"), "<hex>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),
)


def error_signature(text: str) -> str:
    """``text`` with what differs between two failures alike masked: terminal colour codes,
    ``pid=``, ``ip=``, ``actor_id=`` and such ``name=value`` ids, ``0x`` addresses, UUIDs and
    other hex ids of 16 digits or more, dates and clock times; whitespace folded. Two errors
    with one signature are one failure repeated (``workers/envclient.py``: a reset that fails
    alike twice is the task's parameters)."""
    text = _ANSI.sub("", text)
    for pattern, mask in _VOLATILE:
        text = pattern.sub(mask, text)
    return " ".join(text.split())


def shorten(text: str, limit: int = ERROR_TEXT_CHARS) -> str:
    """``text`` if short enough, else its head and tail around `` ... ``."""
    if len(text) <= limit:
        return text
    tail = limit - _ERROR_HEAD_CHARS
    return f"{text[:_ERROR_HEAD_CHARS]} ... {text[-tail:]}"


def never_reached_server(exc: BaseException) -> bool:
    """True only when the connection could not be established, so the request was not sent."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    if isinstance(exc, requests.exceptions.ConnectionError) and not isinstance(
        exc, (requests.exceptions.ProxyError, requests.exceptions.SSLError)
    ):
        cause: Any = exc.args[0] if exc.args else None
        if isinstance(cause, MaxRetryError):
            cause = cause.reason
        return isinstance(cause, (NewConnectionError, NameResolutionError))
    return False


def is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, requests.exceptions.Timeout):
        return True
    # A read timeout while streaming the body surfaces as ConnectionError(ReadTimeoutError).
    cause = exc.args[0] if isinstance(exc, requests.exceptions.ConnectionError) and exc.args else None
    return isinstance(cause, ReadTimeoutError)


def describe(exc: BaseException) -> str:
    """A short, key-free description of a transport error."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "connect timeout"
    if is_timeout(exc):
        return "read timeout"
    if never_reached_server(exc):
        cause: Any = exc.args[0] if exc.args else None
        if isinstance(cause, MaxRetryError):
            cause = cause.reason
        if isinstance(cause, NameResolutionError) and NameResolutionError is not NewConnectionError:
            return "name resolution failed"
        return "connection refused or unreachable"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "connection dropped while reading the answer"
    if isinstance(exc, requests.exceptions.ConnectionError):
        return "malformed HTTP answer" if _malformed(exc) else "connection dropped or reset"
    return type(exc).__name__


def _malformed(exc: requests.exceptions.ConnectionError) -> bool:
    """The server answered, but not in HTTP/1.1 as spoken (a bad status line or header, a 101):
    ``ProtocolError("Connection aborted.", <an http.client error>)`` on both paths. A server
    that closed without answering is RemoteDisconnected, an http.client error too, and a
    connection error: that is a dropped connection."""
    cause: Any = exc.args[0] if exc.args else None
    if not isinstance(cause, ProtocolError) or len(cause.args) < 2:
        return False
    inner = cause.args[1]
    return isinstance(inner, http.client.HTTPException) and not isinstance(inner, OSError)


def retry_after_s(headers: Mapping[str, str], cap: float) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or HTTP date), capped; None if absent/bad."""
    raw = headers.get("Retry-After") if headers is not None else None
    if not raw:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        value = when.timestamp() - time.time()
    if math.isnan(value):
        return None
    return max(0.0, min(value, cap))
