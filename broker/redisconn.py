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
    return redis.Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=5,
        socket_timeout=30,
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(_RETRY_ERRORS),
        max_connections=None,
    )


def broker_transport_options(settings: Settings) -> dict:
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "global_keyprefix": "",
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 15,
        "retry_on_timeout": True,
    }
