"""Why an attempt failed: one exception type carrying a reason code and whether a fresh
attempt could succeed. Reason codes are part of the contract (DLQ, records, metrics)."""

from __future__ import annotations

# Transient: a fresh attempt (new reset) may well succeed.
ENV_UNREACHABLE = "env_unreachable"  # connection refused/reset, connect or read timeout
ENV_SERVER_ERROR = "env_server_error"  # 5xx from the env server
ENV_INSTANCE_LOST = "env_instance_lost"  # 404 for our env_id mid-episode (server restarted)
MODEL_UNAVAILABLE = "model_unavailable"  # 429/5xx/connection/timeouts, retries exhausted
LEASE_LOST = "lease_lost"  # another attempt owns the episode now
WORKER_LOST = "worker_lost"  # lease expired: the worker died (set by the sweeper)
WORKER_SHUTDOWN = "worker_shutdown"  # handed back at SIGTERM after the grace period

# Permanent: the same request will fail the same way.
ENV_BAD_REQUEST = "env_bad_request"  # 4xx on reset: unknown env_name or bad params
ENV_MALFORMED = "env_malformed"  # not JSON, wrong types, missing fields, too large
MODEL_BAD_REQUEST = "model_bad_request"  # 4xx other than 429 (context too long, ...)
MODEL_MALFORMED = "model_malformed"  # not JSON, no choices, wrong types
EPISODE_TIMEOUT = "episode_timeout"  # the attempt's wall-clock budget ran out
BAD_TASK = "bad_task"  # the episode spec could not be read
INTERNAL_ERROR = "internal_error"  # a bug of ours; parked so that it can be re-driven
ATTEMPTS_EXHAUSTED = "attempts_exhausted"  # prefix use: "attempts_exhausted:<last reason>"

TRANSIENT_REASONS = frozenset(
    {ENV_UNREACHABLE, ENV_SERVER_ERROR, ENV_INSTANCE_LOST, MODEL_UNAVAILABLE, LEASE_LOST, WORKER_LOST, WORKER_SHUTDOWN}
)


class EpisodeError(Exception):
    """An attempt cannot go on. ``reason`` is one of the codes above."""

    def __init__(self, reason: str, message: str, *, transient: bool | None = None):
        super().__init__(message)
        self.reason = reason
        self.transient = reason in TRANSIENT_REASONS if transient is None else transient

    def __str__(self) -> str:
        return f"{self.reason}: {self.args[0]}"
