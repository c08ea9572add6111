"""Redis connections for every role: one place for timeouts, retries and TLS."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

from broker.settings import Settings

# A Redis restart takes a few seconds (longer while it loads its append-only file); every
# command retries through that window instead of failing the episode.
_RETRY_ERRORS = (ConnectionError, TimeoutError, BusyLoadingError, ConnectionResetError)


def connect(settings: Settings, *, retries: int = 12) -> redis.Redis:
    if not settings.redis_url:
        raise ValueError("no Redis URL: set REDIS_URL (or let `interactor run` start an embedded Redis)")
    tls = {}
    if settings.redis_url.startswith("rediss://"):
        tls = {"ssl_cert_reqs": "required"}
        if settings.redis_tls_ca:
            tls["ssl_ca_certs"] = settings.redis_tls_ca
    return redis.Redis.from_url(
        settings.redis_url,
        **tls,
        socket_connect_timeout=5,
        socket_timeout=30,
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        max_connections=None,
    )


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
        "global_keyprefix": "",
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 15,
        "retry_on_timeout": True,
    }
