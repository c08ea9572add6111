"""Where the fleet's Redis is: the one reading of ``REDIS_URL`` (``--redis-url``) for every role.

:func:`parse_redis_url` turns a URL into an address, and every client is built from that
address, never from the URL: our pools (broker/redisconn.py) and the Celery broker's
(broker/kombu_redis.py) alike, so what is checked here is what connects. Two kinds of address,
told apart by the scheme (any case):

* one server, :class:`ServerAddress`:

  - ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`` over TCP (port 6379 when left out),
  - ``rediss://...`` the same over TLS (certificates verified; the CA is a setting,
    ``redis_tls_ca``),
  - ``unix://[[USER]:PASSWORD@]/PATH/TO/SOCKET`` a unix socket, its path absolute.

  The database is the path's ``/DB`` or a ``?db=DB`` query (a socket's only the query), 0 when
  neither; ``?db=`` is the only query option: timeouts, retries and TLS come from interactor's
  settings, not the URL.
* ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]``,
  :class:`SentinelAddress`: a primary with replicas behind Redis Sentinel. The hosts are the
  Sentinels (port 26379 when left out), ``SERVICE`` the name they monitor the primary under,
  ``PASSWORD`` (and ``USER``) the primary's and replicas' own. The Sentinels' password, if they
  have one, is a setting of its own (``redis_sentinel_password``), never in the URL.

Both are strict, as broker/urls.py is for job URLs: ASCII only, no whitespace or control
characters, hosts of letters, digits, ``-`` and ``.`` or a bracketed IPv6 address, ports 1 to
65535, no fragment. A user name or password percent-encodes ``@``, ``/``, ``?``, ``#`` and ``%``
(and ``:`` in a user name): another parser would end the host at the first of them and read the
rest of the password as a port or a path. Anything else is refused with the reason, which never
quotes the password.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

SENTINEL_SCHEME = "redis+sentinel"
TCP_SCHEME, TLS_SCHEME, SOCKET_SCHEME = "redis", "rediss", "unix"
REDIS_PORT = 6379
SENTINEL_PORT = 26379

_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
_ENDPOINT = re.compile(rf"(?P<host>{_HOST})(?::(?P<port>[1-9][0-9]{{0,4}}))?")
_SERVICE = re.compile(r"[A-Za-z0-9._\-]{1,200}")
_DB = re.compile(r"0|[1-9][0-9]{0,4}")
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")

_FORMS = {
    TCP_SCHEME: "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]",
    TLS_SCHEME: "rediss://[[USER]:PASSWORD@]HOST[:PORT][/DB]",
    SOCKET_SCHEME: "unix://[[USER]:PASSWORD@]/PATH/TO/SOCKET[?db=DB]",
    SENTINEL_SCHEME: f"{SENTINEL_SCHEME}://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]",
}
_SCHEMES_SAID = "redis://, rediss://, unix:// or redis+sentinel://"


class RedisUrlError(ValueError):
    """A Redis URL refused; the message says why, never the password."""


@dataclass(frozen=True)
class ServerAddress:
    """One Redis server: a host and port over TCP (``rediss``: with TLS), or a unix socket's
    path. The password is kept out of ``repr`` (an address ends up in Celery's transport
    options)."""

    scheme: str  # TCP_SCHEME, TLS_SCHEME or SOCKET_SCHEME
    host: str = ""
    port: int = 0
    path: str = ""  # the socket's
    db: int = 0
    username: str = ""
    password: str = field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return self.scheme == TLS_SCHEME

    @property
    def is_socket(self) -> bool:
        return self.scheme == SOCKET_SCHEME

    def shown(self) -> str:
        """The address as a URL without its password, for logs and messages."""
        auth = _shown_auth(self.username, self.password)
        if self.is_socket:
            return f"{SOCKET_SCHEME}://{auth}{quote(self.path)}?db={self.db}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"


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


RedisAddress = ServerAddress | SentinelAddress


def _shown_auth(username: str, password: str) -> str:
    user = quote(username, safe="")
    if password:
        return f"{user}:***@"
    return f"{user}@" if user else ""


def parse_redis_url(url: str) -> RedisAddress:
    """The address ``url`` names, or :class:`RedisUrlError` saying why ``url`` is refused."""
    if not isinstance(url, str) or "://" not in url:
        raise RedisUrlError(f"must start with {_SCHEMES_SAID}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme.endswith("+sentinel") and scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"{scheme}:// is not supported (TLS to a Sentinel-managed Redis is not): use "
                            f"{SENTINEL_SCHEME}://")
    if scheme not in _FORMS:
        shown = scheme if _OPTION_NAME.fullmatch(scheme.replace("+", "_")) else "something else"
        raise RedisUrlError(f"must start with {_SCHEMES_SAID}, not {shown}://")
    for c in rest:
        if c.isspace() or ord(c) < 0x20 or ord(c) > 0x7E:  # not echoed: it may be a password's
            raise RedisUrlError("contains a whitespace, control or non-ASCII character; percent-encode it in a "
                                "user name or password")
    if _BAD_PERCENT.search(rest):
        raise RedisUrlError("has a '%' that does not start a percent-encoding (%XX); a '%' of a password is %25")
    username, password, rest = _userinfo(rest)
    if scheme == SENTINEL_SCHEME:
        return _parse_sentinel(rest, username, password)
    if "#" in rest:
        raise RedisUrlError(f"must not have a fragment ('#...'): {_FORMS[scheme]}")
    return _parse_server(scheme, rest, username, password)


def _userinfo(rest: str) -> tuple[str, str, str]:
    """(user name, password, what follows them). The last ``@`` ends them: one that was not
    percent-encoded leaves an ``@``, ``/``, ``?`` or ``#`` before it, which is refused (a URL
    parser would end the host there, and read the rest of the password as a port or a path)."""
    if "@" not in rest:
        return "", "", rest
    userinfo, _, after = rest.rpartition("@")
    if any(c in userinfo for c in "@/?#"):
        raise RedisUrlError("a user name or password must percent-encode '@', '/', '?' and '#' (%40, %2F, %3F, "
                            "%23), or the host is taken from inside it")
    user, _, secret = userinfo.partition(":")  # "user@" alone is a user name, as redis-py reads it
    return unquote(user), unquote(secret), after


def _parse_server(scheme: str, rest: str, username: str, password: str) -> ServerAddress:
    form = _FORMS[scheme]
    rest, _, query = rest.partition("?")
    query_db = _query_db(query, form)
    if scheme == SOCKET_SCHEME:
        path = unquote(rest)
        if not path.startswith("/") or path.endswith("/"):
            raise RedisUrlError(f"must name the socket by its absolute path: {form}")
        return ServerAddress(scheme, path=path, db=query_db or 0, username=username, password=password)
    authority, slash, path = rest.partition("/")
    m = _ENDPOINT.fullmatch(authority)
    if m is None:
        raise RedisUrlError(f"must name the server as HOST[:PORT] (a host of letters, digits, '-' and '.', or a "
                            f"bracketed IPv6 address; a port from 1 to 65535): {form}")
    port = int(m["port"]) if m["port"] else REDIS_PORT
    if port > 65535:
        raise RedisUrlError(f"port {port} is out of range (1 to 65535)")
    host = m["host"][1:-1] if m["host"].startswith("[") else m["host"]
    if path and not _DB.fullmatch(path):
        raise RedisUrlError(f"after the host comes at most a database number: {form}")
    if path and query_db is not None:
        raise RedisUrlError(f"names its database twice (/{path} and ?db={query_db}): give it once")
    db = int(path) if path else query_db or 0
    return ServerAddress(scheme, host=host.lower(), port=port, db=db, username=username, password=password)


def _query_db(query: str, form: str) -> int | None:
    """The database a query names (``db=N``, its only option), None when it names none."""
    db = None
    for item in query.split("&") if query else ():
        name, has_value, value = item.partition("=")
        if name != "db":
            which = f"the query option {name!r} is" if _OPTION_NAME.fullmatch(name) else "the query has an option"
            raise RedisUrlError(f"{which} not supported: ?db=N is the only one (timeouts, retries and TLS are "
                                f"interactor's settings): {form}")
        if db is not None:
            raise RedisUrlError("names ?db= twice")
        if not has_value or not _DB.fullmatch(value):
            raise RedisUrlError(f"?db= takes a database number, 0 or more: {form}")
        db = int(value)
    return db


def _parse_sentinel(rest: str, username: str, password: str) -> SentinelAddress:
    form = _FORMS[SENTINEL_SCHEME]
    if "?" in rest or "#" in rest:
        raise RedisUrlError(f"must not have a query or a fragment: {form}")
    authority, slash, path = rest.partition("/")
    sentinels = []
    for n, part in enumerate(authority.split(","), 1):
        m = _ENDPOINT.fullmatch(part)
        if m is None:
            raise RedisUrlError(f"Sentinel {n} of the list must be HOST:PORT (a host of letters, digits, '-' and '.', "
                                f"or a bracketed IPv6 address; a port from 1 to 65535): {form}")
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


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a primary behind Sentinels (False for a refused URL)."""
    try:
        return isinstance(parse_redis_url(url), SentinelAddress)
    except RedisUrlError:
        return False


def redis_password(url: str) -> str:
    """The password a Redis URL carries, for the places that must keep it out of logs ("" when
    none, or when the URL is refused)."""
    try:
        return parse_redis_url(url).password
    except RedisUrlError:
        return ""
