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
STEPS_LOST = "steps_lost"  # completed, but some step records never reached the database (set by the consumer)
# An agent episode's agent (workers/agent_episode.py) raised, exited non-zero, returned no
# reward, or ran past --agent-timeout: a fresh attempt (a fresh agent run) may do better.
AGENT_ERROR = "agent_error"
AGENT_TIMEOUT = "agent_timeout"
# Not a failure: the job was cancelled (`interactor cancel`, broker/cancel.py). The reason of a
# cancelled episode and of the attempt stopped by it, and the incomplete_reason of its group.
CANCELLED = "cancelled"
# Not a failure: a completed episode was run again (`interactor job JOB rerun`, broker/rerun.py).
# The superseded_reason of its earlier trajectory, and the reason of its row until the rerun ends.
RERUN = "rerun"

# Outages: a server was down for longer than INTERACTOR_OUTAGE_BUDGET_S. While a server is down
# its episodes wait (workers/breakers.py); only an outage past the budget ends an episode, and
# the reason says which server it was.
ENV_OUTAGE = "env_outage"
MODEL_OUTAGE = "model_outage"
BROKER_OUTAGE = "broker_outage"  # Redis

# Permanent: the same request will fail the same way.
ENV_BAD_REQUEST = "env_bad_request"  # 4xx on reset: unknown env_name or bad params
ENV_MALFORMED = "env_malformed"  # not JSON, wrong types, missing fields, too large
MODEL_BAD_REQUEST = "model_bad_request"  # 4xx other than 429 (a malformed request, a bad parameter);
# a prompt longer than the model's context is not one: see ContextOverflow below
MODEL_MALFORMED = "model_malformed"  # not JSON, no choices, wrong types
EPISODE_TIMEOUT = "episode_timeout"  # the attempt's wall-clock budget ran out
BAD_TASK = "bad_task"  # the episode spec could not be read, or names what this worker may not run
INTERNAL_ERROR = "internal_error"  # a bug of ours; parked so that it can be re-driven
ATTEMPTS_EXHAUSTED = "attempts_exhausted"  # prefix use: "attempts_exhausted:<last reason>"

TRANSIENT_REASONS = frozenset(
    {ENV_UNREACHABLE, ENV_SERVER_ERROR, ENV_INSTANCE_LOST, MODEL_UNAVAILABLE, LEASE_LOST, WORKER_LOST, WORKER_SHUTDOWN,
     STEPS_LOST, AGENT_ERROR, AGENT_TIMEOUT}
)


# What `--retry-on` names (a job's JobSpec.retry_on): classes of the reasons above. A job that
# names classes retries only the failures of those classes (up to max_attempts) and dead-letters
# any other failure on its first attempt; a job that names none retries the transient reasons
# (TRANSIENT_REASONS), as before the option. docs/protocol.md#failures-and-attempts has the table.
RETRY_CLASSES: dict[str, frozenset[str]] = {
    "env_outage": frozenset({ENV_UNREACHABLE, ENV_SERVER_ERROR, ENV_INSTANCE_LOST}),
    "model_timeout": frozenset({MODEL_UNAVAILABLE}),
    "worker_lost": frozenset({WORKER_LOST, STEPS_LOST}),
    "agent_failure": frozenset({AGENT_ERROR, AGENT_TIMEOUT}),
    "malformed_answer": frozenset({MODEL_MALFORMED, ENV_MALFORMED}),
}
# A shorthand: the failures of the infrastructure, none of the model's or the agent's answers.
RETRY_ALIASES: dict[str, tuple[str, ...]] = {"infra": ("env_outage", "model_timeout", "worker_lost")}
# Never the episode's failure, so never subject to --retry-on: a hand-back, a lost lease, a
# cancel, Redis away (the close policy handles them as before).
NOT_FAILURES = frozenset({WORKER_SHUTDOWN, LEASE_LOST, CANCELLED, BROKER_OUTAGE})


def retry_class(reason: str) -> str:
    """The --retry-on class of a reason code ("": none)."""
    return next((name for name, reasons in RETRY_CLASSES.items() if reason in reasons), "")


def parse_retry_on(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """``--retry-on env_outage,model_timeout`` (or ``infra``) as the sorted list of class names
    a JobSpec keeps; "" is []: every transient reason, as without the option. Raises
    ValueError naming the classes there are."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out: set[str] = set()
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part in RETRY_ALIASES:
            out.update(RETRY_ALIASES[part])
        elif part in RETRY_CLASSES:
            out.add(part)
        else:
            raise ValueError(f"unknown --retry-on class {part!r}: one of "
                             + ", ".join([*RETRY_CLASSES, *RETRY_ALIASES]))
    return sorted(out)


def retryable(reason: str, transient: bool, retry_on: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether a failure with ``reason`` may be retried under a job's ``retry_on`` (its classes;
    empty: ``transient`` decides, as before the option)."""
    if not retry_on or reason in NOT_FAILURES:
        return transient
    return any(reason in RETRY_CLASSES.get(name, ()) for name in retry_on)


class EpisodeError(Exception):
    """An attempt cannot go on. ``reason`` is one of the codes above.

    ``status``: the HTTP status that caused it, if any. ``maybe_applied``: False when the
    request provably never reached the server (so repeating it cannot apply it twice).
    ``outage``: the failure looks like the server being down (refused, reset, timed out,
    502/503/504/429), not like a problem with this episode; the caller may wait for the server
    instead of failing the episode (workers/breakers.py)."""

    def __init__(self, reason: str, message: str, *, transient: bool | None = None, status: int | None = None,
                 maybe_applied: bool = True, outage: bool = False):
        super().__init__(message)
        self.reason = reason
        self.transient = reason in TRANSIENT_REASONS if transient is None else transient
        self.status = status
        self.maybe_applied = maybe_applied
        self.outage = outage

    def __str__(self) -> str:
        return f"{self.reason}: {self.args[0]}"


class ContextOverflow(EpisodeError):
    """The model server refused the prompt as longer than the model's context window (each
    server says so in its own words: workers/modelclient.py ``context_overflow``).

    Not the attempt's failure: a prompt that outgrew the context is how a long episode with the
    full history in every prompt ends, so the step loop catches this and ends the episode
    truncated (``ended_by = "context_length"``, workers/loop.py). Should it escape anywhere
    else, it is what it was before it had a name of its own: a permanent ``model_bad_request``
    with the server's text. ``server``: whose wording was recognised."""

    def __init__(self, message: str, *, server: str, status: int | None = None):
        super().__init__(MODEL_BAD_REQUEST, message, transient=False, status=status)
        self.server = server
