"""What must not be shown: a secret value (:class:`Secret`), and a URL's credentials
(:func:`redact_url`). URLs are logged and stored; secrets are not. Also which results store a
target names, free of its secrets (:func:`store_identity`)."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit


class Secret(str):
    """A string that never prints itself (repr, str formatting in logs)."""

    def __repr__(self) -> str:
        return "Secret('***')" if self else "Secret('')"

    def reveal(self) -> str:
        return str.__str__(self)


# Query (and fragment) parameters whose values are secrets: passwords, tokens, API keys, OAuth
# codes, signed-URL signatures and credentials.
_SECRET_QUERY_RE = re.compile(
    r"(?i)((?:^|[&;])[^=&;]*(?:password|passwd|pwd|token|secret|key|auth|code|sig|credential|session)[^=&;]*=)"
    r"[^&;]*")


def redact_url(url: str) -> str:
    """``redis://:pw@host/0`` -> ``redis://:***@host/0``, ``https://TOKEN@host`` ->
    ``https://***@host``, ``...?password=pw`` -> ``...?password=***``: URLs are logged and
    stored, secrets are not. A username alone is hidden too: it is often a token.

    A password whose ``/``, ``?`` or ``#`` was not percent-encoded ends the host for a URL
    parser, which then reads the rest of the password as a port, path, query or fragment and
    the last ``@`` as part of it. Whether an ``@`` past the host is that or a path's own, no
    parser can tell, so everything before the last ``@`` is hidden."""
    if "@" not in url and "?" not in url and "#" not in url:  # nothing to hide (the common case)
        return url
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if sep and at >= _host_end(rest):
        return f"{scheme}://***@{_hide_secret_options(rest[at + 1:])}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            netloc = f"{user}:***@{host}"
        else:
            netloc = f"***@{host}"
    query = _SECRET_QUERY_RE.sub(r"\1***", parts.query) if parts.query else parts.query
    fragment = _SECRET_QUERY_RE.sub(r"\1***", parts.fragment) if parts.fragment else parts.fragment
    if netloc == parts.netloc and query == parts.query and fragment == parts.fragment:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _host_end(rest: str) -> int:
    """Where a URL parser ends the authority of ``rest`` (the URL after ``scheme://``)."""
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    return min(ends, default=len(rest))


def _hide_secret_options(text: str) -> str:
    """``text`` with the values of secret-named options hidden, wherever a query or fragment
    of it may start."""
    head, *options = re.split(r"([?#])", text)
    return head + "".join(_SECRET_QUERY_RE.sub(r"\1***", part) for part in options)


def store_identity(target: str) -> str:
    """Which results store a target names, comparable across processes and free of secrets:
    ``sqlite:<real path>`` for a file, the URL without password or query for PostgreSQL. A feed
    server compares its own with the one its job's consumer writes (``Keys.job_store``)."""
    target = str(target)
    if target.startswith(("postgresql://", "postgres://")):
        return redact_url(target).split("?", 1)[0]
    if target.startswith("sqlite://"):
        target = target[len("sqlite://"):]
        if target.startswith("//"):
            target = target[1:]
    return "sqlite:" + os.path.realpath(target)
