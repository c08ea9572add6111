"""Every Redis key this system writes, named in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "ix"

    # --- jobs and the episode ledger --------------------------------------------------
    @property
    def jobs(self) -> str:  # zset job_id -> created_at
        return f"{self.prefix}:jobs"

    def job_spec(self, job_id: str) -> str:  # msgpack JobSpec
        return f"{self.prefix}:job:{job_id}:spec"

    def job_episodes(self, job_id: str) -> str:  # hash episode_id -> msgpack EpisodeSpec
        return f"{self.prefix}:job:{job_id}:episodes"

    def job_state(self, job_id: str) -> str:  # hash episode_id -> ledger state
        return f"{self.prefix}:job:{job_id}:state"

    def job_attempts(self, job_id: str) -> str:  # hash episode_id -> attempts started
        return f"{self.prefix}:job:{job_id}:attempts"

    def job_attempt_limit(self, job_id: str) -> str:  # hash episode_id -> last attempt allowed
        return f"{self.prefix}:job:{job_id}:attempt-limit"

    def job_attempt_ids(self, job_id: str) -> str:  # hash episode_id -> "<attempt>:<attempt_id>" of its latest START
        return f"{self.prefix}:job:{job_id}:attempt-ids"

    def job_attempt_previous(self, job_id: str) -> str:  # hash episode_id -> "<attempt>:<attempt_id>" before the latest
        return f"{self.prefix}:job:{job_id}:attempt-previous"

    def job_submitting(self, job_id: str) -> str:  # marker with a TTL while the job's submit is being written
        return f"{self.prefix}:job:{job_id}:submitting"

    def job_queues(self, job_id: str) -> str:  # set of the queues the job's episodes use
        return f"{self.prefix}:job:{job_id}:queues"

    def job_counts(self, job_id: str) -> str:  # hash state -> number of episodes in it
        return f"{self.prefix}:job:{job_id}:counts"

    def job_suspects(self, job_id: str) -> str:  # hash episode_id -> when reconcile first found it lost (unix s)
        return f"{self.prefix}:job:{job_id}:suspects"

    def job_progress(self, job_id: str) -> str:  # hash episode_id -> msgpack Progress of its running trajectory
        return f"{self.prefix}:job:{job_id}:progress"

    def job_progress_seq(self, job_id: str) -> str:  # hash episode_id -> "<trajectory> <seq>" (write order)
        return f"{self.prefix}:job:{job_id}:progress-seq"

    def job_cancel(self, job_id: str) -> str:  # hash at: when the job was cancelled (broker/cancel.py)
        return f"{self.prefix}:job:{job_id}:cancel"

    def job_store(self, job_id: str) -> str:  # the results store its consumer writes (ResultStore.identity)
        return f"{self.prefix}:job:{job_id}:store"

    def job_cache(self, job_id: str) -> str:  # hash hits, misses: the job's response-cache look-ups (broker/cache.py)
        return f"{self.prefix}:job:{job_id}:cache"

    def job_audit(self, job_id: str) -> str:  # list of JSON entries: who changed the job, when (broker/audit.py)
        return f"{self.prefix}:job:{job_id}:audit"

    def job_usage(self, job_id: str) -> str:  # hash: the job's tokens, cost and budget stop (broker/job_budgets.py)
        return f"{self.prefix}:job:{job_id}:usage"

    def job_limits(self, job_id: str) -> str:  # hash: the job's limits changed live (interactor job JOB set)
        return f"{self.prefix}:job:{job_id}:limits"

    def job_keys(self, job_id: str) -> list[str]:
        """Every per-job key (what retention expires once the job is finished)."""
        return [self.job_spec(job_id), self.job_episodes(job_id), self.job_state(job_id), self.job_attempts(job_id),
                self.job_attempt_limit(job_id), self.job_attempt_ids(job_id), self.job_attempt_previous(job_id),
                self.job_queues(job_id), self.job_counts(job_id), self.job_store(job_id),
                self.job_progress(job_id), self.job_progress_seq(job_id), self.job_suspects(job_id),
                self.job_pause(job_id), self.job_streak(job_id), self.job_parked(job_id), self.job_cancel(job_id),
                self.job_cache(job_id), self.job_audit(job_id), self.job_usage(job_id),
                self.job_limits(job_id)]

    # --- leases and scheduling --------------------------------------------------------
    def lease(self, episode_id: str) -> str:  # token "<worker>:<attempt_id>:<attempt>", with a TTL
        return f"{self.prefix}:lease:{episode_id}"

    def fading_holder(self, episode_id: str) -> str:  # a running-out lease's token, kept past its reclaim
        return f"{self.prefix}:fading-holder:{episode_id}"

    @property
    def running(self) -> str:  # zset "<job> <episode>" -> lease expiry (ms since epoch)
        return f"{self.prefix}:running"

    @property
    def reserved(self) -> str:  # zset "<job> <episode>" -> reservation expiry (ms): received, not started
        return f"{self.prefix}:reserved"

    @property
    def retry(self) -> str:  # zset "<job> <episode>" -> when to enqueue again (ms)
        return f"{self.prefix}:retry"

    @property
    def sweep_lock(self) -> str:
        return f"{self.prefix}:sweep-lock"

    @property
    def sweep_clock(self) -> str:  # Redis time (ms) of the last sweep that reached Redis: outages show as a gap
        return f"{self.prefix}:sweep-clock"

    @property
    def reclaim_hold(self) -> str:  # set (with a TTL) after such a gap: no lease is reclaimed while it lives
        return f"{self.prefix}:reclaim-hold"

    @property
    def outages(self) -> str:  # zset "<start ms>:<end ms>" -> end: the last such gaps (leases lapsed in one cost no attempt)
        return f"{self.prefix}:outages"

    @property
    def primary(self) -> str:  # the replication id of the primary the last sweep reached: a change is a failover
        return f"{self.prefix}:primary"

    @property
    def replica_barrier(self) -> str:  # a counter written before a WAIT that confirms earlier writes (broker/replicas.py)
        return f"{self.prefix}:replica-barrier"

    @property
    def orphans(self) -> str:  # list of msgpack [base_url, env_name, instance id]: env instances to close
        return f"{self.prefix}:orphans"

    def gateway_route(self, session_id: str) -> str:  # string: the URL of the worker gateway serving the agent session
        return f"{self.prefix}:gateway:{session_id}"

    @property
    def breakers(self) -> str:  # hash "<kind> <server> <worker>" -> msgpack BreakerState: open circuit breakers
        return f"{self.prefix}:breakers"

    # --- results and dead letters -----------------------------------------------------
    @property
    def results(self) -> str:  # stream of msgpack records, field "r"
        return f"{self.prefix}:results"

    @property
    def poison(self) -> str:  # stream of records the store rejected alone: id, raw record, error
        return f"{self.prefix}:results:poison"

    @property
    def dlq(self) -> str:  # hash "<job> <episode>" -> msgpack DeadLetter
        return f"{self.prefix}:dlq"

    @property
    def dlq_index(self) -> str:  # zset "<job> <episode>" -> dead-lettered at (s)
        return f"{self.prefix}:dlq:index"

    # --- fleet statistics (interactor/fleet_reader.py) --------------------------------
    @property
    def stats(self) -> str:  # hash: counters and histogram buckets folded from committed records
        return f"{self.prefix}:stats"

    @property
    def stats_samples(self) -> str:  # zset "<ts>:<steps>" -> ts: recent step totals, for steps/s
        return f"{self.prefix}:stats:samples"

    # --- the online-RL feed (broker/feed.py), one set per job ---------------------------
    @property
    def feeds(self) -> str:  # set of job ids that have a feed (workers stamp versions, the consumer announces)
        return f"{self.prefix}:feeds"

    def feed_config(self, job_id: str) -> str:  # hash: FeedConfig fields
        return f"{self.prefix}:feed:{job_id}:config"

    def feed_stream(self, job_id: str) -> str:  # stream of complete groups, field "g": msgpack FeedGroup
        return f"{self.prefix}:feed:{job_id}:groups"

    def feed_seen(self, job_id: str) -> str:  # hash group_id -> feed stream entry id: announced once
        return f"{self.prefix}:feed:{job_id}:seen"

    def feed_stats(self, job_id: str) -> str:  # hash: broker/feed.py counters
        return f"{self.prefix}:feed:{job_id}:stats"

    def feed_version(self, job_id: str) -> str:  # the trainer's current policy version (an integer)
        return f"{self.prefix}:feed:{job_id}:version"

    def feed_position(self, job_id: str) -> str:  # hash: the continuous producer's durable position
        return f"{self.prefix}:feed:{job_id}:position"

    def feed_templates(self, job_id: str) -> str:  # hash index -> msgpack list of EpisodeSpec maps (one group)
        return f"{self.prefix}:feed:{job_id}:templates"

    def feed_redo(self, job_id: str) -> str:  # list of msgpack [old group, [episode ids], why, refills]: to run afresh
        return f"{self.prefix}:feed:{job_id}:redo"

    def feed_failures(self, job_id: str) -> str:  # capped list of msgpack FeedGroup that failed (the trainer reads)
        return f"{self.prefix}:feed:{job_id}:failures"

    def feed_refills(self, job_id: str) -> str:  # hash group_id -> re-runs for failed members it descends from
        return f"{self.prefix}:feed:{job_id}:refills"

    def feed_producer(self, job_id: str) -> str:  # hash: the producer's state, errors, last error, last seen
        # Not among feed_keys: each write gives it the job retention as its own expiry, so a
        # producer that stopped leaves its last word for that long and no key behind.
        return f"{self.prefix}:feed:{job_id}:producer"

    def feed_keys(self, job_id: str) -> list[str]:
        return [self.feed_config(job_id), self.feed_stream(job_id), self.feed_seen(job_id), self.feed_stats(job_id),
                self.feed_version(job_id), self.feed_position(job_id), self.feed_templates(job_id),
                self.feed_redo(job_id), self.feed_failures(job_id), self.feed_refills(job_id)]

    # --- fleet-wide limits (broker/pause.py, broker/caps.py) ----------------------------
    def job_pause(self, job_id: str) -> str:  # hash reason, detail, streak, since: set while the job is paused
        return f"{self.prefix}:job:{job_id}:pause"

    def job_streak(self, job_id: str) -> str:  # hash reason, count: the job's run of failed attempts alike
        return f"{self.prefix}:job:{job_id}:streak"

    def job_parked(self, job_id: str) -> str:  # set of episode ids handed back (still queued) while paused
        return f"{self.prefix}:job:{job_id}:parked"

    def cap(self, kind: str, name: str) -> str:  # zset holder -> lease expiry (ms): who holds slots of a cap
        return f"{self.prefix}:cap:{kind}:{name}"

    def cap_held(self, kind: str, name: str) -> str:  # hash holder -> slots it holds (broker/caps.py)
        return f"{self.prefix}:cap-held:{kind}:{name}"

    def cap_wanted(self, kind: str, name: str) -> str:  # zset holder -> until (ms): holders waiting for slots
        return f"{self.prefix}:cap-wanted:{kind}:{name}"

    def cap_queue(self, kind: str, name: str) -> str:  # zset holder -> since (ms): waiters holding none, in turn
        return f"{self.prefix}:cap-queue:{kind}:{name}"

    def cap_adapt(self, kind: str, name: str) -> str:  # hash min, max, ok, cut_at, at, reason: adaptive cap's state
        return f"{self.prefix}:cap-adapt:{kind}:{name}"

    def cap_adapt_log(self, kind: str, name: str) -> str:  # list "<ms> <limit> <reason>": its changes, bounded
        return f"{self.prefix}:cap-adapt-log:{kind}:{name}"

    def cap_metrics(self, kind: str, name: str) -> str:  # hash engine, waiting, kv, at, error, error_at: server's last reading
        return f"{self.prefix}:cap-metrics:{kind}:{name}"

    def cap_metrics_turn(self, kind: str, name: str) -> str:  # string, SET NX PX: the process reading the metrics now
        return f"{self.prefix}:cap-metrics-turn:{kind}:{name}"

    @property
    def caps_clock(self) -> str:  # Redis time (ms) of the caps' last take or renewal: outages show as a gap
        return f"{self.prefix}:caps-clock"

    @property
    def caps_hold(self) -> str:  # set (with a TTL) after such a gap: no lapsed cap slot is swept while it lives
        return f"{self.prefix}:caps-hold"

    @property
    def caps(self) -> str:  # hash cap key -> limit in force: every cap a job set (broker/caps.py)
        return f"{self.prefix}:caps"

    def rate(self, server: str) -> str:  # hash r, rt, t, tt: a model endpoint's RPM and TPM buckets (broker/ratelimit.py)
        return f"{self.prefix}:rate:{server}"

    def rate_hold(self, server: str) -> str:  # Redis time (ms) before which nobody calls the endpoint (429s)
        return f"{self.prefix}:rate-hold:{server}"

    # --- the response cache (broker/cache.py): written by workers' cache layer and `cache clear`
    @property
    def cache_answers(self) -> str:  # hash request key (sha256 hex) -> JSON answer
        return f"{self.prefix}:cache:answers"

    @property
    def cache_order(self) -> str:  # zset request key -> when stored (ms): the oldest go first beyond the cap
        return f"{self.prefix}:cache:order"

    @property
    def cache_stats(self) -> str:  # hash bytes, hits, misses, evicted: the fleet's cache as a whole
        return f"{self.prefix}:cache:stats"

    @property
    def rates(self) -> str:  # hash server -> "<rpm> <tpm>": every rate limit a job set, for status and metrics
        return f"{self.prefix}:rates"


def member(job_id: str, episode_id: str) -> str:
    """How an episode is named in the shared zsets; ids never contain spaces."""
    return f"{job_id} {episode_id}"


def split_member(m: str | bytes) -> tuple[str, str]:
    if isinstance(m, bytes):
        m = m.decode()
    job_id, _, episode_id = m.partition(" ")
    return job_id, episode_id


def env_instance_id(episode_id: str, attempt: int, attempt_id: str) -> str:
    """The env instance id one attempt drives (``<episode>~<attempt>-<attempt_id[:8]>``): its
    own, so that an attempt given up on can neither step nor close its successor's instance,
    and unique even if a Redis rollback repeats an attempt number. Records, the database and
    the model's session id keep the episode id."""
    return f"{episode_id}~{attempt}-{attempt_id[:8]}" if attempt_id else f"{episode_id}~{attempt}"
