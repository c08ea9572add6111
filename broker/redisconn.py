"""Redis connections for every role: one place for timeouts, retries, TLS and Sentinel.

``connect(settings)`` builds its client from the address broker/redisurl.py read, never from
the URL: a one-server address gets a blocking pool of its own, over TCP, TLS or a unix socket
(:func:`server_options`: where and how to log in); a Sentinel address a client of the primary
the Sentinels name, whose pool asks them again whenever a connection to it fails (redis-py's
``master_for``), with the same pool size, timeouts and retries. A failover is then what a
restart is to the clients: the commands in flight fail with connection errors,
:class:`OutageRetry` retries them with backoff, and the retries reach the promoted replica. The
Celery broker gets the same address (``broker_transport_options``, broker/kombu_redis.py).
"""

from __future__ import annotations

import dataclasses

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from broker.ospoll import ReadyCheck
from broker.redisurl import RedisAddress, RedisUrlError, SentinelAddress, ServerAddress, parse_redis_url
from broker.settings import Settings, SettingsError

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


class OutageRetry(Retry):
    """Retries what an outage looks like, never a refused login: a wrong or missing password
    would fail the same way however long we waited (redis-py's AuthenticationError is a
    ConnectionError, and its Retry would back off a dozen times before saying so)."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(settings: Settings, *, retries: int = 12, max_connections: int | None = None) -> redis.Redis:
    """A client whose pool is sized from the concurrency it serves and *blocks* when full.

    redis-py's default pool raises ``MaxConnectionsError`` past 100 connections, which at
    concurrency 1,000 failed episodes under plain load; a blocking pool makes the caller wait.
    """
    if not settings.redis_url:
        raise SettingsError("no Redis URL: set REDIS_URL (or --redis-url), or --run-dir naming the folder of a "
                            "running `interactor run`, `feed serve` or `demo` (its embedded Redis)")
    common = dict(
        max_connections=max_connections or pool_size(settings),
        timeout=POOL_WAIT_S,
        socket_connect_timeout=5,
        socket_timeout=30,
        socket_keepalive=True,
        health_check_interval=15,
        retry=OutageRetry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        **parser_options(),
    )
    address = redis_address(settings)
    if isinstance(address, SentinelAddress):
        return sentinels_of(address).master_for(
            address.service, redis_class=redis.Redis, connection_pool_class=BlockingSentinelPool, db=address.db,
            username=address.username or None, password=address.password or None, **common)
    options = without_tcp_options(address, common | server_options(address, settings.redis_tls_ca))
    return redis.Redis(connection_pool=redis.BlockingConnectionPool(**options))


def client_for(url: str, **options) -> redis.Redis:
    """A client of the Redis ``url`` names, with redis-py's defaults and ``options``: for tools
    that hold a URL and no settings (the bench). The URL is read by the one parser, as
    :func:`connect` reads it."""
    address = parse_redis_url(url)
    if isinstance(address, SentinelAddress):
        return sentinels_of(address).master_for(address.service, redis_class=redis.Redis, db=address.db,
                                                username=address.username or None,
                                                password=address.password or None, **options)
    options = without_tcp_options(address, options | server_options(address))
    return redis.Redis(connection_pool=redis.ConnectionPool(**options))


# Options of a TCP connection that redis-py's unix socket connection refuses (TypeError).
TCP_ONLY_OPTIONS = ("socket_keepalive", "socket_keepalive_options")


def without_tcp_options(address: ServerAddress, options: dict) -> dict:
    """``options`` fit for ``address``'s connection: a socket's without the TCP-only ones."""
    if not address.is_socket:
        return options
    return {k: v for k, v in options.items() if k not in TCP_ONLY_OPTIONS}


def server_options(address: ServerAddress, tls_ca: str = "") -> dict:
    """redis-py's connection options for where one server is and how to log in to it: its
    connection class (TCP, TLS or unix socket), host and port or socket path, database, user
    name and password, and with TLS the certificate checks (always verified: against ``tls_ca``,
    the ``redis_tls_ca`` setting, else the system's trust store). Our pools and the Celery
    broker's (broker/kombu_redis.py) are both made from these."""
    opts = dict(db=address.db, username=address.username or None, password=address.password or None)
    if address.is_socket:
        return opts | dict(connection_class=redis.UnixDomainSocketConnection, path=address.path)
    opts |= dict(host=address.host, port=address.port)
    if not address.tls:
        return opts | dict(connection_class=redis.Connection)
    opts |= dict(connection_class=redis.SSLConnection, ssl_cert_reqs="required")
    if tls_ca:
        opts["ssl_ca_certs"] = tls_ca
    return opts


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's pool of a Sentinel-managed primary, blocking when full as our other pools do.
    Its connections ask the Sentinels for the primary when they connect, and one still open to
    a primary that was replaced is dropped when it comes back to the pool."""


def redis_address(settings: Settings) -> RedisAddress:
    """The address ``settings.redis_url`` names, a Sentinel one with the Sentinels' own password."""
    try:
        address = parse_redis_url(settings.redis_url)
    except RedisUrlError as exc:  # Settings.validated refuses these first; a hand-made Settings may not
        raise SettingsError(f"redis_url: {exc}") from None
    if isinstance(address, SentinelAddress):
        return dataclasses.replace(address, sentinel_password=settings.redis_sentinel_password.reveal())
    return address


def sentinel_options(address: SentinelAddress) -> dict:
    """How to talk to the Sentinels themselves: their password, and short timeouts with one
    quick retry each, so that a Sentinel that is down costs a moment before the next is asked."""
    opts = dict(socket_connect_timeout=2, socket_timeout=5, socket_keepalive=True,
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
    if address.sentinel_password:
        opts["password"] = address.sentinel_password
    return opts


def sentinels_of(address: SentinelAddress) -> Sentinel:
    return Sentinel(list(address.sentinels), min_other_sentinels=0, sentinel_kwargs=sentinel_options(address))


def broker_transport_options(settings: Settings) -> dict:
    """kombu's transport options, with where Redis is: the address this module's parser read,
    by which broker/kombu_redis.py connects (the broker URL Celery is given only names it, for
    its logs)."""
    address = redis_address(settings)
    if isinstance(address, SentinelAddress):
        where = {"sentinel_address": address, "master_name": address.service,
                 "sentinel_kwargs": sentinel_options(address)}
    else:
        where = {"server_address": address, "redis_tls_ca": settings.redis_tls_ca}
    return where | {
        # kombu's own pool (acks come from the pool's threads at once); its default is 10.
        "max_connections": pool_size(settings),
        "global_keyprefix": "",
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 15,
        "retry_on_timeout": True,
    }
