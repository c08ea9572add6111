"""One settings object for every role, read from the environment and then from flags.

Every field maps to an environment variable ``INTERACTOR_<FIELD>`` (upper case); ``REDIS_URL``
and ``OPENAI_API_KEY`` are also honoured because users already have them set. Secrets are
held in :class:`Secret` so that they never show up in ``repr``, logs or task payloads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from broker.tokens import TOKEN_MODES, TOKENS_AUTO
from broker.urls import origin_of as _origin_of, url_problem

ENV_PREFIX = "INTERACTOR_"


class Secret(str):
    """A string that never prints itself (repr, str formatting in logs)."""

    def __repr__(self) -> str:
        return "Secret('***')" if self else "Secret('')"

    def reveal(self) -> str:
        return str.__str__(self)


# Query (and fragment) parameters whose values are secrets: passwords, tokens, API keys, OAuth
# codes, signed-URL signatures and credentials.
_SECRET_QUERY_RE = re.compile(
    r"(?i)((?:^|[&;])[^=&;]*(?:password|passwd|pwd|token|secret|key|auth|code|sig|credential|session)[^=&;]*=)"
    r"[^&;]*")


def redact_url(url: str) -> str:
    """``redis://:pw@host/0`` -> ``redis://:***@host/0``, ``https://TOKEN@host`` ->
    ``https://***@host``, ``...?password=pw`` -> ``...?password=***``: URLs are logged and
    stored, secrets are not. A username alone is hidden too: it is often a token."""
    if "@" not in url and "?" not in url and "#" not in url:  # nothing to hide (the common case)
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            netloc = f"{user}:***@{host}"
        else:
            netloc = f"***@{host}"
    query = _SECRET_QUERY_RE.sub(r"\1***", parts.query) if parts.query else parts.query
    fragment = _SECRET_QUERY_RE.sub(r"\1***", parts.fragment) if parts.fragment else parts.fragment
    if netloc == parts.netloc and query == parts.query and fragment == parts.fragment:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def origin_of(url: str) -> str:
    """``scheme://host:port`` of a URL that broker.urls accepts (lower case, default port
    explicit), else "": a URL the connecting client could read differently has no origin."""
    return _origin_of(url)


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    # --- where things live -------------------------------------------------------------
    redis_url: str = ""  # empty: `interactor run` starts an embedded Redis
    redis_tls_ca: str = ""  # CA file for rediss:// URLs (default: the system's trust store)
    key_prefix: str = "ix"  # every Redis key this system writes starts with it
    queue: str = "episodes"  # Celery queue that episode tasks go to by default
    queues: str = ""  # comma-separated queues a worker serves ("" = the default queue)
    run_dir: str = "runs"  # embedded Redis data, results database, exports
    db_path: str = ""  # SQLite results file; default <run_dir>/results.sqlite
    store_url: str = ""  # results store: postgresql://... (or a SQLite path); default the SQLite file

    # --- policy (model endpoint); the key never leaves the worker ----------------------
    llm_base_url: str = "http://127.0.0.1:8000/v1"
    llm_api_key: Secret = Secret("")
    model: str = "stand-in"
    temperature: float = 0.3
    llm_connect_timeout_s: float = 10.0
    llm_read_timeout_s: float = 600.0
    llm_retries: int = 6  # extra tries after the first, for 429/5xx/connection/timeout
    llm_backoff_initial_s: float = 1.0
    llm_backoff_max_s: float = 30.0
    llm_session_routing: bool = False  # base URL becomes {llm_base_url}/{episode_id}
    llm_params: str = ""  # JSON object merged into every request body: max_tokens, top_p, stop, ...
    # Convenience fields, merged into llm_params (and winning over the same keys there):
    llm_max_tokens: int = 0  # > 0: "max_tokens" (--max-tokens)
    llm_top_p: float = 0.0  # > 0: "top_p" (--top-p)
    llm_stop: str = ""  # "stop": one stop string, or a JSON list of strings (--stop)
    llm_max_concurrency: int = 0  # model requests in flight per worker process; 0 = up to `concurrency`
    llm_max_connections: int = 0  # kept-alive connections to the model per worker process; 0 = auto
    llm_startup_jitter_s: float = 0.0  # each of a worker's first `concurrency` episodes waits U(0, this)
    # Ask the model server for token ids and logprobs (broker/tokens.py TOKEN_MODES: "" off,
    # "auto", or the server's name; "1"/"true" = auto). A task file's "tokens" key when unset.
    tokens: str = ""

    # --- environment servers -----------------------------------------------------------
    env_base_url: str = ""  # default for task entries that name no base_url
    env_connect_timeout_s: float = 5.0
    env_read_timeout_s: float = 120.0
    env_retries: int = 3  # extra tries, for what is safe to retry (see workers/envclient.py)
    env_backoff_initial_s: float = 0.5
    env_backoff_max_s: float = 10.0
    max_response_bytes: int = 32 * 1024 * 1024  # a larger env/model answer is malformed
    # Plain http:// calls (env and model) through the worker's own HTTP/1.1 client
    # (workers/plainhttp.py, a tenth of urllib3's CPU per call); off: urllib3 for every call.
    http_plain_client: bool = True

    # --- the step loop (docs/protocol.md#step-loop) -----------------------------------------
    max_steps: int = 1000
    message_cut: int = 3
    episode_budget_s: float = 3600.0  # wall clock per attempt, enforced by the loop itself
    episode_hook: str = ""  # "module:factory"
    experience_dir: str = ""  # the built-in hook workers.experience:template reads skills from here
    experience_top_k: int = 3  # ... and injects this many, best success rate first

    # --- delivery guarantees -----------------------------------------------------------
    lease_ttl_s: float = 30.0  # a dead worker's episode is re-run at most ~this + sweep later
    sweep_interval_s: float = 5.0
    reconcile_interval_s: float = 30.0  # how often the sweeper looks for lost messages of quiet jobs
    max_attempts: int = 3
    retry_backoff_initial_s: float = 2.0
    retry_backoff_max_s: float = 60.0
    shutdown_grace_s: float = 30.0  # after SIGTERM, running episodes get this long to finish
    # ... and the process this much longer to exit, or the kernel ends it (SIGALRM): Celery's
    # warm shutdown waits on its broker, forever if Redis is gone for good.
    shutdown_hard_exit_s: float = 60.0
    # A worker process whose Celery consumer takes no task for this long while episodes wait in
    # its queues and it has free slots is replaced (workers/consumer_watch.py); 0 turns it off.
    worker_stall_s: float = 60.0
    # Celery's remote control (`celery inspect`, `control`), off: nothing here uses it, and under
    # the gevent pool its broadcast loop can block for good on a pub/sub socket after a Redis
    # restart, so that a warm shutdown never ends (workers/tasks.py: the kernel ends it at
    # shutdown_grace_s + shutdown_hard_exit_s; a container is killed before that).
    worker_remote_control: bool = False
    # A server that is down (refused, reset, 429/502/503/504 with its readiness route down too)
    # holds its episodes, their budgets paused, for up to this long before they are
    # dead-lettered as env_outage/model_outage (workers/breakers.py). Redis too (broker_outage).
    outage_budget_s: float = 900.0
    job_retention_s: float = 7 * 24 * 3600.0  # finished jobs' Redis keys expire this long after the end

    # --- trust boundaries: what a job (anyone who can write a task) may make workers do ----
    # The API key goes only to the origin of llm_base_url and these (comma-separated
    # scheme://host:port); a job naming another model host gets its calls without the key.
    llm_trusted_origins: str = ""
    # Inproc env classes a worker may import ("module:Class", "module:*", "package.*"), comma-
    # separated; "" = the bundled adapters. Anything else is dead-lettered as bad_task unimported.
    env_classes: str = ""
    # Episode hooks a worker may load, as for env_classes; "" = the built-in hooks and this
    # worker's own episode_hook.
    episode_hooks: str = ""
    # Env servers workers may call (comma-separated host, host:port or scheme://host:port);
    # "" = any. Keeps a job from pointing workers at internal services (SSRF).
    env_hosts: str = ""

    # --- fleet-wide limits (broker/caps.py, broker/pause.py); a task file's own win ----------
    # A job pauses once this many of its episodes in a row failed with the same reason (0 = never).
    pause_after_failures: int = 20
    # Calls in flight across every worker process (0 = no cap): to the job's model endpoint, to
    # each env server it uses; live env instances (reset, not yet closed) per env server.
    llm_fleet_max_concurrency: int = 0
    # Rate limits of the job's model endpoint, fleet-wide (broker/ratelimit.py; 0 = none).
    llm_fleet_rpm: int = 0  # requests per minute
    llm_fleet_tpm: int = 0  # tokens per minute, charged from the answers' usage
    env_fleet_max_concurrency: int = 0
    env_fleet_max_instances: int = 0

    # --- workers -----------------------------------------------------------------------
    concurrency: int = 16  # episodes at once per worker process
    # gevent: an episode is a greenlet; at hundreds of episodes per process it costs about half
    # the CPU per step of OS threads (no GIL hand-offs, fewer syscalls: docs/benchmarks.md).
    # threads remains available (e.g. for C extensions that block without releasing the GIL).
    pool: str = "gevent"

    # --- results stream and consumer ---------------------------------------------------
    stream_backlog_max: int = 100_000  # unacked records above which workers slow down
    consumer_batch: int = 2000  # records per transaction at most (a commit's fixed cost is shared)
    consumer_block_ms: int = 1000
    consumer_claim_idle_ms: int = 30_000
    # Re-runs of one episode whose completed attempt's steps were lost (a Redis failover), after
    # which the consumer fails it as steps_lost instead of re-running it again.
    consumer_reopens_max: int = 3

    # --- the online-RL feed (broker/feed.py, interactor/feedserve.py, feedcmd.py) ----------
    # Groups queued, running or delivered-but-unacknowledged at once; the producer waits beyond.
    feed_max_ahead: int = 64
    # A group whose oldest step is more than this many versions behind the trainer's is not
    # delivered (-1: no bound); feed_stale_policy says what becomes of it.
    feed_max_staleness: int = -1
    feed_stale_policy: str = "requeue"  # requeue (fresh episodes of the same tasks) | drop
    feed_failed_policy: str = "report"  # a group with a dead-lettered member: report | refill
    # refill: a group runs again at most this many times for failed members (a task that fails
    # every time, say its env is gone, would otherwise be re-run without end); then reported.
    feed_refill_max: int = 2
    feed_ack_timeout_s: float = 300.0  # a group taken and not acknowledged this long goes to the next taker
    feed_drop_uniform: bool = False  # drop groups whose rewards are all equal (no learning signal)
    feed_filter: str = ""  # "module:function" called with each group before delivery; False drops it
    # Filters the feed server may import, as episode_hooks ("" = none but feed_filter itself).
    feed_filters: str = ""
    feed_host: str = "127.0.0.1"
    feed_port: int = 8700
    feed_token: Secret = Secret("")  # required when feed_host is not loopback
    # Folders (comma-separated) whose task files and datasets POST /start_rollout may name; ""
    # = the feed server's working directory. Its own inline task files (run_dir/rollouts) are
    # always allowed. Paths given on the command line are not bounded.
    feed_task_roots: str = ""

    def __post_init__(self) -> None:
        if str(self.tokens).lower() in ("1", "true", "yes", "on"):  # --tokens with no server named
            object.__setattr__(self, "tokens", TOKENS_AUTO)
        elif str(self.tokens).lower() in ("0", "false", "no", "off"):
            object.__setattr__(self, "tokens", "")
        # Fold the convenience fields into llm_params, which is what travels in the JobSpec.
        extra = self.convenience_params()
        if not extra:
            return
        try:
            base = json.loads(self.llm_params) if self.llm_params else {}
        except ValueError:
            return  # validated() reports it
        if isinstance(base, dict):
            object.__setattr__(self, "llm_params", json.dumps({**base, **extra}, sort_keys=True))

    def convenience_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.llm_max_tokens > 0:
            out["max_tokens"] = self.llm_max_tokens
        if self.llm_top_p > 0:
            out["top_p"] = self.llm_top_p
        if self.llm_stop:
            stop: Any = self.llm_stop
            if stop.lstrip().startswith("["):
                try:
                    stop = json.loads(stop)
                except ValueError:
                    pass  # validated() reports it
            out["stop"] = stop
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None and f.name == "redis_url":
                raw = env.get("REDIS_URL")
            if raw is None and f.name == "llm_api_key":
                raw = env.get("OPENAI_API_KEY")
            if raw is not None:
                values[f.name] = _coerce(f, raw, source=ENV_PREFIX + f.name.upper())
        for name, value in overrides.items():
            if value is None:
                continue
            f = _field(name)
            values[name] = _coerce(f, value, source=f"--{name.replace('_', '-')}")
        return cls(**values).validated()

    def replace(self, **changes: Any) -> "Settings":
        return self.from_env({}, **{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def as_environ(self) -> dict[str, str]:
        """The settings as environment variables, for child processes (workers, consumer)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = value.reveal() if isinstance(value, Secret) else str(value)
        return out

    def validated(self) -> "Settings":
        problems = []
        if self.max_steps < 1:
            problems.append("max_steps must be >= 1")
        if self.concurrency < 1:
            problems.append("concurrency must be >= 1")
        if self.max_attempts < 1:
            problems.append("max_attempts must be >= 1")
        if self.lease_ttl_s <= 1:
            problems.append("lease_ttl_s must be > 1")
        if self.episode_budget_s <= 0:
            problems.append("episode_budget_s must be > 0")
        if self.pool not in ("threads", "prefork", "gevent", "solo"):
            problems.append(f"pool must be threads, prefork, gevent or solo, not {self.pool!r}")
        if self.llm_params:
            try:
                if not isinstance(json.loads(self.llm_params), dict):
                    raise ValueError
            except ValueError:
                problems.append(f"llm_params must be a JSON object, got {self.llm_params!r}")
        if self.tokens not in TOKEN_MODES:
            problems.append(f"tokens must be one of {', '.join(repr(m) for m in TOKEN_MODES)}, not {self.tokens!r}")
        if self.llm_max_tokens < 0:
            problems.append("llm_max_tokens must be >= 0 (0 = not sent)")
        if not 0 <= self.llm_top_p <= 1:
            problems.append("llm_top_p must be in (0, 1] (0 = not sent)")
        stop = self.convenience_params().get("stop")
        if stop is not None and not (isinstance(stop, str) or (
                isinstance(stop, list) and stop and all(isinstance(x, str) for x in stop))):
            problems.append(f"llm_stop must be a string or a JSON list of strings, got {self.llm_stop!r}")
        for name in ("llm_max_concurrency", "llm_max_connections", "llm_startup_jitter_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        for name in ("pause_after_failures", "llm_fleet_max_concurrency", "env_fleet_max_concurrency",
                     "env_fleet_max_instances", "llm_fleet_rpm", "llm_fleet_tpm"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (0 = none)")
        if self.experience_top_k < 1:
            problems.append("experience_top_k must be >= 1")
        if self.outage_budget_s < 0:
            problems.append("outage_budget_s must be >= 0")
        if self.shutdown_hard_exit_s <= 0:
            problems.append("shutdown_hard_exit_s must be > 0")
        if self.worker_stall_s < 0:
            problems.append("worker_stall_s must be >= 0 (0 turns the consumer watch off)")
        if self.job_retention_s <= 0:
            problems.append("job_retention_s must be > 0")
        if self.feed_max_ahead < 1:
            problems.append("feed_max_ahead must be >= 1")
        if self.feed_stale_policy not in ("requeue", "drop"):
            problems.append(f"feed_stale_policy must be requeue or drop, not {self.feed_stale_policy!r}")
        if self.feed_failed_policy not in ("report", "refill"):
            problems.append(f"feed_failed_policy must be report or refill, not {self.feed_failed_policy!r}")
        if self.feed_refill_max < 0:
            problems.append("feed_refill_max must be >= 0")
        if self.feed_ack_timeout_s <= 0:
            problems.append("feed_ack_timeout_s must be > 0")
        # URLs the workers connect to: the same check a task file's base_url gets (broker/urls.py).
        for name in ("llm_base_url", "env_base_url"):
            value = getattr(self, name)
            if value or name == "llm_base_url":
                problem = url_problem(value)
                if problem:
                    problems.append(f"{name} {redact_url(value)!r}: {problem}")
        for origin in (o.strip() for o in self.llm_trusted_origins.split(",")):
            problem = url_problem(origin) if origin else ""
            if problem:
                problems.append(f"llm_trusted_origins entry {redact_url(origin)!r}: {problem}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            problems.append(f"redis_url must start with redis://, rediss:// or unix://, not {redact_url(self.redis_url)!r}")
        if problems:
            raise SettingsError("invalid settings: " + "; ".join(problems))
        return self

    @property
    def results_db(self) -> str:
        return self.db_path or os.path.join(self.run_dir, "results.sqlite")

    @property
    def results_store(self) -> str:
        """Where results are stored and read: ``store_url``, else the SQLite file."""
        return self.store_url or self.results_db

    @property
    def results_store_shown(self) -> str:
        return redact_url(self.results_store)

    def queue_for(self, spec: Any = None) -> str:
        """The queue an episode's task goes to: its spec's own (a task-file entry's ``queue``),
        else the default. ``spec`` is an EpisodeSpec, a queue name, or None (spec lost)."""
        own = spec if isinstance(spec, str) else getattr(spec, "queue", "")
        return own or self.queue

    @property
    def served_queues(self) -> list[str]:
        return [q.strip() for q in self.queues.split(",") if q.strip()] or [self.queue]

    @property
    def visibility_timeout_s(self) -> int:
        # Above the episode budget, so the broker never redelivers an episode that is still
        # running; a dead worker's episode comes back much sooner through its lease.
        return int(self.episode_budget_s + self.shutdown_grace_s + 300)

    def __repr__(self) -> str:
        """Secrets hidden (a repr ends up in logs and tracebacks): the API key left out, passwords
        in URLs starred."""
        shown = {k: (redact_url(v) if k in _URL_FIELDS else v) for k, v in self.as_dict().items()
                 if k not in ("llm_api_key", "feed_token")}
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def trusted_model_origins(self) -> frozenset[str]:
        """Origins the API key may be sent to: llm_base_url's and llm_trusted_origins."""
        out = {origin_of(self.llm_base_url)}
        out.update(origin_of(o) for o in self.llm_trusted_origins.split(",") if o.strip())
        return frozenset(o for o in out if o)


_URL_FIELDS = frozenset({"redis_url", "llm_base_url", "store_url", "env_base_url", "db_path"})


def _field(name: str) -> dataclasses.Field:
    for f in fields(Settings):
        if f.name == name:
            return f
    raise SettingsError(f"unknown setting {name!r}")


def _coerce(f: dataclasses.Field, raw: Any, *, source: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "Secret":
            return Secret(raw.reveal() if isinstance(raw, Secret) else str(raw))
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            return str(raw).strip().lower() in ("1", "true", "yes", "on")
        return str(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"{source}: expected {kind}, got {raw!r}") from None

