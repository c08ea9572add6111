"""HTTP/1.1 over plain keep-alive sockets, for ``http://`` origins reached without a proxy.

Why a client of our own: an exchange through urllib3 and ``http.client`` costs about 0.3 ms of
a worker's CPU here, where writing the request with one ``sendall`` and reading the answer with
a few ``recv`` calls costs about 25 us (measured side by side against the bench's model
stand-in). A step makes three such calls and an episode two more (reset, close): with
single-turn episodes that was the largest cost an episode had. Env servers and inference
servers inside a cluster are plain HTTP, so that is the path worth owning; ``https://`` and
proxied origins keep urllib3 (TLS, proxy tunnels and their error reporting are not worth
repeating), through :mod:`workers.http_transport`.

What it speaks: requests with a ``Content-Length`` body (or none); answers with
``Content-Length``, ``Transfer-Encoding: chunked``, or a body up to EOF (then the connection
is not reused); ``1xx`` interim answers skipped; ``Connection: close`` and HTTP/1.0 honoured.
Where it connects: the host and port :func:`broker.urls.check_url` approved, taken from its
:class:`~broker.urls.Target`, so the check and the connection read the URL with one parser.
What it refuses, as a protocol error (the connection is closed): a ``101`` (the server would
speak another protocol on the connection), a ``Content-Length`` that is not plain ASCII digits,
and a chunk size that is not plain hex digits (:func:`content_length` and :func:`chunk_size`,
which the urllib3 path applies too).

Failures are raised as the exceptions ``requests`` raises for the same failure (a refused
connect as ``ConnectionError(NewConnectionError)``, a silent server as ``ReadTimeout``, a cut
body as ``ChunkedEncodingError``...), so the rules of :mod:`workers.http_errors`
(``never_reached_server``, ``is_timeout``, ``describe``) and the retry rules judge both paths
alike (``tests/test_plainhttp.py`` holds the two paths to the same answers).
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from typing import Mapping
from urllib.parse import quote

import requests
from urllib3.exceptions import NameResolutionError, NewConnectionError, ProtocolError, ReadTimeoutError

from broker.errors import EPISODE_TIMEOUT, EpisodeError
from broker.ospoll import ReadyCheck
from broker.urls import Target

MAX_HEAD_BYTES = 64 * 1024  # status line and headers of one answer, at most (http.client: 100 lines of 64 KB)
MAX_HEADERS = 100
RECV_BYTES = 64 * 1024
_SLACK_S = 0.005
# What may not appear in a request line or header: a hostile env server's instance id must not
# split a request in two (http.client refuses the same).
_BAD_IN_TARGET = re.compile(r"[\x00-\x20\x7f]")
_PATH_SAFE = "!$%&'()*+,/:;=?@[]~-._"
_BAD_IN_HEADER = re.compile(r"[\r\n\x00]")
_HEADER_NAME = re.compile(r"[^:\s][^:\r\n]*")  # http.client's rule
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A body length past 10**18 bytes is no real answer, and a bounded string keeps int() cheap
# (past 4300 digits it raises instead of converting).
MAX_LENGTH_DIGITS = 18
MAX_CHUNK_SIZE_DIGITS = 16  # a 64-bit chunk size
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def protocol_error(text: str) -> requests.exceptions.ConnectionError:
    """A malformed answer, raised as ``requests`` reports a bad status line: a transport
    fault the clients retry like a dropped connection (workers/http_errors.py)."""
    return requests.exceptions.ConnectionError(ProtocolError("Connection aborted.", http.client.BadStatusLine(text)))


def content_length(declared: str) -> int:
    """The body length a ``Content-Length`` header declares (repeated headers joined with ", "
    must agree). Plain ASCII digits only: ``str.isdigit`` alone takes "²", which ``int``
    refuses, and ``int`` alone takes signs, "_" and spaces. Anything else: :func:`protocol_error`."""
    if declared.isdigit() and declared.isascii() and len(declared) <= MAX_LENGTH_DIGITS:
        return int(declared)  # the one header of nearly every answer
    values = {v.strip() for v in declared.split(",")}
    value = values.pop()
    if values or not (value.isdigit() and value.isascii() and len(value) <= MAX_LENGTH_DIGITS):
        raise protocol_error(f"bad Content-Length {declared[:40]!r}")
    return int(value)


def chunk_size(line: bytes) -> int:
    """The size a chunk-size line (without its CRLF) declares: 1 to 16 hex digits, then
    optionally blanks and ``;`` chunk extensions, which are ignored. ``int(x, 16)`` alone
    takes "0x2", "0_2", signs and leading blanks. ValueError for anything else."""
    size = line.split(b";", 1)[0].rstrip(b" \t")
    if not 0 < len(size) <= MAX_CHUNK_SIZE_DIGITS or size.strip(_HEX_DIGITS):
        raise ValueError(f"bad chunk size {size[:20]!r}")
    return int(size, 16)


class Headers(dict):
    """An answer's headers, names in lower case; lookups ignore case. Repeated headers are
    joined with ", " as urllib3 joins them."""

    def get(self, key, default=None):  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key):
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key):
        return dict.__contains__(self, key.lower() if isinstance(key, str) else key)


class _Conn:
    __slots__ = ("sock", "check", "watch")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.check: ReadyCheck | None = None
        self.watch = None  # what ``arm`` gave for the last call over it (see PlainPool.exchange)

    def dead(self) -> bool:
        """An idle keep-alive connection the server closed (or wrote to) is not reused."""
        if self.check is None:
            self.check = ReadyCheck(self.sock)
        return self.check.ready()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PlainPool:
    """The keep-alive connections of one ``http://`` origin, shared by a worker's threads (or
    greenlets): at most ``maxsize`` at once; a caller finding all in use waits for one (up to
    its deadline) instead of opening more than the server was sized for."""

    scheme = "http"

    def __init__(self, target: Target, maxsize: int, *, user_agent: str):
        if target.scheme != "http":
            raise ValueError("PlainPool speaks plain http only")
        self.host = target.host[1:-1] if target.host.startswith("[") else target.host
        self.port = target.port
        host_header = target.host if target.port == 80 else f"{target.host}:{target.port}"
        self._head = f"Host: {host_header}\r\nUser-Agent: {user_agent}\r\nAccept-Encoding: identity\r\n"
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(maxsize)
        self.maxsize = maxsize
        self.opened = 0  # connections made, for tests and the curious

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # -- connections --------------------------------------------------------------------------

    def _take(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._slots.acquire(timeout=left):
            raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out waiting for a "
                                                "free connection")

    def _idle_conn(self) -> _Conn | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                c = self._idle.pop()
            watch, c.watch = c.watch, None
            if watch is not None:
                # The call that used it last may not have disarmed its watchdog yet, and from
                # here on the socket is another call's. Before the check: a watchdog that
                # fired already left the socket shut, which the check sees.
                watch.cancel()
            if c.dead():
                c.close()
                continue
            return c

    def _connect(self, connect_s: float) -> _Conn:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=connect_s)
        except socket.gaierror as e:
            raise requests.exceptions.ConnectionError(NameResolutionError(self.host, None, e)) from None
        except (socket.timeout, TimeoutError) as e:
            raise requests.exceptions.ConnectTimeout(
                f"connect to {self.host}:{self.port} timed out ({connect_s:.1f} s): {e}") from None
        except OSError as e:
            raise requests.exceptions.ConnectionError(
                NewConnectionError(None, f"Failed to establish a new connection: {e}")) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.opened += 1
        return _Conn(sock)

    def _give_back(self, c: _Conn | None, reusable: bool) -> None:
        if c is not None:
            if reusable:
                with self._lock:
                    self._idle.append(c)
            else:
                c.close()
        self._slots.release()

    # -- one exchange -------------------------------------------------------------------------

    def request_bytes(self, method: str, path: str, headers: Mapping[str, str] | None,
                      body: bytes | None) -> bytes:
        if not path.isascii() or _BAD_IN_TARGET.search(path):
            # As urllib3 does: percent-encoded, so the request line stays one line.
            path = quote(path, safe=_PATH_SAFE)
        if not path.startswith("/"):
            raise http.client.InvalidURL(f"a request path must start with '/': {path[:80]!r}")
        if not _TOKEN.fullmatch(method):
            raise ValueError(f"invalid HTTP method {method!r}")
        parts = [f"{method} {path} HTTP/1.1\r\n", self._head]
        if headers:
            for k, v in headers.items():
                if not _HEADER_NAME.fullmatch(k):
                    raise ValueError(f"invalid header name {k!r}")
                v = str(v)
                if _BAD_IN_HEADER.search(v):
                    raise ValueError(f"invalid header value for {k!r} (a line break or NUL)")
                parts.append(f"{k}: {v}\r\n")
        if body is not None:
            parts.append(f"Content-Length: {len(body)}\r\n")
        elif method in ("POST", "PUT", "PATCH"):
            parts.append("Content-Length: 0\r\n")
        parts.append("\r\n")
        head = "".join(parts).encode("latin-1")
        return head + body if body else head

    def exchange(self, method: str, path: str, headers: Mapping[str, str] | None, body: bytes | None, *,
                 deadline: float, timeout: tuple[float, float], max_bytes: int, error_bytes: int, what: str,
                 arm, too_large) -> tuple[int, Headers, bytes]:
        """Send one request and read its answer: ``(status, headers, body)``. ``arm(sock)`` is
        called once the request is out (the caller's watchdog) and returns None or what it armed,
        whose ``cancel()`` the next call to take the connection calls; ``too_large(text)`` builds the
        exception for a 2xx body over ``max_bytes``. The body of a non-2xx answer is read up to
        ``error_bytes``."""
        request = self.request_bytes(method, path, headers, body)
        self._take(deadline, what)
        c: _Conn | None = None
        reusable = False
        try:
            c = self._idle_conn()
            if c is None:
                c = self._connect(min(timeout[0], max(0.001, deadline - time.monotonic())))
            sock = c.sock
            try:
                sock.settimeout(max(0.001, min(timeout[1], deadline - time.monotonic())))
                sock.sendall(request)
            except OSError as e:
                raise requests.exceptions.ConnectionError(ProtocolError("Connection aborted.", e)) from None
            c.watch = arm(sock)
            reader = _Reader(sock, deadline, timeout[1], what)
            status, hdrs, keep = reader.head()
            ok = 200 <= status < 300
            cap = max_bytes if ok else min(max_bytes, error_bytes)
            data, complete = reader.body(method, status, hdrs, cap, ok, too_large)
            reusable = keep and complete
            return status, hdrs, data
        finally:
            self._give_back(c, reusable)


class _Reader:
    """Reads one answer from ``sock``, each receive bounded by the read timeout and the time
    left before ``deadline``."""

    __slots__ = ("sock", "deadline", "read_s", "what", "buf", "eof")

    def __init__(self, sock, deadline: float, read_s: float, what: str):
        self.sock, self.deadline, self.read_s, self.what = sock, deadline, read_s, what
        self.buf = bytearray()
        self.eof = False

    def _recv(self, *, in_head: bool) -> bool:
        """One receive into the buffer; False at EOF."""
        left = self.deadline - time.monotonic()
        if left <= _SLACK_S:
            raise self._out_of_time()
        sock = self.sock
        try:
            sock.settimeout(min(self.read_s, left))
            chunk = sock.recv(RECV_BYTES)
        except (socket.timeout, TimeoutError) as e:
            if self.deadline - time.monotonic() <= _SLACK_S:
                # the receive waited out the budget, not the read timeout (the watchdog, due at
                # the same moment, may not have fired yet): the same error as when it has
                raise self._out_of_time() from None
            if in_head:
                raise requests.exceptions.ReadTimeout(f"read timed out ({self.read_s:.1f} s): {e}") from None
            raise requests.exceptions.ConnectionError(
                ReadTimeoutError(None, None, f"Read timed out. ({e})")) from None
        except OSError as e:
            if in_head:
                raise requests.exceptions.ConnectionError(ProtocolError("Connection aborted.", e)) from None
            raise requests.exceptions.ChunkedEncodingError(ProtocolError("Connection broken", e)) from None
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def _out_of_time(self) -> EpisodeError:
        return EpisodeError(EPISODE_TIMEOUT, f"{self.what}: the attempt's time budget ran out while reading the answer")

    def head(self) -> tuple[int, Headers, bool]:
        while True:  # 1xx answers come before the real one
            end = self.buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    raise protocol_error("the answer's headers are too long")
                if not self._recv(in_head=True):
                    raise requests.exceptions.ConnectionError(ProtocolError(
                        "Connection aborted.", http.client.RemoteDisconnected(
                            "Remote end closed connection without response")))
                end = self.buf.find(b"\r\n\r\n", max(0, len(self.buf) - RECV_BYTES - 3))
            if end > MAX_HEAD_BYTES:  # the last receive may have brought the end past the bound
                raise protocol_error("the answer's headers are too long")
            raw = bytes(self.buf[:end])
            del self.buf[:end + 4]
            lines = raw.split(b"\r\n")
            status_line = lines[0].split(None, 2)
            if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit() \
                    or len(status_line[1]) != 3:
                raise protocol_error(f"bad status line {lines[0][:80]!r}")
            status = int(status_line[1])
            if len(lines) - 1 > MAX_HEADERS:
                raise protocol_error(f"more than {MAX_HEADERS} headers")
            hdrs = Headers()
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not name or name != name.strip():
                    raise protocol_error(f"bad header line {line[:80]!r}")
                key = name.decode("latin-1").lower()
                val = value.strip().decode("latin-1")
                prev = dict.get(hdrs, key)
                dict.__setitem__(hdrs, key, val if prev is None else f"{prev}, {val}")
            if status == 101:
                # The server switched the connection to another protocol: nothing more on it
                # is an HTTP answer to us.
                raise protocol_error("HTTP 101: the server switched protocols")
            if 100 <= status < 200:
                continue
            conn = dict.get(hdrs, "connection", "").lower()
            keep = "close" not in conn and (status_line[0] != b"HTTP/1.0" or "keep-alive" in conn)
            return status, hdrs, keep

    def body(self, method: str, status: int, hdrs: Headers, cap: int, ok: bool, too_large) -> tuple[bytes, bool]:
        """The body, at most ``cap`` bytes, and whether the answer was read to its end (only
        then may the connection carry another request)."""
        if method == "HEAD" or status in (204, 304):
            return b"", True
        te = dict.get(hdrs, "transfer-encoding")
        if te is not None:
            if te.lower().replace(" ", "").split(",")[-1] != "chunked":
                return self._to_eof(cap, ok, too_large), False
            return self._chunked(cap, ok, too_large)
        declared = dict.get(hdrs, "content-length")
        if declared is not None:
            n = content_length(declared)
            if n > cap:
                if ok:
                    raise too_large(f"{n} bytes declared")
                return self._exactly(cap, body_end=False), False
            return self._exactly(n, body_end=True), True
        return self._to_eof(cap, ok, too_large), False

    def _exactly(self, n: int, *, body_end: bool) -> bytes:
        while len(self.buf) < n:
            if not self._recv(in_head=False):
                if body_end:
                    raise requests.exceptions.ChunkedEncodingError(ProtocolError(
                        "Connection broken", http.client.IncompleteRead(bytes(self.buf), n - len(self.buf))))
                break
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _to_eof(self, cap: int, ok: bool, too_large) -> bytes:
        while len(self.buf) <= cap and self._recv(in_head=False):
            pass
        if len(self.buf) > cap:
            if ok:
                raise too_large(f"more than {cap} bytes")
            return bytes(self.buf[:cap])
        return bytes(self.buf)

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 2]
                return line
            if len(self.buf) > MAX_HEAD_BYTES:
                raise requests.exceptions.ChunkedEncodingError(ProtocolError("chunk line too long"))
            if not self._recv(in_head=False):
                raise requests.exceptions.ChunkedEncodingError(ProtocolError(
                    "Connection broken", http.client.IncompleteRead(b"")))

    def _chunked(self, cap: int, ok: bool, too_large) -> tuple[bytes, bool]:
        out = bytearray()
        while True:
            try:
                size = chunk_size(self._line())
            except ValueError as e:
                raise requests.exceptions.ChunkedEncodingError(ProtocolError(str(e))) from None
            if size == 0:
                while self._line():  # trailers, up to the empty line
                    pass
                return bytes(out), True
            if len(out) + size > cap:
                if ok:
                    raise too_large(f"more than {cap} bytes")
                out += self._exactly(min(size, cap - len(out)), body_end=False)
                return bytes(out), False
            out += self._exactly(size, body_end=True)
            if self._line() != b"":
                raise requests.exceptions.ChunkedEncodingError(ProtocolError("chunk not followed by CRLF"))
