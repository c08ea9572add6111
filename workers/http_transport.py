"""HTTP connections shared by the env client and the model client: pools, the urllib3 shortcut,
and one exchange (:func:`send`).

Both clients speak through one :class:`HttpPool` per worker process: a ``requests.Session``
(the project's HTTP library, whose exceptions and proxy rules are the clients' contract) and a
shortcut one level down to the *same* urllib3 connection pools that requests' adapter owns.
A request through ``requests`` costs about 0.4 ms of client CPU here, through its urllib3
pool about 0.15 ms (docs/benchmarks.md): with three calls a step (``get_task_prompt``, the
chat completion, ``step``) and two an episode (``reset``, ``close``), requests was the largest
single cost of a step. The shortcut raises exactly what ``requests`` would raise for the same
failure (``send`` maps urllib3's errors the way ``HTTPAdapter.send`` and ``iter_content`` do),
so the error rules (:mod:`workers.http_errors`: ``never_reached_server``, ``is_timeout``) and the
retry rules (:mod:`workers.retries`) cannot tell the two paths apart. An origin reached through
a proxy takes the ``requests`` path.

Every call takes ``deadline``, an absolute ``time.monotonic()``: no request starts without time
left, a body is read one receive at a time with the socket's timeout cut to the time left, and a
per-process watchdog (:mod:`workers.http_watchdog`) shuts the connection of a call still reading
at its deadline, so a server that trickles bytes (headers or body) cannot hold a call past the
attempt's budget.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import orjson
import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import (
    ClosedPoolError,
    ConnectTimeoutError,
    DecodeError,
    InvalidHeader,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ProxyError as _ProxyError,
    ReadTimeoutError,
    ResponseError,
    SSLError as _SSLError,
)

from broker.errors import EPISODE_TIMEOUT, EpisodeError
from broker.ospoll import ReadyCheck
from broker.settings import Settings
from broker.urls import UrlError, check_url
from workers.deadlines import DEADLINE_SLACK_S, remaining
from workers.http_watchdog import Watch, Watchdog
from workers.plainhttp import MAX_HEAD_BYTES, PlainPool, chunk_size, content_length, protocol_error

ERROR_BODY_READ_BYTES = 64 * 1024  # read at most this much of a non-2xx body
READ_CHUNK = 64 * 1024  # below malloc's mmap threshold: a bigger chunk costs mmap + mremap + munmap per read
USER_AGENT = "interactor"


# --------------------------------------------------------------------------------------------
# Connection pools
# --------------------------------------------------------------------------------------------


def make_session(settings: Settings, pool_size: int | None = None) -> requests.Session:
    """A Session whose pools hold a connection for every thread of the worker, and no urllib3
    retries (retries are decided by the clients, per call, through tenacity).

    ``trust_env`` is off: with it on, requests re-reads the proxy variables and ~/.netrc on
    every request. The proxy variables still apply, resolved once per origin
    (:func:`proxies_for`), and a CA bundle named by REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE is
    used as before. ``pool_block``: a thread that finds every connection of an origin busy
    waits for one instead of opening (and then dropping) an extra connection.
    """
    session = requests.Session()
    session.trust_env = False
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    session.headers["User-Agent"] = USER_AGENT
    size = pool_size or max(10, settings.concurrency * 2)
    adapter = _Adapter(pool_connections=32, pool_maxsize=size, max_retries=0, pool_block=True)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


_proxies: dict[str, dict[str, str]] = {}


def origin_prefix(url: str) -> str:
    """``scheme://netloc`` of ``url`` as written: a cheap slice for the per-request path
    (broker.settings.origin_of normalises one for comparisons)."""
    end = url.find("/", url.find("//") + 2)
    return url if end < 0 else url[:end]


def proxies_for(url: str) -> dict[str, str]:
    """HTTP(S)_PROXY / NO_PROXY for ``url``'s origin, looked up once per origin."""
    origin = origin_prefix(url)
    found = _proxies.get(origin)
    if found is None:
        found = _proxies[origin] = requests.utils.get_environ_proxies(origin)
    return found


class _QuickLivenessCheck:
    """urllib3 checks every pooled connection before reusing it (was it closed by the peer?)
    with ``select.poll`` and a zero timeout. Under gevent that poll is gevent's, which builds
    watchers on the hub for a call that never waits: about a twentieth of a worker's CPU. The
    same check on the OS's own poll never blocks either; the poll object is kept with the
    socket, so a check is one syscall."""

    _liveness: ReadyCheck | None = None

    @property
    def is_connected(self) -> bool:
        sock = self.sock
        if sock is None:
            return False
        held = self._liveness
        if held is None or held.sock is not sock:
            held = self._liveness = ReadyCheck(sock)
        return not held.ready()


