"""HTTP client for environment servers (docs/protocol.md#environment-server), shared by the threads of a worker.

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
* A ``reset`` that hands the env the model gateway (``llm``: an env-driven episode,
  workers/env_driven.py) is not idempotent either: the env may have called the model before it
  failed, so it is retried as ``step`` is, only when the request never reached the server.
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

The HTTP plumbing: connections and the urllib3 shortcut of the per-step calls in
:mod:`workers.http_transport`, the watchdog in :mod:`workers.http_watchdog`, error texts and
classification in :mod:`workers.http_errors`, retries in :mod:`workers.retries`; the answer
types and their checks beside the env port (:mod:`workers.envport`).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import quote

import requests

from broker.errors import (
    ENV_BAD_REQUEST,
    ENV_INSTANCE_LOST,
    ENV_MALFORMED,
    ENV_SERVER_ERROR,
    ENV_UNREACHABLE,
    EPISODE_TIMEOUT,
    EpisodeError,
)
from broker.settings import redact_url
from broker.states import EnvProtocol
from workers.deadlines import deadline_passed, timeouts
from workers.envport import (
    CLOSE_BUDGET_S,
    CLOSE_MIN_BUDGET_S,
    StepResult,
    check_prompt_answer,
    check_reset_answer,
    check_step_answer,
)
from workers.http_errors import (
    describe,
    error_signature,
    error_text,
    full_error_text,
    is_timeout,
    never_reached_server,
    shorten,
)
from workers.http_transport import PooledClient, Reply, TooLarge, dumps, parse_json, send
from workers.retries import Retryable, run_with_retries, with_cause

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 5.0

# --------------------------------------------------------------------------------------------
# The environment client
# --------------------------------------------------------------------------------------------


class EnvClient(PooledClient):
    """Calls environment servers. One instance per worker process, shared by its threads."""

    # ---- the protocol calls ------------------------------------------------------------

    def reset(
        self, base_url: str, env_name: str, env_id: str, env_params: Any, seed: int | None, *, deadline: float,
        llm: dict | None = None, read_timeout_s: float | None = None,
    ) -> dict:
        """``llm`` (an env-driven episode's, workers/env_driven.py): the gateway's
        ``{"base_url", "api_key", "model"}``, sent in the body beside ``env_param`` and ``seed``.
        Such a reset is not repeated once it may have reached the server (the env may have
        called the model before it failed: a second reset would record a second rollout in the
        attempt), and its key is starred out of any error text the server echoes it in."""
        what = f"reset {env_name}/{env_id}"
        payload = {"env_param": env_params, "seed": seed}
        if llm is not None:
            payload["llm"] = llm
        body = self._encode(payload, what)
        reply = self._call(
            "POST", self._url(base_url, env_name, env_id, "reset"), what=what, deadline=deadline,
            body=body, idempotent=llm is None, not_found=ENV_BAD_REQUEST, read_timeout_s=read_timeout_s,
            scrub=(llm or {}).get("api_key", ""),
        )
        return check_reset_answer(self._json(reply, what), what)

    def get_task_prompt(self, base_url: str, env_name: str, env_id: str, *, deadline: float) -> list | dict:
        what = f"get_task_prompt {env_name}/{env_id}"
        reply = self._call(
            "GET", self._url(base_url, env_name, env_id, "get_task_prompt"), what=what, deadline=deadline,
            idempotent=False, not_found=ENV_INSTANCE_LOST,
        )
        return check_prompt_answer(self._json(reply, what), what)

    def step(self, base_url: str, env_name: str, env_id: str, action: str, *, deadline: float,
             tool_calls: list | None = None, read_timeout_s: float | None = None, scrub: str = "") -> StepResult:
        """``read_timeout_s`` (None: ``env_read_timeout_s``) and ``scrub`` (a secret starred out
        of error texts): an env-driven episode's, whose env may run its rollout in a step."""
        what = f"step {env_name}/{env_id}"
        # the model's tool calls beside the text, when the prompt offered tools and it made some
        body = self._encode({"action": action, "tool_calls": tool_calls} if tool_calls else {"action": action}, what)
        reply = self._call(
            "POST", self._url(base_url, env_name, env_id, "step"), what=what, deadline=deadline,
            body=body, idempotent=False, not_found=ENV_INSTANCE_LOST, read_timeout_s=read_timeout_s, scrub=scrub,
        )
        return check_step_answer(self._json(reply, what), what)

    def close(self, base_url: str, env_name: str, env_id: str, *, deadline: float | None = None,
              protocol: str = "") -> None:
        """Best effort: DELETE the instance (POST .../close on servers that answer 404/405); an
        ORS session is deleted by ``POST /delete`` with its ``X-Session-ID``, and an OpenEnv
        session needs nothing (it ends with its WebSocket). Own budget ``CLOSE_BUDGET_S``,
        capped by ``deadline`` but never below ``CLOSE_MIN_BUDGET_S`` (an episode that ran out
        of time still releases its instance). Never raises."""
        what = f"close {env_name}/{env_id}"
        now = time.monotonic()
        budget_end = now + CLOSE_BUDGET_S
        if deadline is not None:
            budget_end = min(budget_end, max(deadline, now + CLOSE_MIN_BUDGET_S))
        if protocol == EnvProtocol.OPENENV:
            return
        url = self._url(base_url, env_name, env_id)
        try:
            if protocol == EnvProtocol.ORS:
                reply = self._call("POST", f"{base_url.rstrip('/')}/delete", what=what, deadline=budget_end,
                                   idempotent=True, raise_4xx=False, headers={"X-Session-ID": env_id})
                if not reply.ok:
                    log.warning("%s at %s: HTTP %d: %s", what, redact_url(base_url), reply.status, error_text(reply))
                return
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
            return dumps(obj)
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
        headers: dict[str, str] | None = None,
        read_timeout_s: float | None = None,
        scrub: str = "",
    ) -> Reply:
        s = self.settings
        read_s = s.env_read_timeout_s if read_timeout_s is None else read_timeout_s
        shown = redact_url(url)
        app_errors: list[str] = []  # signatures of the 5xx answers that came from the env itself

        def attempt() -> Reply:
            timeout = timeouts(deadline, s.env_connect_timeout_s, read_s, what=what)
            try:
                reply = send(
                    self.http, method, url, deadline=deadline, timeout=timeout,
                    max_bytes=s.max_response_bytes, what=what, body=body, headers=headers,
                )
            except TooLarge as exc:
                raise EpisodeError(
                    ENV_MALFORMED, f"{what}: answer larger than max_response_bytes={s.max_response_bytes} ({exc})"
                ) from None
            except requests.exceptions.RequestException as exc:
                if deadline_passed(deadline) and is_timeout(exc):
                    raise EpisodeError(
                        EPISODE_TIMEOUT, f"{what}: the attempt's time budget ran out waiting for {shown}"
                    ) from exc
                unsent = never_reached_server(exc)
                error = with_cause(EpisodeError(ENV_UNREACHABLE, f"{what}: {describe(exc)} ({shown})",
                                                maybe_applied=not unsent, outage=True), exc)
                if idempotent or unsent:
                    raise Retryable(error) from exc
                raise error
            if reply.ok:
                return reply
            status = reply.status
            if status in _UNAVAILABLE:
                # The server (or a proxy in front of it) says it is not serving now: an outage,
                # and 429/503 mean the request was not processed.
                error = EpisodeError(ENV_SERVER_ERROR, f"{what}: HTTP {status}: {error_text(reply, scrub=scrub)}",
                                     status=status,
                                     maybe_applied=status not in _NOT_PROCESSED, outage=True)
                if idempotent or status in _NOT_PROCESSED:
                    raise Retryable(error)
                raise error
            if status >= 500:
                full = full_error_text(reply, scrub=scrub)
                text = shorten(full) or "<empty body>"
                # Compared with what differs between tries masked (process ids, actor ids,
                # addresses, times): a server that builds each instance in a new process, as the
                # original system's does, names that process in every error.
                signature = error_signature(full)
                if idempotent and method == "POST" and app_errors and app_errors[-1] == signature:
                    # reset failing twice with the same error from the env itself is the task's
                    # parameters, not a flaky server: say so now instead of retrying for a minute.
                    raise EpisodeError(ENV_BAD_REQUEST, f"{what}: HTTP {status} twice with the same error from the "
                                                        f"env (bad parameters for this task?): {text}",
                                       transient=False, status=status)
                app_errors.append(signature)
                error = EpisodeError(ENV_SERVER_ERROR, f"{what}: HTTP {status}: {text}", status=status)
                if idempotent:
                    raise Retryable(error)
                raise error
            if not raise_4xx:
                return reply
            reason = not_found if status == 404 else ENV_BAD_REQUEST
            raise EpisodeError(reason, f"{what}: HTTP {status}: {error_text(reply, scrub=scrub)}", status=status)

        return run_with_retries(
            attempt,
            attempts=1 + max(0, s.env_retries),
            backoff_initial_s=s.env_backoff_initial_s,
            backoff_max_s=s.env_backoff_max_s,
            deadline=deadline,
            what=what,
            log_target=shown,
        )


_UNAVAILABLE = frozenset({429, 502, 503, 504})
_NOT_PROCESSED = frozenset({429, 503})
