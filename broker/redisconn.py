"""Redis connections for every role: one place for timeouts, retries and TLS."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

from broker.ospoll import ReadyCheck
from broker.settings import Settings

try:  # redis-py's C reply parser, present with the hiredis extra (pyproject)
    from redis._parsers import _HiredisParser
    from redis._parsers.hiredis import _socket_is_closed
    from redis.exceptions import ConnectionError as _RedisConnectionError
except ImportError:  # pragma: no cover - an older redis-py or no hiredis: its own parser
    _HiredisParser = None


if _HiredisParser is not None:
    class QuickReadyParser(_HiredisParser):
        """redis-py's hiredis parser, whose "is this pooled connection clean?" check (made
        before every command a pool hands out) polls with the OS's own ``poll``, kept with the
        socket. redis-py builds a fresh ``select.poll`` per check, which under gevent is
        gevent's: hub watchers and a timeout per command, about a fifteenth of a worker's CPU
        with single-turn episodes. The answer is the same: buffered data or a readable socket
        is True, a socket the server closed raises."""

        _ready: ReadyCheck | None = None

        def can_read(self, timeout: float = 0) -> bool:
            reader, sock = getattr(self, "_reader", None), getattr(self, "_sock", None)
            if timeout or reader is None or sock is None or hasattr(sock, "pending"):
                return super().can_read(timeout)  # a wait, no connection, or TLS: as redis-py does
            if reader.has_data():
                return True
            ready = self._ready
            if ready is None or ready.sock is not sock:
                ready = self._ready = ReadyCheck(sock)
            if not ready.ready():
                return False
            if _socket_is_closed(sock):
                raise _RedisConnectionError("Connection closed by server.")
            return True
else:  # pragma: no cover
    QuickReadyParser = None


def parser_options() -> dict:
    """Connection keyword arguments for the quick check, where redis-py has what it needs."""
    return {"parser_class": QuickReadyParser} if QuickReadyParser is not None else {}

# A Redis restart takes a few seconds (longer while it loads its append-only file); every
# command retries through that window instead of failing the episode.
_RETRY_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, ConnectionResetError)


# A caller that finds every pooled connection in use waits this long for one, then the call
# fails like an unreachable Redis (transient). A full pool is load, never an episode's fault.
POOL_WAIT_S = 60.0
POOL_HEADROOM = 16  # connections beyond one per episode thread: renewer, sweeper, metrics


def pool_size(settings: Settings) -> int:
    """Connections a process may hold at once: one per episode it runs, plus its own threads'."""
    return max(1, settings.concurrency) + POOL_HEADROOM


def connect(settings: Settings, *, retries: int = 12, max_connections: int | None = None) -> redis.Redis:
    """A client whose pool is sized from the concurrency it serves and *blocks* when full.

    redis-py's default pool raises ``MaxConnectionsError`` past 100 connections, which at
    concurrency 1,000 failed episodes under plain load; a blocking pool makes the caller wait.
    """
    if not settings.redis_url:
        raise ValueError("no Redis URL: set REDIS_URL (or let `interactor run` start an embedded Redis)")
    tls = {}
    if settings.redis_url.startswith("rediss://"):
        tls = {"ssl_cert_reqs": "required"}
        if settings.redis_tls_ca:
            tls["ssl_ca_certs"] = settings.redis_tls_ca
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url,
        **tls,
        max_connections=max_connections or pool_size(settings),
        timeout=POOL_WAIT_S,
        socket_connect_timeout=5,
        socket_timeout=30,
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        **parser_options(),
    )
    return redis.Redis(connection_pool=pool)


def broker_use_ssl(settings: Settings) -> dict | None:
    """kombu refuses a rediss:// URL without TLS options; certificates are always verified."""
    if not settings.redis_url.startswith("rediss://"):
        return None
    import ssl

    opts = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if settings.redis_tls_ca:
        opts["ssl_ca_certs"] = settings.redis_tls_ca
    return opts


def broker_transport_options(settings: Settings) -> dict:
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        # kombu's own pool (acks come from the pool's threads at once); its default is 10.
        "max_connections": pool_size(settings),
        "global_keyprefix": "",
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 15,
        "retry_on_timeout": True,
    }