_watchdog = Watchdog()
_calls = threading.local()  # the deadline of the call this thread (or greenlet) is making


def _arm(sock) -> Watch | None:
    """Arm the watchdog for this call's socket (the plain path calls it once the request is out)."""
    deadline = getattr(_calls, "deadline", None)
    if deadline is None:
        return None
    w = _calls.watch = _watchdog.arm(deadline, sock)
    return w


class _Watched:
    """Arms the watchdog once the request is out and the answer is awaited."""

    _watch: Watch | None = None

    def getresponse(self, *args, **kwargs):
        deadline = getattr(_calls, "deadline", None)
        if deadline is not None and self.sock is not None:
            _calls.watch = self._watch = _watchdog.arm(deadline, self.sock)
        return super().getresponse(*args, **kwargs)

    @property
    def is_connected(self) -> bool:
        # urllib3 asks this of a connection it takes from the pool for a call. urllib3 put it
        # back when the last call's body was read, before that call disarmed its watchdog:
        # cancel it, so it cannot cut this call's exchange. Before the check, which sees a
        # socket a watchdog already shut.
        w = self._watch
        if w is not None:
            self._watch = None
            w.cancel()
        return super().is_connected


class _OneWrite:
    """A request with a body goes out in one write instead of two.

    urllib3 writes the header block (``endheaders``) and then the body, each with its own
    ``send``: with Nagle off that is two syscalls and two segments, and on loopback every send
    also pays the receiving side's TCP work. Holding the header block back until the body's
    first write joins them; the bytes on the wire are the same."""

    _held: bytes | None = None
    _hold = False

    def request(self, method, url, body=None, headers=None, **kwargs):
        self._hold = isinstance(body, (bytes, bytearray)) and 0 < len(body) <= 1024 * 1024
        try:
            return super().request(method, url, body=body, headers=headers, **kwargs)
        finally:
            held, self._held, self._hold = self._held, None, False
            if held is not None:  # no body write came (an error on the way): send what was held
                super().send(held)

    def send(self, data):
        if self._hold:
            if self._held is None:
                self._held = bytes(data)  # the header block
                return
            data = self._held + data
            self._held = None
            self._hold = False
        sock = self.sock
        if sock is None or not isinstance(data, (bytes, bytearray)):
            return super().send(data)
        # sendall, without gevent's per-call SO_SNDBUF lookup (a syscall) for a few KB.
        view = memoryview(data)
        while view:
            view = view[sock.send(view):]


class _StrictChunks(http.client.HTTPResponse):
    """http.client reads a chunk size with ``int(line, 16)``, which takes "0x2", "0_2" and
    signs: read it as the plain path does (``plainhttp.chunk_size``). A bad one ends the read
    as any bad chunk does (urllib3's ProtocolError, ``ChunkedEncodingError`` to the caller)."""

    def _read_next_chunk_size(self) -> int:
        line = self.fp.readline(MAX_HEAD_BYTES + 1)
        if len(line) > MAX_HEAD_BYTES:
            raise http.client.LineTooLong("chunk size")
        try:
            return chunk_size(line.rstrip(b"\r\n"))
        except ValueError:
            self._close_conn()  # as http.client does: the framing is lost
            raise


class _Connection(_Watched, _OneWrite, _QuickLivenessCheck, HTTPConnection):
    response_class = _StrictChunks


class _TLSConnection(_Watched, _OneWrite, _QuickLivenessCheck, HTTPSConnection):
    response_class = _StrictChunks


class _WatchedPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _Connection


class _WatchedTLSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _TLSConnection


class _Adapter(HTTPAdapter):
    """requests' adapter, whose proxy pools make the same connections as the shortcut's: a call
    through HTTP(S)_PROXY arms the watchdog too, so a proxy that trickles (or relays a server
    that does) cannot hold it past its deadline."""

    def proxy_manager_for(self, proxy, **proxy_kwargs):
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, urllib3.ProxyManager) and manager.pool_classes_by_scheme.get("http") is not _WatchedPool:
            manager.pool_classes_by_scheme = {"http": _WatchedPool, "https": _WatchedTLSPool}
        return manager


