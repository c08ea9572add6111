"""The record schemas every role shares, defined once and versioned.

* :class:`JobSpec`     - one per job: the policy and loop settings the producer chose.
* :class:`EpisodeSpec` - one per episode: what to reset, with which params and seed.
* :class:`StepRecord`  - one per step, published to the results stream as it happens.
* :class:`AttemptRecord` - one per attempt, closing it: completed, retrying, failed or abandoned.

All travel as msgpack maps with ``kind`` and ``v`` (schema version). A reader accepts any
record whose version it knows and ignores fields it does not (so a newer writer can add one).

Version 2 (this code writes it; version 1 is still read):

* ``StepRecord.messages_json`` replaces ``messages``: the prompt sent to the model as JSON
  text (bytes). The worker encodes it once; the database stores it as it is, so a step's
  largest field is neither unpacked into Python objects nor encoded again on the way
  (``StepRecord.messages`` decodes it for readers). A v1 record's list is converted on read.
* ``attempt_id`` on steps and attempt closes: a random token drawn when the attempt starts.
  The attempt *number* comes from a Redis counter that a Redis failover or a lost AOF tail can
  roll back; the token cannot repeat, so two runs under one number are never mixed.
* ``prompt_tokens`` / ``completion_tokens`` (the server's ``usage``, when it sends one) and
  ``ended_by`` (why the episode ended: terminated, truncated, length, context_length,
  empty_prompt, max_steps).

Version 3 (this code writes it; versions 1 and 2 are still read, their token fields empty):

* ``JobSpec.tokens``: which server's token options to ask with (broker/tokens.py TOKEN_MODES;
  "" = off).
* ``StepRecord`` token fields (broker/tokens.py): ``token_source`` (the server row that
  answered), ``token_status`` and ``token_error``, ``prompt_ids`` / ``completion_ids`` (packed
  int32) and ``completion_logprobs`` (packed float32), ``completion_token_texts`` (the strings the
  server gave, one per sampled token), and ``token_drift``: the first position where this turn's prompt ids
  stop extending the previous turn's prompt + completion ids (None: they extend it, or there is
  nothing to compare).

Version 4 (versions 1 to 3 are still read, ``policy_version`` None):

* ``StepRecord.policy_version``: the trainer's policy version (broker/feed.py) in effect when
  the model request was sent, for jobs with a feed; None otherwise. ``weight_version`` stays
  what the model server said; the feed's staleness bound reads the server's version when it
  is an integer, else this one.
* :class:`FeedGroup`: a complete (or failed) group as the feed announces it to trainers.

Version 5 (this code writes it; versions 1 to 4 are still read, their timings None): where an
attempt's time went, phase by phase (``broker.states.Phase``), so that a user sees whether the env, the
model or the queue holds episodes up:

* ``StepRecord.prompt_s`` (get_task_prompt), ``env_step_s`` (step), and on an episode's first
  step ``reset_s``; the model call is ``model_latency_s`` as before (``env_latency_s`` stays
  prompt + step).
* ``AttemptRecord`` totals over the attempt: ``reset_s``, ``prompt_s``, ``model_s``,
  ``env_step_s``, ``close_s``, and ``queue_wait_s``: for a first attempt, from the job's
  submit to its start (None for later attempts, whose wait the ledger does not time).

Added within version 5: :class:`EpisodesCancelled`, the episodes a cancel ended while they
waited (broker/cancel.py). A reader that does not know the kind parks the record as poison; the
episodes stay as that store last had them.

Also within version 5, optional: ``EpisodeSpec.image``, the task entry's ``env_image`` (the
original system's key), and ``EpisodesEnqueued.images``, the ``job_environments.image`` of those
of its episodes that have one. A record without them reads as no image ("", what the original
stores for an entry without one); a reader that does not know them stores none.

Also within version 5, optional: ``EpisodeSpec.sampling``, a task entry's own ``max_tokens``,
``temperature`` and ``stop`` (producer/taskfile.py), which the worker lays over the job's llm
settings for that episode's model calls ({}: the job's); and ``StepRecord.reasoning_content``,
the model answer's reasoning beside its content ("" when it gave none, and then not packed).

Also within version 5, optional: ``EpisodeSpec.protocol``, what the entry's env server speaks
(broker/states.py ``EnvProtocol``; "" the original protocol, what a record without it reads as),
``EpisodeSpec.mapping``, the entry's ``observation_to_messages`` / ``completion_to_action``
functions (``module:function``; {}: the default text mapping), and ``OrphanInstance.protocol``,
so that an orphan is closed the way its server closes sessions.

Also within version 5, optional: agent episodes (workers/agent_episode.py).
``EpisodeSpec.agent`` (``module:function``) or ``EpisodeSpec.agent_command`` (an argv list): the
agent the worker runs instead of the step loop ("" / []: an env episode, what a record without
them reads as); ``EpisodeSpec.env_calls_model``: the env server is given the gateway in its reset
body. ``StepRecord.tool_calls``, the answer's ``tool_calls`` (a list of objects), and
``StepRecord.tools``, the request's ``tools``: packed only when there are any, read as None.

Also within version 5, optional: ``JobSpec.cache``, the job's response-cache mode
(broker/cache.py; "" off, what a record without it reads as), and ``StepRecord.cached``: the
step's answer came from that cache (packed only when true, read as False).

Also within version 5, optional: ``JobSpec.retry_on``, the failure classes the job retries
(``--retry-on``, broker/errors.py ``RETRY_CLASSES``; [] every transient failure, what a record
without it reads as).

Also within version 5, optional: the job's budgets (broker/job_budgets.py), ``JobSpec.max_tokens_total``
and ``JobSpec.budget_usd`` (0: none, what a record without them reads as), and ``JobSpec.price``,
its model's USD per million prompt and completion tokens (``--model-prices``; []: no price).

Added within version 3, optional (a reader that does not know them ignores them, and a record
without them reads as the defaults, so no version bump was needed):

* ``JobSpec.pause_after_failures``: the job pauses after this many episodes in a row failed
  with one reason (broker/pause.py; 0 = never).
* ``JobSpec.limits``: the job's fleet-wide caps, resolved at submit (broker/caps.py ``Limits``).
"""

