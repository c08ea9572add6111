"""HTTP client for environment servers (PROTOCOL.md section 1), shared by the threads of a worker.

Every call takes ``deadline``, an absolute ``time.monotonic()`` value: the attempt's wall-clock
budget. Each request uses ``timeout=(min(connect, remaining), min(read, remaining))``; when no
time is left before a request, or a retry's back-off sleep would pass the deadline, the call
raises ``EpisodeError(EPISODE_TIMEOUT)``. A client never sleeps past the deadline.

Retry rule (a contract; the step loop relies on it)
---------------------------------------------------
* ``reset`` and ``close`` are safe to repeat (``reset`` re-creates the instance from scratch,
  ``close`` of a closed instance is a no-op), so they are retried on connection errors,
  timeouts and 5xx answers.
* ``get_task_prompt`` and ``step`` are NOT idempotent (some environments append a turn on every
  call), so they are retried only when the request provably never reached the server: the
  connection could not be established (connection refused, DNS failure, connect timeout;
  i.e. ``requests.exceptions.ConnectTimeout``, or a ``ConnectionError`` caused by urllib3's
  ``NewConnectionError``/``NameResolutionError``). After a 5xx, a read timeout or a connection
  dropped mid-request they raise at once (a transient ``EpisodeError``); the episode is then
  restarted from a fresh ``reset`` in a new attempt instead of replaying an action.
* Retries: at most ``1 + settings.env_retries`` attempts, capped exponential back-off with full
  jitter (``wait_random_exponential(env_backoff_initial_s, env_backoff_max_s)``).
* ``close`` is best effort: its own short budget (``CLOSE_BUDGET_S``), then a logged warning;
  it never raises.

Errors (reason codes from :mod:`broker.errors`)
-----------------------------------------------
* 4xx on ``reset``: ``ENV_BAD_REQUEST`` (permanent, with the server's error text, truncated);
* 404 on ``get_task_prompt``/``step``: ``ENV_INSTANCE_LOST``; other 4xx there: ``ENV_BAD_REQUEST``;
* 5xx: ``ENV_SERVER_ERROR``; connection errors and timeouts: ``ENV_UNREACHABLE`` (transient);
* a body that is not JSON, has the wrong shape, or is larger than
  ``settings.max_response_bytes``: ``ENV_MALFORMED`` (permanent).

This module also holds the small HTTP helpers that :mod:`workers.modelclient` shares (session
set-up, capped body reads, deadline arithmetic, retry plumbing).
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar
from urllib.parse import quote

import requests
from requests.adapters import HTTPAdapter
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_random_exponential
from urllib3.exceptions import MaxRetryError, NewConnectionError

try:  # urllib3 >= 2 (a subclass of NewConnectionError there; listed for clarity)
    from urllib3.exceptions import NameResolutionError
except ImportError:  # pragma: no cover
    NameResolutionError = NewConnectionError  # type: ignore[misc,assignment]

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_INSTANCE_LOST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EPISODE_TIMEOUT,
    EpisodeError,
)
from broker.settings import Settings, redact_url

log = logging.getLogger(__name__)

T = TypeVar("T")

ERROR_TEXT_CHARS = 300  # server error text quoted in messages, at most
ERROR_BODY_READ_BYTES = 64 * 1024  # read at most this much of a non-2xx body
CLOSE_BUDGET_S = 10.0  # close's own overall budget
CLOSE_MIN_BUDGET_S = 2.0  # close still gets this long when the episode's deadline has passed
READY_TIMEOUT_S = 5.0
_DEADLINE_SLACK_S = 0.005


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by workers.modelclient)
# --------------------------------------------------------------------------------------------


def make_session(settings: Settings, pool_size: int | None = None) -> requests.Session:
    """A Session with a pool large enough for every thread of the worker and no urllib3
    retries (retries are decided by the clients, per call, through tenacity).

    ``trust_env`` is off: with it on, requests re-reads the proxy variables and ~/.netrc on
    every request, which doubled a worker's CPU per call (docs/benchmarks.md). The proxy
    variables still apply, resolved once per origin (:func:`proxies_for`), and a CA bundle
    named by REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE is used as before.
    """
    session = requests.Session()
    session.trust_env = False
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    size = pool_size or max(10, settings.concurrency * 2)
    adapter = HTTPAdapter(pool_connections=32, pool_maxsize=size, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


_proxies: dict[str, dict[str, str]] = {}


def proxies_for(url: str) -> dict[str, str]:
    """HTTP(S)_PROXY / NO_PROXY for ``url``'s origin, looked up once per origin."""
    end = url.find("/", url.find("//") + 2)
    origin = url if end < 0 else url[:end]
    found = _proxies.get(origin)
    if found is None:
        found = _proxies[origin] = requests.utils.get_environ_proxies(origin)
    return found


def remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def timeouts(deadline: float, connect_s: float, read_s: float, *, what: str) -> tuple[float, float]:
    """``(connect, read)`` timeouts for one request, or EPISODE_TIMEOUT when no time is left."""
    left = remaining(deadline)
    if left <= 0:
        raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out")
    return (min(connect_s, left), min(read_s, left))


def deadline_passed(deadline: float) -> bool:
    return remaining(deadline) <= _DEADLINE_SLACK_S


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


def send(
    session: requests.Session,
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
    message). Transport errors propagate as ``requests`` exceptions."""
    started = time.monotonic()
    hdrs = dict(headers or {})
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    with session.request(method, url, data=body, headers=hdrs, timeout=timeout, stream=True,
                         proxies=proxies_for(url)) as resp:
        ok = 200 <= resp.status_code < 300
        cap = max_bytes if ok else min(max_bytes, ERROR_BODY_READ_BYTES)
        if ok:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
                raise TooLarge(f"{declared} bytes declared")
        chunks: list[bytes] = []
        size = 0
        for chunk in resp.iter_content(chunk_size=64 * 1024):
            if deadline_passed(deadline):
                raise EpisodeError(EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out while reading the answer")
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                if ok:
                    raise TooLarge(f"more than {max_bytes} bytes")
                break
        data = b"".join(chunks)[:cap]
        return Reply(resp.status_code, resp.headers, data, time.monotonic() - started)


def parse_json(data: bytes) -> Any:
    """JSON or ValueError (also for invalid UTF-8 and absurd nesting)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def error_text(reply: Reply, *, scrub: str = "") -> str:
    """The server's error message, short: JSON ``error``/``detail``/``message`` or raw text."""
    text = reply.body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        for key in ("error", "detail", "message"):
            if key in obj:
                val = obj[key]
                if isinstance(val, dict) and "message" in val:
                    val = val["message"]
                text = val if isinstance(val, str) else json.dumps(val, default=str)
                break
    text = " ".join(text.split())
    if scrub:
        text = text.replace(scrub, "***")
    if len(text) > ERROR_TEXT_CHARS:
        text = text[:ERROR_TEXT_CHARS] + "..."
    return text or "<empty body>"


def never_reached_server(exc: BaseException) -> bool:
    """True only when the connection could not be established, so the request was not sent."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    if isinstance(exc, requests.exceptions.ConnectionError) and not isinstance(
        exc, (requests.exceptions.ProxyError, requests.exceptions.SSLError)
    ):
        cause: Any = exc.args[0] if exc.args else None
        if isinstance(cause, MaxRetryError):
            cause = cause.reason
        return isinstance(cause, (NewConnectionError, NameResolutionError))
    return False


def is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, requests.exceptions.Timeout):
        return True
    # A read timeout while streaming the body surfaces as ConnectionError(ReadTimeoutError).
    from urllib3.exceptions import ReadTimeoutError

    cause = exc.args[0] if isinstance(exc, requests.exceptions.ConnectionError) and exc.args else None
    return isinstance(cause, ReadTimeoutError)


def describe(exc: BaseException) -> str:
    """A short, key-free description of a transport error."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "connect timeout"
    if is_timeout(exc):
        return "read timeout"
    if never_reached_server(exc):
        cause: Any = exc.args[0] if exc.args else None
        if isinstance(cause, MaxRetryError):
            cause = cause.reason
        if isinstance(cause, NameResolutionError) and NameResolutionError is not NewConnectionError:
            return "name resolution failed"
        return "connection refused or unreachable"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "connection dropped while reading the answer"
    if isinstance(exc, requests.exceptions.ConnectionError):
        return "connection dropped or reset"
    return type(exc).__name__


def retry_after_s(headers: Mapping[str, str], cap: float) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or HTTP date), capped; None if absent/bad."""
    raw = headers.get("Retry-After") if headers is not None else None
    if not raw:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        value = when.timestamp() - time.time()
    if math.isnan(value):
        return None
    return max(0.0, min(value, cap))


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

    # Most calls succeed on the first try: make it without building the retry machinery (a
    # Retrying per call cost about a tenth of a request's CPU, docs/benchmarks.md). A first
    # failure is handed to Retrying as its attempt 1, so waits, logs and give-up are unchanged.
    try:
        return attempt()
    except Retryable as exc:
        failed = [exc]

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


# --------------------------------------------------------------------------------------------
# The environment client
# --------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    reward: float
    terminated: bool
    truncated: bool
    info: dict | None


def _bool_like(value: Any) -> bool | None:
    """True/False for bool, 0/1, "true"/"false" (and null/absent -> False); None if not bool-like."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1"):
        return value.strip().lower() in ("true", "1")
    return None