class HttpPool:
    """One per client per worker process, shared by its threads: a requests Session, and for
    each origin the pool a call goes through (``pool_for``): our own keep-alive pool for plain
    ``http://`` (workers/plainhttp.py), else the urllib3 pool that the Session's adapter owns."""

    def __init__(self, session: requests.Session, *, plain: bool = True):
        self.session = session
        self.plain = plain
        self._pools: dict[str, Any] = {}  # origin -> PlainPool or urllib3 pool, or None (requests' path)

    @classmethod
    def for_settings(cls, settings: Settings, pool_size: int | None = None) -> "HttpPool":
        return cls(make_session(settings, pool_size))

    def close(self) -> None:
        for pool in self._pools.values():
            if isinstance(pool, PlainPool):
                pool.close()
        self.session.close()
        self._pools.clear()

    def pool_for(self, url: str):
        """The urllib3 pool requests itself would use for ``url`` (same TLS settings), or
        None when the origin goes through a proxy (then requests handles the call)."""
        origin = origin_prefix(url)
        try:
            return self._pools[origin]
        except KeyError:
            pass
        pool = None
        if not proxies_for(url):
            pool = self._plain_pool(origin)
        if pool is None and not proxies_for(url):
            adapter = self.session.get_adapter(url)
            if isinstance(adapter, HTTPAdapter):
                probe = requests.PreparedRequest()
                probe.prepare(method="GET", url=origin + "/")
                verify, cert = self.session.verify, self.session.cert
                pool = adapter.get_connection_with_tls_context(probe, verify, proxies={}, cert=cert)
                adapter.cert_verify(pool, probe.url, verify, cert)
                pool.ConnectionCls = _TLSConnection if origin.startswith("https:") else _Connection
        self._pools[origin] = pool
        return pool

    def _plain_pool(self, origin: str) -> "PlainPool | None":
        """Our own pool for a plain-http origin, connecting where the URL check says; None for
        TLS, when switched off, or for an origin the check refuses (urllib3 then reports it)."""
        if not self.plain or not origin.startswith("http:"):
            return None
        try:
            target = check_url(origin)
        except UrlError:
            return None
        adapter = self.session.get_adapter(origin + "/")
        size = getattr(adapter, "_pool_maxsize", 10)
        return PlainPool(target, size, user_agent=USER_AGENT)


# --------------------------------------------------------------------------------------------
# One exchange
# --------------------------------------------------------------------------------------------


class TooLarge(Exception):
    pass


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


_JSON_TYPE = {"Content-Type": "application/json"}
_NO_RETRIES = urllib3.Retry(0, read=False)  # what HTTPAdapter(max_retries=0) passes: errors come wrapped


def send(
    http: HttpPool,
    method: str,
    url: str,
    *,
    deadline: float,
    timeout: tuple[float, float],
    max_bytes: int,
    what: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One HTTP exchange. The body of a 2xx answer is read in full up to ``max_bytes`` (more:
    :class:`TooLarge`); of other answers only the first ``ERROR_BODY_READ_BYTES`` (for the
    message). Transport errors propagate as ``requests`` exceptions, whichever path was taken.
    """
    started = time.monotonic()
    pool = http.pool_for(url)
    _calls.deadline, _calls.watch = deadline, None
    try:
        if isinstance(pool, PlainPool):
            extra = headers
            if body is not None and not (headers and any(k.lower() == "content-type" for k in headers)):
                extra = {**headers, **_JSON_TYPE} if headers else _JSON_TYPE
            status, hdrs, data = pool.exchange(
                method, url[len(origin_prefix(url)):] or "/", extra,
                body if body is None or isinstance(body, bytes) else bytes(body),
                deadline=deadline, timeout=timeout, max_bytes=max_bytes, error_bytes=ERROR_BODY_READ_BYTES,
                what=what, arm=_arm, too_large=TooLarge)
            reply = Reply(status, hdrs, data, time.monotonic() - started)
        elif pool is None:  # through a proxy: requests' path, over the same watched connections
            reply = _send_requests(http.session, method, url, deadline=deadline, timeout=timeout,
                                   max_bytes=max_bytes, what=what, body=body, headers=headers, started=started)
        else:
            hdrs = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
            if headers:
                hdrs.update(headers)
            if body is not None:
                hdrs.setdefault("Content-Type", "application/json")
            path = url[len(origin_prefix(url)):] or "/"
            reply = _exchange(pool, method, path, hdrs, body, deadline=deadline, timeout=timeout,
                              max_bytes=max_bytes, what=what, started=started)
        if _cut_by_watchdog():
            # The cut can look like an answer ending early (headers cut at a line, a body at EOF).
            raise _ran_out(what)
        return reply
    except requests.exceptions.RequestException:
        if _cut_by_watchdog():
            raise _ran_out(what) from None
        raise
    finally:
        w = _calls.watch
        _calls.deadline = _calls.watch = None
        if w is not None:
            _watchdog.disarm(w)


def _cut_by_watchdog() -> bool:
    """Whether the watchdog shut the connection of this thread's call (its deadline passed)."""
    w = _calls.watch
    return w is not None and w.fired


def _ran_out(what: str) -> EpisodeError:
    return EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out while the server "
                                         "was still answering")


