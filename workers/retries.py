"""The retry engine of the HTTP clients: :func:`run_with_retries` runs an attempt until it
returns, fails for good, or runs out of tries or of the deadline; an attempt raises
:class:`Retryable` for a failure that may be retried (each client decides which)."""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_random_exponential

from broker.errors import EPISODE_TIMEOUT, EpisodeError

log = logging.getLogger(__name__)

T = TypeVar("T")


class Retryable(Exception):
    """Raised inside an attempt: ``error`` is what the caller gets if no retry is left."""

    def __init__(self, error: EpisodeError, *, retry_after: float | None = None):
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


def with_cause(error: EpisodeError, cause: BaseException | None) -> EpisodeError:
    error.__cause__ = cause
    return error


def run_with_retries(
    attempt: Callable[[], T],
    *,
    attempts: int,
    backoff_initial_s: float,
    backoff_max_s: float,
    deadline: float,
    what: str,
    log_target: str,
    logger: logging.Logger = log,
) -> T:
    """Run ``attempt`` until it returns, raises an EpisodeError (final) or runs out of tries.

    ``attempt`` raises :class:`Retryable` for what may be retried. Attempts are capped at
    ``attempts``; a back-off that would pass ``deadline`` ends the call with EPISODE_TIMEOUT.
    """
    attempts = max(1, attempts)

    # Most calls succeed on the first try: make it without building the retry machinery (a
    # Retrying per call cost about a tenth of a request's CPU, docs/benchmarks.md). A first
    # failure is handed to Retrying as its attempt 1, so waits, logs and give-up are unchanged.
    try:
        return attempt()
    except Retryable as exc:
        failed = [exc]

    backoff = wait_random_exponential(multiplier=backoff_initial_s, max=backoff_max_s)

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        hint = getattr(exc, "retry_after", None)
        if hint is not None:
            return min(hint, backoff_max_s)
        return backoff(state)

    def stop(state: RetryCallState) -> bool:
        if state.attempt_number >= attempts:
            return True
        return time.monotonic() + state.upcoming_sleep >= deadline

    def give_up(state: RetryCallState) -> T:
        exc = state.outcome.exception()
        assert isinstance(exc, Retryable)
        if state.attempt_number < attempts:
            raise with_cause(
                EpisodeError(
                    EPISODE_TIMEOUT,
                    f"{what}: no time left in the attempt's budget to retry "
                    f"(after {state.attempt_number} tries; last: {exc.error})",
                ),
                exc.error,
            )
        raise exc.error

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception()
        logger.warning(
            "%s: try %d/%d failed (%s); retrying %s in %.2fs",
            what, state.attempt_number, attempts, exc, log_target, state.upcoming_sleep,
        )

    def replay() -> T:
        if failed:
            raise failed.pop()
        return attempt()

    retrying = Retrying(
        stop=stop,
        wait=wait,
        retry=retry_if_exception_type(Retryable),
        before_sleep=before_sleep,
        retry_error_callback=give_up,
    )
    return retrying(replay)
