"""The one check for every URL a job names (env servers, model endpoints), shared by the
producer (refused at submit) and the workers (refused again before any call).

A URL is judged by the parser that connects: urllib3's ``parse_url``, which ``requests`` uses to
prepare every request. Python's ``urlsplit`` reads some URLs differently (it takes the host
after the last ``@``, urllib3 ends the host at a ``\\``), so a check built on one and a
connection made by the other could approve one host and call another. Here the raw text must
also fit a strict grammar, and the host and port that grammar reads must equal what
``parse_url`` reads; anything on which the two could disagree is refused:

* ``http`` or ``https`` only, written ``scheme://host[:port][/path]``;
* no userinfo (``user@``), no ``\\``, no whitespace or control characters, nothing outside
  ASCII, no query or fragment (clients append their routes to a base URL);
* a host of letters, digits, ``-`` and ``.`` (not ending in ``.``), or a bracketed IPv6
  address; a port of 1 to 65535 without leading zeros.

:func:`check_url` returns the :class:`Target` approved; every comparison (trusted model
origins, env host allow-lists) is made on it, never on the raw text.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

MAX_URL_CHARS = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}

_GRAMMAR = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://"
    r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
    r"(?::(?P<port>[1-9][0-9]{0,4}))?"
    r"(?P<path>/[^?#]*)?")


class UrlError(ValueError):
    """A URL refused; the message says why (never the URL's secrets: callers show it redacted)."""


@dataclass(frozen=True)
class Target:
    """Where a checked URL connects: scheme, host (lower case; IPv6 in brackets) and port."""

    scheme: str
    host: str
    port: int

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def _first_bad_char(url: str) -> str:
    for c in url:
        if c == "\\":
            return "a backslash"
        if c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F:
            return f"a whitespace or control character ({c!r})"
        if ord(c) > 0x7E:
            return f"a non-ASCII character ({c!r})"
    return ""


def check_url(url: object) -> Target:
    """The target of an http(s) URL, or :class:`UrlError` saying why it is refused."""
    if not isinstance(url, str) or not url:
        raise UrlError("must be a non-empty http(s) URL")
    if len(url) > MAX_URL_CHARS:
        raise UrlError(f"longer than {MAX_URL_CHARS} characters")
    verdict = _verdict(url)
    if isinstance(verdict, str):
        raise UrlError(verdict)
    return verdict


@functools.lru_cache(maxsize=1024)
def _verdict(url: str) -> "Target | str":
    """The check itself, remembered per URL text: a worker checks the same few URLs for every
    episode (model, env server, allow-list, trusted origins), and the check is a pure function
    of the text."""
    try:
        return _check(url)
    except UrlError as exc:
        return str(exc)


def _check(url: str) -> Target:
    if len(url) > MAX_URL_CHARS:
        raise UrlError(f"longer than {MAX_URL_CHARS} characters")
    bad = _first_bad_char(url)
    if bad:
        raise UrlError(f"contains {bad}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in DEFAULT_PORTS:
        raise UrlError("must start with http:// or https://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        raise UrlError("must not carry user information (user@ or user:password@ before the host)")
    if "?" in rest or "#" in rest:
        raise UrlError("must not have a query or a fragment (routes are appended to it)")
    m = _GRAMMAR.fullmatch(url)
    if m is None:
        raise UrlError("host must be letters, digits, '-' and '.' (or a bracketed IPv6 address), "
                       "and the port a number from 1 to 65535")
    scheme = scheme.lower()
    host = m["host"].lower()
    port = int(m["port"]) if m["port"] else DEFAULT_PORTS[scheme]
    if not 1 <= port <= 65535:
        raise UrlError(f"port {port} is out of range")
    # What the connecting parser makes of the same text must be the same place.
    try:
        parsed = parse_url(url)
    except LocationParseError as exc:
        raise UrlError(f"cannot be parsed: {exc}") from None
    theirs = ((parsed.scheme or "").lower(), (parsed.host or "").lower(),
              parsed.port if parsed.port is not None else DEFAULT_PORTS.get((parsed.scheme or "").lower()))
    if parsed.auth is not None or theirs != (scheme, host, port):
        raise UrlError("is read differently by the HTTP client than by this check")
    return Target(scheme, host, port)


def url_problem(url: object) -> str:
    """Why ``url`` is refused, or "" when it is accepted."""
    try:
        check_url(url)
    except UrlError as exc:
        return str(exc)
    return ""


def origin_of(url: str) -> str:
    """``scheme://host:port`` of an accepted URL (lower case, default port explicit), else ""."""
    try:
        return check_url(url.strip() if isinstance(url, str) else url).origin
    except UrlError:
        return ""