def _exchange(pool, method: str, path: str, hdrs: dict, body: bytes | None, *, deadline: float,
              timeout: tuple[float, float], max_bytes: int, what: str, started: float) -> Reply:
    try:
        resp = pool.urlopen(method, path, body=body, headers=hdrs, redirect=False, assert_same_host=False,
                            preload_content=False, decode_content=False, retries=_NO_RETRIES,
                            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]))
    except _URLOPEN_FAILURES as err:
        raise _as_requests_error(err, _URLOPEN_ERRORS) from None
    try:
        return _read_reply(resp, resp.status, resp.headers, method, deadline=deadline, timeout=timeout,
                           max_bytes=max_bytes, what=what, started=started)
    finally:
        # Read in full, urllib3 has put the connection back already. Otherwise what was not
        # read leaves it unusable: close it, and give the pool its slot back.
        if resp.connection is not None:
            resp.close()
            resp.release_conn()


def _max_retry_error(err: MaxRetryError) -> Exception:
    """What ``HTTPAdapter.send`` raises for urllib3's MaxRetryError: it goes by the reason."""
    reason = err.reason
    if isinstance(reason, ConnectTimeoutError) and not isinstance(reason, NewConnectionError):
        return requests.exceptions.ConnectTimeout(err)
    if isinstance(reason, ResponseError):
        return requests.exceptions.RetryError(err)
    if isinstance(reason, _ProxyError):
        return requests.exceptions.ProxyError(err)
    if isinstance(reason, _SSLError):
        return requests.exceptions.SSLError(err)
    return requests.exceptions.ConnectionError(err)


# urllib3's failures as ``requests`` reports the same ones (first match wins): while the request
# goes out and the answer's head comes back (``HTTPAdapter.send``), and while the body is read
# (``iter_content``). InvalidHeader: Content-Length values that disagree (urlopen has closed the
# connection).
_ErrorTable = tuple[tuple[type[Exception], Callable[[Any], Exception]], ...]
_URLOPEN_ERRORS: _ErrorTable = (
    (ProtocolError, requests.exceptions.ConnectionError), (OSError, requests.exceptions.ConnectionError),
    (MaxRetryError, _max_retry_error), (ClosedPoolError, requests.exceptions.ConnectionError),
    (_SSLError, requests.exceptions.SSLError), (ReadTimeoutError, requests.exceptions.ReadTimeout),
    (InvalidHeader, lambda err: protocol_error(str(err)[:120])),
)
_READ_ERRORS: _ErrorTable = (
    (ProtocolError, requests.exceptions.ChunkedEncodingError),
    (DecodeError, requests.exceptions.ContentDecodingError), (ReadTimeoutError, requests.exceptions.ConnectionError),
    (_SSLError, requests.exceptions.SSLError), (OSError, requests.exceptions.ConnectionError),
)
_URLOPEN_FAILURES = tuple(cause for cause, _ in _URLOPEN_ERRORS)
_READ_FAILURES = tuple(cause for cause, _ in _READ_ERRORS)


def _as_requests_error(err: Exception, table: _ErrorTable) -> Exception:
    """``err`` as the exception ``requests`` raises for it; the caller catches only ``table``'s
    failures (``_URLOPEN_FAILURES``, ``_READ_FAILURES``), so one of its rows matches."""
    return next(as_requests(err) for cause, as_requests in table if isinstance(err, cause))


