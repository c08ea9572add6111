"""Where the fleet's Redis is: the one reading of ``REDIS_URL`` (``--redis-url``) for every role.

Two forms, told apart by the scheme:

* ``redis://``, ``rediss://``, ``unix://``: one server. redis-py's ``from_url`` connects to it
  (broker/redisconn.py), so redis-py's own ``parse_url`` is what reads it here too (its
  password, for the places that must keep it out of logs).
* ``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``: a primary with
  replicas behind Redis Sentinel. The hosts are the Sentinels (port 26379 when left out),
  ``SERVICE`` the name they monitor the primary under, ``PASSWORD`` (and ``USER``) the
  primary's and replicas' own. The Sentinels' password, if they have one, is a setting of its
  own (``redis_sentinel_password``), never in the URL. Nothing else reads this form:
  :func:`parse_redis_url` is the parser the connections are made from (our pools and the
  Celery broker alike, broker/redisconn.py and broker/kombu_redis.py), so what is checked here
  is what connects.

The Sentinel form is strict, as broker/urls.py is for job URLs: ASCII only, no whitespace,
hosts of letters, digits, ``-`` and ``.`` or a bracketed IPv6 address, ports 1 to 65535, a
service name of letters, digits, ``-``, ``_`` and ``.``, no query or fragment; a password with
``@``, ``/``, ``,`` or ``:`` in it is percent-encoded. Anything else is refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379

_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
_ENDPOINT = re.compile(rf"(?P<host>{_HOST})(?::(?P<port>[1-9][0-9]{{0,4}}))?")
_SERVICE = re.compile(r"[A-Za-z0-9._\-]{1,200}")
_DB = re.compile(r"0|[1-9][0-9]{0,4}")


class RedisUrlError(ValueError):
    """A Redis URL refused; the message says why, never the password."""


@dataclass(frozen=True)
class SentinelAddress:
    """A primary behind Sentinels: where to ask, for which service, and how to log in to it.
    Passwords are kept out of ``repr`` (an address ends up in Celery's transport options)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str = ""
    password: str = field(default="", repr=False)
    sentinel_password: str = field(default="", repr=False)  # the Sentinels' own (a setting, not the URL)

    def shown(self) -> str:
        """The address as a URL without its password, for logs and messages."""
        auth = ":***@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{self.service}/{self.db}"


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME if "://" in url else False


def parse_redis_url(url: str) -> SentinelAddress | None:
    """The Sentinel address ``url`` names, None for a one-server URL (redis-py reads that one),
    or :class:`RedisUrlError` saying why ``url`` is refused."""
    if not isinstance(url, str) or "://" not in url:
        raise RedisUrlError("must be redis://, rediss://, unix:// or redis+sentinel://")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme in PLAIN_SCHEMES:
        return None
    if scheme.endswith("+sentinel") and scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"{scheme}:// is not supported (TLS to a Sentinel-managed Redis is not): use "
                            f"{SENTINEL_SCHEME}://")
    if scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"must start with redis://, rediss://, unix:// or {SENTINEL_SCHEME}://, not {scheme}://")
    return _parse_sentinel(rest)


def _parse_sentinel(rest: str) -> SentinelAddress:
    form = f"{SENTINEL_SCHEME}://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
    for c in rest:
        if c.isspace() or ord(c) < 0x20 or ord(c) > 0x7E:
            raise RedisUrlError(f"contains a whitespace, control or non-ASCII character ({c!r}); percent-encode "
                                "it in a password")
    if "?" in rest or "#" in rest:
        raise RedisUrlError(f"must not have a query or a fragment: {form}")
    authority, slash, path = rest.partition("/")
    username = password = ""
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
        if "@" in userinfo or "/" in userinfo:
            raise RedisUrlError("its password must percent-encode '@' and '/'")
        user, _, secret = userinfo.partition(":")  # "user@" alone is a user name, as redis-py reads it
        username, password = unquote(user), unquote(secret)
    sentinels = []
    for n, part in enumerate(authority.split(","), 1):
        m = _ENDPOINT.fullmatch(part)
        if m is None:  # not echoed: a password with a raw '/' ends up here
            raise RedisUrlError(f"Sentinel {n} of the list must be HOST:PORT (a host of letters, digits, '-' and '.', "
                                f"or a bracketed IPv6 address; a port from 1 to 65535; a password percent-encodes "
                                f"'/'): {form}")
        port = int(m["port"]) if m["port"] else SENTINEL_PORT
        if port > 65535:
            raise RedisUrlError(f"port {port} of Sentinel {m['host']} is out of range")
        host = m["host"][1:-1] if m["host"].startswith("[") else m["host"]
        sentinels.append((host.lower(), port))
    parts = path[:-1].split("/") if path.endswith("/") else path.split("/")
    service, db = parts[0], parts[1] if len(parts) > 1 else ""
    if not slash or not _SERVICE.fullmatch(service):
        raise RedisUrlError(f"must name the service the Sentinels monitor (letters, digits, '-', '_', '.'): {form}")
    if len(parts) > 2 or (db and not _DB.fullmatch(db)):
        raise RedisUrlError(f"after the service comes at most a database number: {form}")
    return SentinelAddress(tuple(sentinels), service, int(db or 0), username, password)


def redis_url_problem(url: str) -> str:
    """Why ``url`` is refused as the fleet's Redis, or "" when it is accepted."""
    try:
        parse_redis_url(url)
    except RedisUrlError as exc:
        return str(exc)
    return ""


def redis_password(url: str) -> str:
    """The password a Redis URL carries ("" when none, or unreadable), read as the connecting
    parser reads it: ours for the Sentinel form, redis-py's for the others."""
    try:
        address = parse_redis_url(url)
    except RedisUrlError:
        return ""
    if address is not None:
        return address.password
    from redis.connection import parse_url

    try:
        return str(parse_url(url).get("password") or "")
    except ValueError:
        return ""