from __future__ import annotations

import os
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import orjson

from broker.settings import redact_url
from broker.states import Phase, ProgressPhase

SCHEMA_VERSION = 5
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5})


class RecordError(ValueError):
    """A record that cannot be decoded; the message names the field at fault."""


# The states and outcomes these records carry (AttemptRecord.status, ended_by, the phases of the
# v5 timings, FeedGroup.status) are broker/states.py's.


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_packb = msgpack.Packer(use_bin_type=True).pack


_SHAPES: dict[type, tuple] = {}


def _shape(cls: type) -> tuple:
    """(field names, required names, plain defaults, default factories) of a record class,
    computed once: the consumer decodes tens of thousands of records a second and
    ``dataclasses.fields`` is slow."""
    shape = _SHAPES.get(cls)
    if shape is None:
        fs = fields(cls)
        shape = _SHAPES[cls] = (
            tuple(f.name for f in fs),
            frozenset(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING),
            {f.name: f.default for f in fs if f.default is not MISSING},
            tuple((f.name, f.default_factory) for f in fs if f.default_factory is not MISSING),
        )
    return shape


def attempt_key(value: str) -> tuple[int, str] | None:
    """``"<attempt>:<attempt_id>"`` as (number, attempt_id); None when it is not one."""
    number, _, attempt_id = (value or "").partition(":")
    return (int(number), attempt_id) if number.isdigit() and attempt_id else None


def new_attempt_id() -> str:
    """A token that no other attempt of any episode will ever carry (96 random bits)."""
    return os.urandom(12).hex()


