"""One settings object for every role, read from the environment and then from flags.

Every field maps to an environment variable ``INTERACTOR_<FIELD>`` (upper case); ``REDIS_URL``
and ``OPENAI_API_KEY`` are also honoured because users already have them set. Each field carries
its description (:func:`setting`): what it does, its group and its command-line flag, from which
the command line makes its flags and their help. Secrets are held in :class:`Secret` so that they
never show up in ``repr``, logs or task payloads (broker/redact.py; read from here by every role,
with ``redact_url``, beside the settings they guard).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from broker.redact import Secret, redact_url
from broker.settings_checks import FEED_FAILED_POLICIES, FEED_STALE_POLICIES, POOLS, REDIS_WAITS, settings_problems
from broker.tokens import TOKEN_SERVERS, TOKENS_AUTO
from broker.urls import origin_of

ENV_PREFIX = "INTERACTOR_"


class SettingsError(ValueError):
    pass


# --- what describes a setting ------------------------------------------------------------------
# Each field of Settings says, beside its default, what it does (its help), the group it belongs
# to and, when it has one, its command-line flag with the parts of the system that read it. The
# command line derives its flags from this (interactor/common.py); nothing describes a setting
# twice.

# Groups of settings, in the order `--help` shows them: name -> what they are about.
GROUPS = {
    "storage": "where the fleet's Redis and the results are",
    "model": "the model endpoint and what every request asks of it",
    "env": "the environment servers",
    "episodes": "the step loop",
    "delivery": "leases, attempts, outages and shutdown",
    "limits": "fleet-wide, across every worker process (a task file's own win)",
    "fleet": "each worker process",
    "trust": "what a job (anyone who can write a task) may make workers do",
    "consumer": "the results stream and its consumer",
    "feed": "a job's rollout feed, fixed when the job is created (refused with --job)",
    "feed server": "the HTTP server trainers take groups from",
}

# The parts of the system that read a flagged setting; a command offers the flags of the parts
# it runs or reads (interactor/common.py).
JOB = "job"  # copied into each job when it is created (submit, run, feed serve); workers use the job's copy
WORKER = "worker"  # each worker process's own
REDIS = "redis"  # where the fleet's Redis is and how its keys and queues are named: whatever reads or writes it
STORE = "store"  # where the results are: whatever writes or reads them
REDRIVE = "redrive"  # re-driving dead letters (interactor dlq, the results browser's actions)
FEED = "feed"  # a feed job's own (broker/feed.py FeedConfig: the setting feed_<knob>)
FEED_SERVER = "feed server"  # the feed's HTTP server


def setting(default: Any, help: str, group: str, *, flag: str = "", read_by: tuple[str, ...] = (),
            env: str = "", bare: str = "", typed: bool = False, choices: tuple[str, ...] = ()) -> Any:
    """A field of :class:`Settings` with its description.

    ``help``: what it does (the flag's help; its default and variable are added where shown).
    ``flag``: its command-line flag, offered by commands that run a part in ``read_by``.
    ``env``: another variable honoured when ``INTERACTOR_<FIELD>`` is unset (users have it set).
    ``bare``: the value the flag stands for when given without one (``--flag=VALUE`` otherwise).
    ``typed``: the flag's value is checked when the command line is read (its type, ``choices``);
    otherwise as the variable's, when the settings are made (a SettingsError naming it)."""
    if group not in GROUPS or bool(flag) != bool(read_by):
        raise TypeError(f"setting {help!r}: unknown group {group!r}, or a flag without its readers")
    return dataclasses.field(default=default, metadata={
        "help": help, "group": group, "flag": flag, "read_by": frozenset(read_by), "env": env, "bare": bare,
        "typed": typed, "choices": choices})


_CACHE_WORDS = {**{w: "on" for w in ("1", "true", "yes", "on")}, **{w: "" for w in ("", "0", "false", "no", "off")}}


@dataclass(frozen=True)
class Settings:
    # --- storage ---------------------------------------------------------------------------
    redis_url: str = setting(
        "", "the fleet's Redis: redis://[:PASSWORD@]HOST:PORT/DB (or ?db=DB), the same over TLS as rediss://, a "
            "unix socket as unix://[:PASSWORD@]/PATH?db=DB, or a primary behind Sentinels: "
            "redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]; percent-encode @ / ? # % in a "
            "password; unset, `run`, `demo` and `feed serve` start an embedded Redis in the run folder", "storage",
        flag="--redis-url", read_by=(REDIS,), env="REDIS_URL")
    redis_tls_ca: str = setting("", "CA file for rediss:// URLs (unset: the system's trust store)", "storage")
    redis_sentinel_password: Secret = setting(Secret(""), "the Sentinels' own password (their requirepass), for a "
                                                          "redis+sentinel:// URL; the URL's is the primary's", "storage")
    # broker/replicas.py; docs/guarantees.md "Failover" says what it buys and costs.
    redis_wait: str = setting(REDIS_WAITS[0], "an attempt's START and FINISH, a feed's takes and acks, and a job's "
                                              "submit wait until a replica has them (WAIT 1): auto = with a "
                                              "redis+sentinel:// URL",
                              "storage", choices=REDIS_WAITS)
    redis_wait_timeout_ms: int = setting(500, "milliseconds such a wait lasts at most; after one that timed out, "
                                              "the waits stop for 10 s (a replica down must not slow the fleet)",
                                         "storage")
    key_prefix: str = setting("ix", "every Redis key this system writes starts with it", "storage",
                              flag="--key-prefix", read_by=(REDIS,))
    queue: str = setting(
        "episodes", "the queue episodes go to when their task-file entry names none; workers serve it unless "
                    "--queues names others", "storage", flag="--queue", read_by=(REDIS,))
    queues: str = setting("", "comma-separated queues a worker serves (unset: --queue)", "storage",
                          flag="--queues", read_by=(REDIS,))
    run_dir: str = setting("runs", "folder of the embedded Redis's data, the results database, logs and exports; "
                           "without REDIS_URL, the commands that read Redis use the embedded Redis of a local run "
                           "still running there", "storage", flag="--run-dir", read_by=(STORE, REDIS))
    db_path: str = setting("", "SQLite results file (unset: RUN_DIR/results.sqlite)", "storage",
                           flag="--db", read_by=(STORE,))
    store_url: str = setting("", "the results store: postgresql://... or a SQLite path (unset: the SQLite file)",
                             "storage", flag="--store", read_by=(STORE,))

    # --- model: the key never leaves the worker ------------------------------------------------
    llm_base_url: str = setting(
        "http://127.0.0.1:8000/v1", "the model endpoint (OpenAI-compatible, ending in /v1); a worker sends the "
                                    "API key only to the origin of its own and to INTERACTOR_LLM_TRUSTED_ORIGINS",
        "model", flag="--llm-base-url", read_by=(JOB, WORKER))
    llm_api_key: Secret = setting(Secret(""), "API key sent to the model endpoint; never in tasks, records or logs",
                                  "model", env="OPENAI_API_KEY")
    model: str = setting("stand-in", "the model name every request asks for, and results are labelled with; `run` "
                                     "and `submit` first check that the endpoint serves it (the default is the "
                                     "bundled stand-in's: a server that lists other models is refused without "
                                     "--model, naming them)", "model", flag="--model", read_by=(JOB,))
    temperature: float = setting(0.3, "sampling temperature of every request", "model", flag="--temperature",
                                 read_by=(JOB,))
    llm_connect_timeout_s: float = setting(10.0, "seconds to connect to the model endpoint", "model",
                                           flag="--llm-connect-timeout", read_by=(WORKER,))
    llm_read_timeout_s: float = setting(600.0, "seconds to wait for the model's answer", "model",
                                        flag="--llm-timeout", read_by=(WORKER,))
    llm_retries: int = setting(6, "extra tries of a model request after the first, for 429/5xx/connection/timeout",
                               "model", flag="--llm-retries", read_by=(WORKER,))
    llm_backoff_initial_s: float = setting(1.0, "seconds before the first model retry (doubling after)", "model")
    llm_backoff_max_s: float = setting(30.0, "longest wait between model retries, seconds", "model")
    llm_session_routing: bool = setting(False, "the model base URL becomes {llm-base-url}/{episode_id} (a "
                                               "session-routing proxy)", "model",
                                        flag="--llm-session-routing", read_by=(JOB,))
    llm_params: str = setting("", "JSON object merged into every request body: max_tokens, top_p, stop, ...",
                              "model", flag="--llm-params", read_by=(JOB,))
    # Convenience fields, merged into llm_params (and winning over the same keys there):
    llm_max_tokens: int = setting(0, '"max_tokens" of every request, merged into --llm-params (0: not sent)',
                                  "model", flag="--max-tokens", read_by=(JOB,))
    llm_top_p: float = setting(0.0, '"top_p" of every request, merged into --llm-params (0: not sent)', "model",
                               flag="--top-p", read_by=(JOB,))
    llm_stop: str = setting("", '"stop" of every request: one stop string, or a JSON list of strings, merged into '
                                "--llm-params (unset: not sent)", "model", flag="--stop", read_by=(JOB,))
    llm_max_concurrency: int = setting(0, "model requests in flight per worker process (0: up to --concurrency)",
                                       "model", flag="--llm-max-concurrency", read_by=(WORKER,))
    llm_max_connections: int = setting(0, "kept-alive connections to the model per worker process (0: twice the "
                                          "requests in flight, at least 10)", "model",
                                       flag="--llm-max-connections", read_by=(WORKER,))
    llm_startup_jitter_s: float = setting(
        0.0, "seconds: each of a worker process's first --concurrency episodes first waits a random part of it, "
             "so that a fleet starting at once does not hit the model in one burst", "model",
        flag="--llm-startup-jitter", read_by=(WORKER,))
    # broker/tokens.py TOKEN_MODES: "" off, "auto", or the server's name; "1"/"true" = auto.
    tokens: str = setting(
        "", "store the token ids and logprobs the model sampled: bare, in the way the answers show, or "
            "--tokens=" + "|".join(TOKEN_SERVERS) + ", the server's way (unset: off, or a task file's `tokens:`)",
        "model", flag="--tokens", read_by=(JOB,), bare=TOKENS_AUTO)

    # broker/cache.py: "" off, "on" (greedy requests only), "sampled" (any temperature, asked for)
    cache: str = setting("", "answer each model request made identically before (by any job) from the response "
                             "cache, its step marked cached: bare, for a greedy job only (temperature 0; a sampled job "
                             "is refused); --cache=sampled for sampled requests too (unset: off)", "model",
                         flag="--cache", read_by=(JOB,), bare="on", choices=("on", "sampled"))
    cache_max_entries: int = setting(100_000, "answers the response cache keeps, fleet-wide; the oldest go first", "model")

    # --- env -------------------------------------------------------------------------------
    env_base_url: str = setting("", "the env server of task-file entries that name no base_url", "env",
                                flag="--env-base-url", read_by=(JOB,))
    env_connect_timeout_s: float = setting(5.0, "seconds to connect to an env server", "env")
    env_read_timeout_s: float = setting(120.0, "seconds to wait for an env server's answer (an inproc env's call)",
                                        "env")
    env_retries: int = setting(3, "extra tries of an env call that is safe to retry (workers/envclient.py: one "
                                  "that provably never reached the server)", "env",
                               flag="--env-retries", read_by=(WORKER,))
    env_backoff_initial_s: float = setting(0.5, "seconds before the first env retry (doubling after)", "env")
    env_backoff_max_s: float = setting(10.0, "longest wait between env retries, seconds", "env")
    max_response_bytes: int = setting(32 * 1024 * 1024, "a larger env or model answer is malformed", "env")
    # workers/plainhttp.py: a tenth of urllib3's CPU per call.
    http_plain_client: bool = setting(True, "plain http:// env and model calls through the worker's own HTTP/1.1 "
                                            "client; off: urllib3 for every call", "env")

    # --- episodes (docs/protocol.md#step-loop) -------------------------------------------------
    max_steps: int = setting(1000, "steps of an episode at most", "episodes", flag="--max-steps", read_by=(JOB,))
    message_cut: int = setting(
        3, "prompt trimming: each prompt is a leading system message plus the last 2*N-1 messages (3: the last "
           "5); 0 sends the whole history, the usual setting for multi-turn RL", "episodes",
        flag="--message-cut", read_by=(JOB,))
    episode_budget_s: float = setting(3600.0, "seconds of wall clock per attempt, enforced by the step loop",
                                      "episodes", flag="--episode-budget", read_by=(JOB, WORKER))
    episode_hook: str = setting("", "module:factory of a hook around each episode; a worker may load its own one",
                                "episodes", flag="--episode-hook", read_by=(JOB, WORKER))
    experience_dir: str = setting("", "folder the built-in hook workers.experience:template reads skills from",
                                  "episodes", flag="--experience-dir", read_by=(WORKER,))
    experience_top_k: int = setting(3, "skills that hook injects, best success rate first", "episodes",
                                    flag="--experience-top-k", read_by=(WORKER,))

    # --- delivery ----------------------------------------------------------------------------
    lease_ttl_s: float = setting(30.0, "seconds an episode's lease lasts unrenewed: a dead worker's episode runs "
                                       "again about this (plus a sweep) later", "delivery",
                                 flag="--lease-ttl", read_by=(REDIS,))
    sweep_interval_s: float = setting(5.0, "seconds between the sweeps that re-run episodes whose lease expired",
                                      "delivery")
    reconcile_interval_s: float = setting(30.0, "how often the sweeper looks for lost messages of quiet jobs, "
                                                "seconds", "delivery")
    max_attempts: int = setting(3, "attempts of an episode before it is dead-lettered; a re-drive gives as many "
                                   "more", "delivery",
                                flag="--max-attempts", read_by=(JOB, REDRIVE))
    retry_on: str = setting("", "failure classes an episode is retried for, comma-separated: env_outage, "
                                "model_timeout, worker_lost, agent_failure, malformed_answer, or infra (the first "
                                "three); a failure of any other class is dead-lettered on its first attempt, the "
                                "message saying so (unset: every transient failure is retried; docs/protocol.md"
                                "#failures-and-attempts)", "delivery", flag="--retry-on", read_by=(JOB,))
    retry_backoff_initial_s: float = setting(2.0, "seconds before an episode's second attempt (doubling after)",
                                             "delivery")
    retry_backoff_max_s: float = setting(60.0, "longest wait before an episode's next attempt, seconds", "delivery")
    shutdown_grace_s: float = setting(30.0, "seconds running episodes get to finish after SIGTERM; then they are "
                                            "handed back", "delivery", flag="--shutdown-grace", read_by=(WORKER,))
    # Celery's warm shutdown waits on its broker, forever if Redis is gone for good.
    shutdown_hard_exit_s: float = setting(60.0, "seconds after the grace until the kernel ends the worker process "
                                                "(SIGALRM)", "delivery")
    # workers/consumer_watch.py
    worker_stall_s: float = setting(60.0, "a worker process whose Celery consumer takes no task this long while "
                                          "episodes wait in its queues and it has free slots is replaced (0: never)",
                                    "delivery")
    # Off: nothing here uses it, and under the gevent pool its broadcast loop can block for good
    # on a pub/sub socket after a Redis restart, so that a warm shutdown never ends
    # (workers/tasks.py: the kernel ends it at shutdown_grace_s + shutdown_hard_exit_s; a
    # container is killed before that).
    worker_remote_control: bool = setting(False, "Celery's remote control (celery inspect, control)", "delivery")
    # workers/faults.py: for the tests that stop a real worker at each point of a turn
    # (tests/test_fault_points.py); empty, as it must stay outside them, it costs one call per point.
    fault_point: str = setting("", "tests only: stop this worker once at POINT@STEP:killed|stopped:MARKER_FILE "
                                   "(workers/faults.py)", "delivery")
    # workers/breakers.py; Redis too (broker_outage).
    outage_budget_s: float = setting(
        900.0, "seconds a down server (refused, reset, 429/502/503/504 with its readiness route down too) holds "
               "its episodes, budgets paused, before they are dead-lettered as env_outage/model_outage", "delivery")
    job_retention_s: float = setting(7 * 24 * 3600.0, "seconds after its end that a finished job's Redis keys "
                                                      "expire", "delivery")

    # --- trust boundaries ------------------------------------------------------------------
    llm_trusted_origins: str = setting(
        "", "comma-separated scheme://host:port that also get the API key besides --llm-base-url's origin; a job "
            "naming another model host gets its calls without it", "trust")
    env_classes: str = setting(
        "", 'inproc env classes a worker may import ("module:Class", "module:*", "package.*"), comma-separated '
            "(unset: the bundled adapters); anything else is dead-lettered as bad_task unimported", "trust")
    episode_hooks: str = setting("", "episode hooks a worker may load, as for env_classes (unset: the built-in "
                                     "hooks and the worker's own episode_hook)", "trust")
    env_hosts: str = setting("", "env servers workers may call: comma-separated host, host:port or "
                                 "scheme://host:port (unset: any); keeps a job from pointing workers at internal "
                                 "services (SSRF)", "trust")
    agents: str = setting("", 'agent functions a worker may import for agent episodes, as for env_classes '
                              '("module:function", "module:*", "package.*"), comma-separated (unset: none); '
                              "anything else is dead-lettered as bad_task unimported", "trust")
    agent_commands: str = setting("", "agent commands a worker may run for agent episodes: comma-separated argv "
                                      "prefixes, words split by spaces (\"python3 agents/solve.py\" allows that "
                                      "argv and any arguments after it; unset: none)", "trust")
    agent_timeout_s: float = setting(600.0, "seconds an agent of an agent episode may run (from its call or its "
                                            "process's start; an agent function's import not counted) before its "
                                            "attempt fails as agent_timeout (0: only the episode's budget)", "episodes",
                                     flag="--agent-timeout", read_by=(WORKER,))
    gateway_max_body_bytes: int = setting(16 << 20, "largest request body the model gateway takes from an agent "
                                                    "(larger: 413)", "trust")
    gateway_host: str = setting("127.0.0.1", "address a worker's model gateway listens on (agent episodes): "
                                             "loopback for the agents it runs itself; 0.0.0.0 when `interactor "
                                             "gateway` routes agents that run elsewhere to it", "fleet")
    gateway_advertise_host: str = setting("", "the host `interactor gateway` reaches a worker's gateway at (unset: "
                                              "--gateway-host, or the machine's address when that is 0.0.0.0)",
                                          "fleet")
    gateway_url: str = setting("", "the URL of `interactor gateway` that agents are given instead of the worker's own "
                                   "gateway (unset: the worker's): for agents that run elsewhere", "fleet")

    # --- fleet-wide limits (broker/caps.py, broker/pause.py, broker/ratelimit.py) ----------------
    no_resume: bool = setting(False, "a new attempt never continues its predecessor's env instance (not the "
                                     "opposite of `run --resume JOB`, which finishes a stopped job): every attempt "
                                     "resets a fresh one and starts from turn one (also `resume: false` in a task "
                                     "file); for env servers whose instances must not outlive the worker that made "
                                     "them", "episodes", flag="--no-resume", read_by=(JOB,))
    pause_after_failures: int = setting(20, "a job pauses once this many of its episodes in a row failed with the "
                                            "same reason (0: never)", "limits",
                                        flag="--pause-after-failures", read_by=(JOB,))
    llm_fleet_max_concurrency: str = setting(
        "0", "calls in flight to the job's model endpoint across every worker process: N, or auto[:MIN-MAX] to "
             "follow the server (+1 per window of N healthy answers while calls wait for a slot, x0.8 on HTTP "
             "429/502/503/504 or a read timeout; bare auto is 1-256 starting at 20, as Inspect AI starts; run also takes "
             "--concurrency auto[:MIN-MAX]); interactor job JOB set --concurrency changes it while the "
             "job runs (0: no cap)", "limits", flag="--llm-fleet-max-concurrency", read_by=(JOB,))
    llm_metrics_url: str = setting(
        "", "a vLLM or SGLang server's Prometheus metrics (e.g. http://host:8000/metrics), read once a second by "
            "one worker of the fleet under an adaptive cap (needs --llm-fleet-max-concurrency auto[:MIN-MAX]): "
            "requests waiting in its queue, or KV-cache use >= 0.9, cut the limit x0.8 as a 429 does; a healthy "
            "reading adds nothing, an unreachable endpoint is logged and changes nothing", "limits",
        flag="--llm-metrics-url", read_by=(JOB,))
    llm_fleet_rpm: int = setting(0, "requests per minute to the job's model endpoint, fleet-wide (0: no limit)",
                                 "limits", flag="--llm-fleet-rpm", read_by=(JOB,))
    llm_fleet_tpm: int = setting(0, "tokens per minute to the job's model endpoint, fleet-wide, charged from the "
                                    "answers' usage (0: no limit)", "limits", flag="--llm-fleet-tpm", read_by=(JOB,))
    env_fleet_max_concurrency: int = setting(0, "calls in flight to each env server the job uses, fleet-wide "
                                                "(0: no cap)", "limits",
                                             flag="--env-fleet-max-concurrency", read_by=(JOB,))
    env_fleet_max_instances: int = setting(0, "live env instances (reset, not yet closed) on each env server the "
                                              "job uses, fleet-wide (0: no cap)", "limits",
                                           flag="--env-fleet-max-instances", read_by=(JOB,))
    # budgets (broker/job_budgets.py): enforced by the consumer after each commit, so calls already in
    # flight and the consumer's lag go past them
    max_tokens_total: int = setting(0, "the job stops (as a cancel does: what completed is kept) once its model "
                                       "calls used this many tokens, prompt + completion, from the answers' usage; "
                                       "calls in flight when it is reached still count, so it is passed by a "
                                       "little (0: none)", "limits", flag="--max-tokens-total", read_by=(JOB,))
    budget_usd: float = setting(0.0, "the job stops as with --max-tokens-total once its model calls cost this "
                                     "many USD, at its model's --model-prices (required: a job whose model has "
                                     "no price is refused) (0: none)", "limits", flag="--budget-usd",
                                read_by=(JOB,))
    model_prices: str = setting("", "USD per 1M tokens by model, input/output: 'MODEL=IN/OUT[,MODEL=IN/OUT...]', "
                                    "e.g. 'gpt-4o-mini=0.15/0.60'; the job's cost in results, status and the "
                                    "browser, and what --budget-usd is counted in", "limits",
                                flag="--model-prices", read_by=(JOB,))

    # --- fleet: each worker process ----------------------------------------------------------
    concurrency: int = setting(16, "episodes at once per worker process", "fleet", flag="--concurrency",
                               read_by=(WORKER,))
    # gevent: an episode is a greenlet; at hundreds of episodes per process it costs about half
    # the CPU per step of OS threads (no GIL hand-offs, fewer syscalls: docs/benchmarks.md).
    # threads remains available (e.g. for C extensions that block without releasing the GIL).
    pool: str = setting("gevent", "how a worker process runs its episodes: " + ", ".join(POOLS), "fleet",
                        flag="--pool", read_by=(WORKER,))

    # --- consumer ------------------------------------------------------------------------------
    stream_backlog_max: int = setting(100_000, "unacknowledged records in the results stream above which workers "
                                               "slow down", "consumer")
    consumer_batch: int = setting(2000, "records per transaction at most (a commit's fixed cost is shared)",
                                  "consumer")
    consumer_block_ms: int = setting(1000, "milliseconds a read of the results stream waits for records",
                                     "consumer")
    consumer_claim_idle_ms: int = setting(30_000, "milliseconds after which another consumer's unacknowledged "
                                                  "records are claimed", "consumer")
    consumer_reopens_max: int = setting(3, "re-runs of an episode whose completed attempt's steps were lost (a "
                                           "Redis failover), after which the consumer fails it as steps_lost",
                                        "consumer")

    # --- the online-RL feed (broker/feed.py, interactor/feedserve.py, feedcmd.py) ----------
    feed_max_ahead: int = setting(64, "groups queued, running or delivered-but-unacknowledged at once; the "
                                      "producer waits beyond", "feed", flag="--max-ahead", read_by=(FEED,),
                                  typed=True)
    feed_max_staleness: int = setting(-1, "a group whose oldest step is more than this many versions behind the "
                                          "trainer's is not delivered (-1: no bound); --stale-policy says what "
                                          "becomes of it", "feed", flag="--max-staleness", read_by=(FEED,),
                                      typed=True)
    feed_stale_policy: str = setting(
        FEED_STALE_POLICIES[0], "a stale group runs again as fresh episodes of the same tasks (requeue) or is "
                                "dropped", "feed", flag="--stale-policy", read_by=(FEED,), typed=True,
        choices=FEED_STALE_POLICIES)
    feed_failed_policy: str = setting(
        FEED_FAILED_POLICIES[0], "a group with a dead-lettered member is reported failed (report), or its tasks run "
                                 "again as a fresh group (refill)", "feed", flag="--failed-policy",
        read_by=(FEED,), typed=True, choices=FEED_FAILED_POLICIES)
    # A task that fails every time (say its env is gone) would otherwise be re-run without end.
    feed_refill_max: int = setting(2, "re-runs of a group's tasks, for a failed member (--failed-policy refill) or "
                                      "staleness (--stale-policy requeue), after which it is reported", "feed",
                                   flag="--refill-max", read_by=(FEED,), typed=True)
    feed_ack_timeout_s: float = setting(300.0, "seconds: a group taken and not acknowledged this long goes to the "
                                               "next taker", "feed", flag="--ack-timeout", read_by=(FEED,),
                                        typed=True)
    feed_drop_uniform: bool = setting(False, "drop groups whose rewards are all equal (no learning signal)", "feed",
                                      flag="--drop-uniform", read_by=(FEED,))
    feed_filter: str = setting("", "module:function called with each group before delivery; False drops it "
                                   "(allow-listed by INTERACTOR_FEED_FILTERS)", "feed", flag="--filter",
                               read_by=(FEED,))
    feed_filters: str = setting("", "filters the feed server may import, as for episode_hooks (unset: none but "
                                    "feed_filter itself)", "feed server")
    feed_host: str = setting("127.0.0.1", "address the feed server listens on (beyond loopback it requires "
                                          "INTERACTOR_FEED_TOKEN)", "feed server", flag="--host",
                             read_by=(FEED_SERVER,))
    feed_port: int = setting(8700, "port of the feed server (0 picks a free one)", "feed server", flag="--port",
                             read_by=(FEED_SERVER,), typed=True)
    feed_token: Secret = setting(Secret(""), "the token trainers must send; required when the feed server listens "
                                             "beyond loopback", "feed server")
    feed_max_connections: int = setting(64, "connections the feed server serves at once (a long-polling take holds "
                                            "one while it waits); one more is answered 503", "feed server")
    feed_request_timeout_s: float = setting(20.0, "seconds a request's head and body have to arrive, in all (a "
                                                  "client trickling bytes holds its connection no longer); also "
                                                  "each write of an answer", "feed server")
    # The feed server's own inline task files (run_dir/rollouts) are always allowed; paths given
    # on the command line are not bounded.
    feed_task_roots: str = setting("", "comma-separated folders whose task files and datasets POST /start_rollout "
                                       "may name (unset: the feed server's working directory)", "feed server")

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache", _CACHE_WORDS.get(str(self.cache).strip().lower(), self.cache))
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
            if raw is None and f.metadata["env"]:
                raw = env.get(f.metadata["env"])
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
        problems = settings_problems(self)
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
    def renewal_interval_s(self) -> float:
        """How often a worker renews its leases and writes the reservations of what it received
        (workers/renewer.py): often enough that a lease outlives two missed rounds."""
        return min(self.lease_ttl_s / 3, self.sweep_interval_s)

    @property
    def served_queues(self) -> list[str]:
        return [q.strip() for q in self.queues.split(",") if q.strip()] or [self.queue]

    def __repr__(self) -> str:
        """Secrets hidden (a repr ends up in logs and tracebacks): the API key left out, passwords
        in URLs starred."""
        shown = {k: (redact_url(v) if k in _URL_FIELDS else v) for k, v in self.as_dict().items()
                 if k not in ("llm_api_key", "feed_token", "redis_sentinel_password")}
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def trusted_model_origins(self) -> frozenset[str]:
        """Origins the API key may be sent to: llm_base_url's and llm_trusted_origins."""
        out = {origin_of(self.llm_base_url)}
        out.update(origin_of(o) for o in self.llm_trusted_origins.split(",") if o.strip())
        return frozenset(o for o in out if o)


_URL_FIELDS = frozenset({"redis_url", "llm_base_url", "store_url", "env_base_url", "db_path", "llm_metrics_url"})


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