def _read_reply(resp, status: int, headers: Mapping[str, str], method: str, *, deadline: float,
                timeout: tuple[float, float], max_bytes: int, what: str, started: float) -> Reply:
    """The answer whose head came back (``resp``, urllib3's), its body read: in full up to
    ``max_bytes`` for a 2xx (more: :class:`TooLarge`), the first ``ERROR_BODY_READ_BYTES`` of
    any other."""
    ok = 200 <= status < 300
    cap = max_bytes if ok else min(max_bytes, ERROR_BODY_READ_BYTES)
    declared = _declared_length(method, status, headers)
    if ok and declared is not None and declared > max_bytes:
        raise TooLarge(f"{declared} bytes declared")
    data = _read_body(resp, deadline=deadline, read_s=timeout[1], cap=cap, ok=ok, what=what)
    return Reply(status, headers, data, time.monotonic() - started)


def _declared_length(method: str, status: int, headers: Mapping[str, str]) -> int | None:
    """The body length an answer read by http.client declares, checked as the plain path
    checks it (``plainhttp.content_length``: http.client takes "+2" and reads a body it cannot
    parse the length of to EOF). A 1xx other than 100, which http.client hands over as a
    bodiless answer with the real one left on the connection, is a protocol error: the
    caller closes the connection."""
    if status < 200:
        raise protocol_error(f"HTTP {status} where the answer was due")
    declared = headers.get("Content-Length")
    if declared is None or method == "HEAD" or status in (204, 304) or "Transfer-Encoding" in headers:
        return None
    return content_length(declared.strip())


def _read_body(resp, *, deadline: float, read_s: float, cap: int, ok: bool, what: str) -> bytes:
    """Read ``resp``'s body one receive at a time, each bounded by the time left (a trickling
    server meets the deadline); the same requests exceptions as ``iter_content`` on failure.

    The connection is ours until urllib3 puts it back into the pool (body read in full, or a
    failed read): only then may another thread take it, so its timeout is set only while
    ``resp.connection`` still holds it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = remaining(deadline)
        if left <= DEADLINE_SLACK_S:
            raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out while reading the answer")
        conn = resp.connection
        sock = getattr(conn, "sock", None) if conn is not None else None
        if sock is not None:
            sock.settimeout(min(read_s, left))
        try:
            chunk = resp.read1(READ_CHUNK, decode_content=True)
        except _READ_FAILURES as err:
            raise _as_requests_error(err, _READ_ERRORS) from None
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            if ok:
                raise TooLarge(f"more than {cap} bytes")
            break  # an error body is cut short (the caller closes the connection)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return data if size <= cap else data[:cap]


def _send_requests(session: requests.Session, method: str, url: str, *, deadline: float,
                   timeout: tuple[float, float], max_bytes: int, what: str, body: bytes | None,
                   headers: Mapping[str, str] | None, started: float) -> Reply:
    hdrs = dict(headers or {})
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    with session.request(method, url, data=body, headers=hdrs, timeout=timeout, stream=True,
                         proxies=proxies_for(url)) as resp:
        # read as the shortcut reads (not iter_content, whose chunked reading parses chunk
        # sizes with int(x, 16)): the same errors, each receive bounded by the time left
        return _read_reply(resp.raw, resp.status_code, resp.headers, method, deadline=deadline, timeout=timeout,
                           max_bytes=max_bytes, what=what, started=started)


# --------------------------------------------------------------------------------------------
# The JSON of the wire
# --------------------------------------------------------------------------------------------


def parse_json(data: bytes) -> Any:
    """JSON or ValueError: also for invalid UTF-8, lone surrogates, NaN/Infinity and numbers
    out of range (orjson is strict where Python's json is lenient, which keeps such values out
    of records that msgpack could not encode); absurd nesting too."""
    try:
        return orjson.loads(data)
    except RecursionError:  # pragma: no cover - orjson limits depth itself
        raise ValueError("JSON nested too deeply") from None


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes; TypeError for what JSON cannot carry (also lone surrogates and
    integers past 64 bits)."""
    return orjson.dumps(obj)


# --------------------------------------------------------------------------------------------
# The clients' base
# --------------------------------------------------------------------------------------------


class PooledClient:
    """What the env and model clients share: one per worker process, used by all its threads,
    over one connection pool (``HttpPool``) built from the settings."""

    def __init__(self, settings: Settings, *, session: requests.Session | None = None):
        self.settings = settings
        self.http = HttpPool(session or make_session(settings), plain=settings.http_plain_client)

    @property
    def session(self) -> requests.Session:
        return self.http.session

    def shutdown(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def __repr__(self) -> str:  # never the settings: they hold the API key
        return f"{type(self).__name__}()"