@dataclass
class _Record:
    KIND: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: asdict() deep-copies every nested message list, and records are
        # packed right away, so sharing the nested objects is safe and several times faster.
        names = _FIELD_NAMES.get(type(self))
        if names is None:  # dataclasses.fields() costs more than the rest of a small record's packing
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields(self))
        d = {name: getattr(self, name) for name in names}
        d["kind"] = self.KIND
        d["v"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        if not isinstance(d, dict):
            raise RecordError(f"{cls.KIND}: expected a map, got {type(d).__name__}")
        v = d.get("v")
        if v not in SUPPORTED_VERSIONS:
            raise RecordError(f"{cls.KIND}: unsupported schema version {v!r} (known: {sorted(SUPPORTED_VERSIONS)})")
        if v != SCHEMA_VERSION:
            d = cls._upgrade(d)
        names, required, defaults, factories = _shape(cls)
        values = {k: d[k] for k in names if k in d}
        if len(values) < len(required) and not required.issubset(values):
            missing = sorted(required - set(values))
            raise RecordError(f"{cls.KIND}: missing field {missing[0]!r}")
        # The fields as __init__ would set them, without calling it: the consumer decodes tens
        # of thousands of records a second, and a generated __init__ of 25 fields is the
        # larger part of that.
        obj = cls.__new__(cls)
        fill = obj.__dict__
        fill.update(defaults)
        for name, factory in factories:
            if name not in values:
                fill[name] = factory()
        fill.update(values)
        return obj

    @classmethod
    def _upgrade(cls, d: dict[str, Any]) -> dict[str, Any]:
        """An older version's map in this version's shape (no-op unless a kind needs one)."""
        return d

    def pack(self) -> bytes:
        return _packb(self.to_dict())



@dataclass
class JobSpec(_Record):
    KIND: ClassVar[str] = "job"
    job_id: str
    llm_base_url: str
    model: str
    temperature: float = 0.3
    max_steps: int = 1000
    message_cut: int = 3
    episode_budget_s: float = 3600.0
    max_attempts: int = 3
    session_routing: bool = False  # model base URL becomes {root}/{episode_id}
    episode_hook: str = ""  # "module:factory", imported by the worker
    llm_params: dict[str, Any] = field(default_factory=dict)  # max_tokens, top_p, stop, extra body
    episodes: int = 0
    groups: int = 0
    sources: list[str] = field(default_factory=list)  # task files, for the humans reading results
    created_at: float = field(default_factory=time.time)
    tokens: str = ""  # v3: broker/tokens.py TOKEN_MODES; "" = do not ask the server for tokens
    pause_after_failures: int = 20  # broker/pause.py; 0 = never pause
    limits: dict[str, Any] = field(default_factory=dict)  # broker/caps.py Limits.to_dict(); {} = no caps
    resume: bool = True  # a new attempt may continue its predecessor's env instance (broker/resume.py)
    cache: str = ""  # broker/cache.py CACHE_MODES: "" off, "on" (greedy requests), "sampled"
    # --retry-on: the failure classes retried (broker/errors.py RETRY_CLASSES); []: every transient reason
    retry_on: list[str] = field(default_factory=list)
    # budgets (broker/job_budgets.py): the consumer stops the job once reached; 0 = none
    max_tokens_total: int = 0
    budget_usd: float = 0.0
    price: list[float] = field(default_factory=list)  # the model's USD per 1M [prompt, completion] tokens; [] unpriced


@dataclass
class EpisodeSpec(_Record):
    KIND: ClassVar[str] = "episode_spec"
    job_id: str
    episode_id: str  # the protocol's env_id and the model session id
    group_id: str
    group_size: int
    env_name: str
    base_url: str
    env_params: dict[str, Any]  # the entry's params plus "dataset": its row, or {} for an entry without one
    seed: int | None = None
    queue: str = ""
    source: str = ""  # "file.yaml entry 2 row 17", for error messages and the DLQ
    transport: str = "http"  # "http" (base_url) or "inproc" (env_class run inside the worker)
    env_class: str = ""  # "module:Class" for the inproc transport
    image: str = ""  # the entry's env_image: stored as job_environments.image, used for nothing else
    # the entry's own sampling (max_tokens, temperature, stop), over the job's llm settings
    sampling: dict[str, Any] = field(default_factory=dict)
    protocol: str = ""  # what the env server speaks: broker.states.EnvProtocol ("" the original protocol)
    # OpenEnv: {"observation_to_messages": "module:function", "completion_to_action": ...}; {}: the defaults
    mapping: dict[str, str] = field(default_factory=dict)
    agent: str = ""  # "module:function": an agent episode's agent (workers/agent_episode.py)
    agent_command: list[str] = field(default_factory=list)  # or its argv, run as a process
    env_calls_model: bool = False  # the env server gets the gateway's URL and key in its reset body

    def shown(self) -> dict[str, Any]:
        """The spec as a map for dead letters and displays: any password in base_url starred."""
        return self.to_dict() | {"base_url": redact_url(self.base_url)}


@dataclass
class StepRecord(_Record):
    KIND: ClassVar[str] = "step"
    job_id: str
    env_id: str  # = episode_id = session id (the original session_steps naming)
    attempt: int
    step_id: int  # 1-based
    env_name: str
    llm_model: str
    group_id: str
    messages_json: bytes  # the messages actually sent to the model, as JSON text
    response: str
    step_reward: float
    cumulative_reward: float
    terminated: bool
    truncated: bool
    episode_finished: bool
    is_trainable: bool
    weight_version: str | None = None
    finish_reason: str = "stop"
    env_latency_s: float = 0.0
    model_latency_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    attempt_id: str = ""  # the attempt's token (see the module docstring)
    prompt_tokens: int | None = None  # the model server's usage, when it reported one
    completion_tokens: int | None = None
    ended_by: str = ""  # on the episode's final step: why it ended (broker.states.EndedBy)
    # v3, token-exact trajectories (broker/tokens.py); all empty when the job did not ask
    token_source: str = ""  # the TOKEN_SERVERS row whose answer shape was read
    token_status: str = ""  # one of TOKEN_STATUSES ("" = not asked)
    token_error: str = ""  # TOKEN_ERRORS code and detail when invalid or missing
    prompt_ids: bytes | None = None  # packed little-endian int32
    completion_ids: bytes | None = None  # packed little-endian int32
    completion_logprobs: bytes | None = None  # packed little-endian float32, one per completion token
    completion_token_texts: list[str] | None = None  # the sampled tokens' strings, as the server spelled them
    token_drift: int | None = None  # first prompt position not extending the previous turn
    policy_version: int | None = None  # v4: the feed's version when the request was sent (see the module docstring)
    # v5 timings (seconds; None: not timed, e.g. a record of an older version)
    prompt_s: float | None = None  # get_task_prompt
    env_step_s: float | None = None  # step
    reset_s: float | None = None  # reset, on the episode's first step only
    reasoning_content: str = ""  # the answer's reasoning (vLLM's reasoning parser, llama.cpp), beside response
    tool_calls: list[dict] | None = None  # the answer's tool_calls (agent episodes; None: it called no tool)
    tools: list[dict] | None = None  # the tools the request offered (agent episodes; None: none)
    cached: bool = False  # the answer came from the response cache (broker/cache.py), not the model

    _TOKEN_FIELDS: ClassVar[tuple[str, ...]] = (
        "token_source", "token_status", "token_error", "prompt_ids", "completion_ids", "completion_logprobs",
        "completion_token_texts", "token_drift")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if not self.token_status:
            # a job without tokens packs no token fields (readers fill in the defaults): the
            # stream and the consumer's decoding stay as fast as they were
            for name in self._TOKEN_FIELDS:
                del d[name]
        if not self.reasoning_content:  # most answers have none: not packed, read as ""
            del d["reasoning_content"]
        if self.tool_calls is None:  # only agent episodes' calls have them
            del d["tool_calls"]
        if self.tools is None:
            del d["tools"]
        if not self.cached:  # only jobs run with --cache have cached steps: not packed, read as False
            del d["cached"]
        return d

    @property
    def messages(self) -> list[Any]:
        return orjson.loads(self.messages_json)

    @classmethod
    def _upgrade(cls, d: dict[str, Any]) -> dict[str, Any]:
        if "messages_json" not in d and "messages" in d:  # version 1: the list itself
            d = dict(d)
            d["messages_json"] = orjson.dumps(d.pop("messages"))
        return d


@dataclass
class AttemptRecord(_Record):
    KIND: ClassVar[str] = "attempt"
    job_id: str
    episode_id: str
    attempt: int
    status: str  # broker.states.AttemptStatus
    group_id: str
    group_size: int
    env_name: str
    llm_model: str
    total_reward: float = 0.0
    steps: int = 0
    reason: str = ""  # a broker.errors reason code when not completed
    error_class: str = ""
    error: str = ""  # one line, secrets never included (workers redact URLs)
    started_at: float = 0.0
    finished_at: float = field(default_factory=time.time)
    last_info: dict[str, Any] | None = None
    worker: str = ""
    attempt_id: str = ""  # the attempt's token (see the module docstring)
    ended_by: str = ""  # completed: why the episode ended (broker.states.EndedBy)
    prompt_tokens: int = 0  # sums over the attempt's steps of the server's usage
    completion_tokens: int = 0
    # v5 timings, totals over the attempt in seconds (None: not timed); see the module docstring
    queue_wait_s: float | None = None
    reset_s: float | None = None
    prompt_s: float | None = None
    model_s: float | None = None
    env_step_s: float | None = None
    close_s: float | None = None
    # A resumed attempt (broker/resume.py) records its steps under the trajectory it continues:
    # ``trajectory`` is that trajectory's "<attempt>:<attempt_id>" ("": its own), ``resumed_at``
    # the first step it ran itself (0: it did not resume), ``resume_note`` why it did not
    # (broker.states.ResumeNote; "": nothing to resume, or it resumed).
    trajectory: str = ""
    resumed_at: int = 0
    resume_note: str = ""

    @property
    def trajectory_key(self) -> tuple[int, str]:
        """(attempt number, attempt_id) of the trajectory its steps are recorded under."""
        return attempt_key(self.trajectory) or (self.attempt, self.attempt_id or f"n{self.attempt}")

    def phases(self) -> dict[str, float]:
        """The timed phases of the attempt, by name (broker.states.Phase)."""
        values = (self.queue_wait_s, self.reset_s, self.prompt_s, self.model_s, self.env_step_s, self.close_s)
        return {name: v for name, v in zip(Phase, values) if v is not None}

    @property
    def duration_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


@dataclass
class EpisodesEnqueued(_Record):
    """Announces episodes of a job as they are enqueued (a chunk per record), so that the
    database lists every episode from the start (the original ``job_environments`` table),
    not only those that have run. ``episodes``: ``[env_id, env_name, group_id, params]`` each,
    ``params`` the JSON text (bytes) of the ``env_param`` the env will get; ``images``: the
    entry's ``env_image`` of each episode that has one, by env_id."""

    KIND: ClassVar[str] = "episodes_enqueued"
    job_id: str
    episodes: list[list[Any]]
    created_at: float = field(default_factory=time.time)
    images: dict[str, str] = field(default_factory=dict)


@dataclass
class EpisodesCancelled(_Record):
    """Episodes of a job that ended cancelled while they waited, queued or retrying (no attempt
    ran them when the job was cancelled: broker/cancel.py), a chunk per record. ``episodes``:
    ``[episode_id, group_id, group_size, env_name, attempt, attempt_id]`` each, the attempt the
    ledger last started (0 and "" for one never started): the cancel closes it for the store.
    An episode that ran when the job was cancelled ends with its attempt's own close instead
    (an :class:`AttemptRecord` of status ``cancelled``)."""

    KIND: ClassVar[str] = "episodes_cancelled"
    job_id: str
    episodes: list[list[Any]]
    llm_model: str = ""
    cancelled_at: float = field(default_factory=time.time)


_KINDS = {cls.KIND: cls for cls in (JobSpec, EpisodeSpec, StepRecord, AttemptRecord, EpisodesEnqueued,
                                     EpisodesCancelled)}


def unpack(data: bytes) -> _Record:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RecordError(f"not a msgpack record: {exc}") from None
    if not isinstance(d, dict):
        raise RecordError(f"record must be a map, got {type(d).__name__}")
    cls = _KINDS.get(d.get("kind"))
    if cls is None:
        raise RecordError(f"unknown record kind {d.get('kind')!r}")
    return cls.from_dict(d)


@dataclass
class DeadLetter(_Record):
    """An episode parked in the dead-letter queue: enough to understand and re-drive it."""

    KIND: ClassVar[str] = "dead_letter"
    job_id: str
    episode_id: str
    group_id: str
    env_name: str
    reason: str
    error_class: str = ""
    error: str = ""
    traceback: str = ""  # the last few frames, secrets redacted
    attempts: int = 0
    spec: dict[str, Any] = field(default_factory=dict)  # the EpisodeSpec as a map
    first_attempt_at: float = 0.0
    dead_at: float = field(default_factory=time.time)


_KINDS[DeadLetter.KIND] = DeadLetter


@dataclass
class OrphanInstance(_Record):
    """An env instance no attempt will close (its attempt's worker died): the sweeper queues it
    in ``<prefix>:orphans`` and a worker closes it (workers/orphans.py)."""

    KIND: ClassVar[str] = "orphan_instance"
    base_url: str
    env_name: str
    instance_id: str
    protocol: str = ""  # broker.states.EnvProtocol: how its server closes it


_KINDS[OrphanInstance.KIND] = OrphanInstance


@dataclass
class FeedGroup(_Record):
    """A group as the feed announces it (broker/feed.py): every member settled, complete
    (``status`` ready) or with a dead-lettered member (``failed``, ``reason`` says which and
    why). ``members``: its episode ids; ``oldest_version`` / ``newest_version``: the policy
    versions its steps were sampled with (None: unversioned, never stale)."""

    KIND: ClassVar[str] = "feed_group"
    job_id: str
    group_id: str
    status: str  # broker.states.FeedGroupStatus
    members: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # completed members' total rewards, in members order
    size: int = 0
    oldest_version: int | None = None
    newest_version: int | None = None
    reason: str = ""
    announced_at: float = field(default_factory=time.time)


_KINDS[FeedGroup.KIND] = FeedGroup


@dataclass
class Progress(_Record):
    """Where a running attempt stands (``Keys.job_progress``, written fenced by its lease): what a
    successor needs to continue its env instance instead of resetting a fresh one
    (broker/resume.py decides whether it may). A snapshot, rewritten at each point of the loop:

    * ``trajectory``: "<attempt>:<attempt_id>" of the attempt whose env instance this is and
      whose number and id its steps are recorded under (the attempt that reset it);
    * ``phase`` (broker.states.ProgressPhase) and ``step``: step ``step``'s prompt or step call
      is not sent yet (ready, prompted), or may be in flight (prompting, stepping);
    * the totals over the steps recorded so far, the raw prompt of a ``prompted`` step (before the
      episode hook and message_cut, which the successor applies as the loop does), the last
      answer's weight version, and the token ids of the last turn (prompt + completion, packed
      int32) that the next turn's prompt ids must extend;
    * ``writer``: the attempt_id that wrote it."""

    KIND: ClassVar[str] = "progress"
    trajectory: str
    phase: str
    step: int
    total_reward: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_json: bytes | None = None
    weight_version: str | None = None
    prev_tokens: bytes | None = None
    writer: str = ""

    #: Order of the phases within a step: a snapshot is newer than another of its trajectory
    #: when its ``seq`` is larger (writes may reach Redis out of order, the later must win).
    PHASE_ORDER: ClassVar[tuple[str, ...]] = tuple(ProgressPhase)

    @property
    def seq(self) -> int:
        return 4 * self.step + (self.PHASE_ORDER.index(self.phase) if self.phase in self.PHASE_ORDER else 0)

    @property
    def trajectory_key(self) -> tuple[int, str]:
        return attempt_key(self.trajectory) or (0, "")


_KINDS[Progress.KIND] = Progress


@dataclass
class BreakerState:
    """An open circuit breaker as a worker process publishes it (workers/breakers.py) in
    ``<prefix>:breakers``, field ``"<kind> <server> <worker>"``; readers skip entries not
    refreshed for ``BREAKER_STALE_S`` (their worker is gone or the breaker closed unseen), and
    workers remove them (``live_breaker``)."""

    kind: str  # env | model
    server: str  # base URL, password starred
    worker: str
    since: float  # epoch seconds the outage began
    error: str = ""
    trips: int = 0
    seen: float = field(default_factory=time.time)

    def hash_field(self) -> str:
        return f"{self.kind} {self.server} {self.worker}"

    def pack(self) -> bytes:
        return _packb({"kind": self.kind, "server": self.server, "worker": self.worker, "since": self.since,
                       "error": self.error, "trips": self.trips, "seen": self.seen})

    @classmethod
    def unpack(cls, raw: bytes) -> "BreakerState":
        try:
            d = msgpack.unpackb(raw, raw=False)
            return cls(**{k: d[k] for k in ("kind", "server", "worker", "since", "error", "trips", "seen")})
        except Exception as exc:  # msgpack raises several unrelated types
            raise RecordError(f"not a breaker state: {exc}") from None


BREAKER_STALE_S = 20.0


def live_breaker(raw: bytes, now: float | None = None) -> BreakerState | None:
    """The breaker an entry of ``<prefix>:breakers`` holds, or None when it is stale (not
    refreshed for ``BREAKER_STALE_S``) or unreadable: the one rule the readers and the workers
    that prune the hash go by."""
    try:
        state = BreakerState.unpack(raw)
    except RecordError:
        return None
    return state if (time.time() if now is None else now) - state.seen <= BREAKER_STALE_S else None