# Validation of decoded answers, shared by the HTTP client and the inproc transport
# (workers/inproc.py), so that a malformed answer fails with the same reason either way.


def check_reset_answer(obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not an object")
    return obj


def check_prompt_answer(obj: Any, what: str) -> list:
    if not isinstance(obj, list):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not a list of messages")
    for i, msg in enumerate(obj):
        if not isinstance(msg, dict):
            raise EpisodeError(ENV_MALFORMED, f"{what}: message {i} is a {type(msg).__name__}, not an object")
        if not isinstance(msg.get("role"), str) or "content" not in msg:
            raise EpisodeError(ENV_MALFORMED, f"{what}: message {i} lacks a string 'role' or a 'content'")
        if not isinstance(msg["content"], (str, list, type(None))):
            raise EpisodeError(
                ENV_MALFORMED, f"{what}: message {i} content is a {type(msg['content']).__name__}, not a string or list"
            )
    return obj


def check_step_answer(obj: Any, what: str) -> StepResult:
    if not isinstance(obj, dict):
        raise EpisodeError(ENV_MALFORMED, f"{what}: answer is a JSON {type(obj).__name__}, not an object")
    reward = obj.get("reward")
    if reward is None:
        reward = 0.0
    elif isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EpisodeError(ENV_MALFORMED, f"{what}: reward is not a finite number or null ({type(reward).__name__})")
    flags = {}
    for name in ("terminated", "truncated"):
        flag = _bool_like(obj.get(name))
        if flag is None:
            raise EpisodeError(ENV_MALFORMED, f"{what}: {name} is not a boolean ({type(obj.get(name)).__name__})")
        flags[name] = flag
    info = obj.get("info")
    return StepResult(
        reward=float(reward),
        terminated=flags["terminated"],
        truncated=flags["truncated"],
        info=info if isinstance(info, dict) else None,
    )


class EnvClient:
    """Calls environment servers. One instance per worker process, shared by its threads."""

    def __init__(self, settings: Settings, *, session: requests.Session | None = None):
        self.settings = settings
        self.session = session or make_session(settings)

    def shutdown(self) -> None:
        """Close the connection pool (``close`` is the environment call)."""
        self.session.close()

    def __repr__(self) -> str:
        return "EnvClient()"

    # ---- the protocol calls ------------------------------------------------------------

    def reset(
        self, base_url: str, env_name: str, env_id: str, env_params: Any, seed: int | None, *, deadline: float
    ) -> dict:
        what = f"reset {env_name}/{env_id}"
        body = self._encode({"env_param": env_params, "seed": seed}, what)
        reply = self._call(
            "POST", self._url(base_url, env_name, env_id, "reset"), what=what, deadline=deadline,
            body=body, idempotent=True, not_found=ENV_BAD_REQUEST,
        )
        return check_reset_answer(self._json(reply, what), what)

    def get_task_prompt(self, base_url: str, env_name: str, env_id: str, *, deadline: float) -> list:
        what = f"get_task_prompt {env_name}/{env_id}"
        reply = self._call(
            "GET", self._url(base_url, env_name, env_id, "get_task_prompt"), what=what, deadline=deadline,
            idempotent=False, not_found=ENV_INSTANCE_LOST,
        )
        return check_prompt_answer(self._json(reply, what), what)

    def step(self, base_url: str, env_name: str, env_id: str, action: str, *, deadline: float) -> StepResult:
        what = f"step {env_name}/{env_id}"
        body = self._encode({"action": action}, what)
        reply = self._call(
            "POST", self._url(base_url, env_name, env_id, "step"), what=what, deadline=deadline,
            body=body, idempotent=False, not_found=ENV_INSTANCE_LOST,
        )
        return check_step_answer(self._json(reply, what), what)

    def close(self, base_url: str, env_name: str, env_id: str, *, deadline: float | None = None) -> None:
        """Best effort: DELETE the instance (POST .../close on servers that answer 404/405).
        Own budget ``CLOSE_BUDGET_S``, capped by ``deadline`` but never below
        ``CLOSE_MIN_BUDGET_S`` (an episode that ran out of time still releases its instance).
        Never raises."""
        what = f"close {env_name}/{env_id}"
        now = time.monotonic()
        budget_end = now + CLOSE_BUDGET_S
        if deadline is not None:
            budget_end = min(budget_end, max(deadline, now + CLOSE_MIN_BUDGET_S))
        url = self._url(base_url, env_name, env_id)
        try:
            reply = self._call("DELETE", url, what=what, deadline=budget_end, idempotent=True, raise_4xx=False)
            if reply.status in (404, 405):
                reply = self._call(
                    "POST", url + "/close", what=what + " (POST fallback)", deadline=budget_end,
                    idempotent=True, raise_4xx=False,
                )
                if reply.status == 404:
                    log.debug("%s: unknown to the server (already gone)", what)
                    return
            if not reply.ok:
                log.warning("%s at %s: HTTP %d: %s", what, redact_url(base_url), reply.status, error_text(reply))
        except EpisodeError as exc:
            log.warning("%s at %s failed, instance may linger: %s", what, redact_url(base_url), exc)
        except Exception as exc:  # never raise from close
            log.warning("%s at %s failed unexpectedly: %s", what, redact_url(base_url), type(exc).__name__, exc_info=True)

    def ready(self, base_url: str, timeout: float = READY_TIMEOUT_S) -> bool:
        """True when ``GET {base_url}/envs`` answers 2xx within ``timeout``. Never raises."""
        try:
            with self.session.get(f"{base_url.rstrip('/')}/envs", timeout=(timeout, timeout), stream=True) as resp:
                return 200 <= resp.status_code < 300
        except Exception:
            return False

    # ---- plumbing -----------------------------------------------------------------------

    @staticmethod
    def _url(base_url: str, env_name: str, env_id: str, call: str | None = None) -> str:
        url = f"{base_url.rstrip('/')}/{quote(str(env_name), safe='')}/{quote(str(env_id), safe='')}"
        return f"{url}/{call}" if call else url

    @staticmethod
    def _encode(obj: Any, what: str) -> bytes:
        try:
            return json.dumps(obj).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: request body is not JSON-serialisable ({exc})") from None

    @staticmethod
    def _json(reply: Reply, what: str) -> Any:
        try:
            return parse_json(reply.body)
        except ValueError:
            raise EpisodeError(ENV_MALFORMED, f"{what}: answer is not JSON ({len(reply.body)} bytes)") from None

    def _call(
        self,
        method: str,
        url: str,
        *,
        what: str,
        deadline: float,
        idempotent: bool,
        body: bytes | None = None,
        not_found: str = ENV_BAD_REQUEST,
        raise_4xx: bool = True,
    ) -> Reply:
        s = self.settings
        shown = redact_url(url)

        def attempt() -> Reply:
            timeout = timeouts(deadline, s.env_connect_timeout_s, s.env_read_timeout_s, what=what)
            try:
                reply = send(
                    self.session, method, url, deadline=deadline, timeout=timeout,
                    max_bytes=s.max_response_bytes, what=what, body=body,
                )
            except TooLarge as exc:
                raise EpisodeError(
                    ENV_MALFORMED, f"{what}: answer larger than max_response_bytes={s.max_response_bytes} ({exc})"
                ) from None
            except requests.exceptions.RequestException as exc:
                if is_timeout(exc) and deadline_passed(deadline):
                    raise EpisodeError(
                        EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out waiting for {shown}"
                    ) from exc
                error = with_cause(EpisodeError(ENV_UNREACHABLE, f"{what}: {describe(exc)} ({shown})"), exc)
                if idempotent or never_reached_server(exc):
                    raise Retryable(error) from exc
                raise error
            if reply.ok:
                return reply
            if reply.status >= 500:
                error = EpisodeError(ENV_SERVER_ERROR, f"{what}: HTTP {reply.status}: {error_text(reply)}")
                if idempotent:
                    raise Retryable(error)
                raise error
            if not raise_4xx:
                return reply
            reason = not_found if reply.status == 404 else ENV_BAD_REQUEST
            raise EpisodeError(reason, f"{what}: HTTP {reply.status}: {error_text(reply)}")

        return run_with_retries(
            attempt,
            attempts=1 + max(0, s.env_retries),
            backoff_initial_s=s.env_backoff_initial_s,
            backoff_max_s=s.env_backoff_max_s,
            deadline=deadline,
            what=what,
            log_target=shown,
        )
