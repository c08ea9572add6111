"""The record schemas every role shares, defined once and versioned.

* :class:`JobSpec`     - one per job: the policy and loop settings the producer chose.
* :class:`EpisodeSpec` - one per episode: what to reset, with which params and seed.
* :class:`StepRecord`  - one per step, published to the results stream as it happens.
* :class:`AttemptRecord` - one per attempt, closing it: completed, retrying, failed or abandoned.

All travel as msgpack maps with ``kind`` and ``v`` (schema version). A reader accepts any
record whose version it knows and ignores fields it does not (so a newer writer can add one).
"""

from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})


class RecordError(ValueError):
    """A record that cannot be decoded; the message names the field at fault."""


# Ledger states of an episode (see broker/ledger.py).
QUEUED, RUNNING, RETRYING, DONE, FAILED = "queued", "running", "retrying", "done", "failed"
LEDGER_STATES = (QUEUED, RUNNING, RETRYING, DONE, FAILED)
TERMINAL_STATES = (DONE, FAILED)

# Outcomes of one attempt (AttemptRecord.status).
COMPLETED = "completed"  # the episode ended normally; its trajectory is this attempt's
ATTEMPT_RETRYING = "retrying"  # transient failure; a fresh attempt is scheduled
ATTEMPT_FAILED = "failed"  # permanent failure or attempts exhausted: dead-lettered
ABANDONED = "abandoned"  # lease lost or handed back at shutdown; another attempt takes over
ATTEMPT_STATUSES = (COMPLETED, ATTEMPT_RETRYING, ATTEMPT_FAILED, ABANDONED)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


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
        kwargs = {}
        for f in fields(cls):
            if f.name in d:
                kwargs[f.name] = d[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise RecordError(f"{cls.KIND}: missing field {f.name!r}")
        return cls(**kwargs)

    def pack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)



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


@dataclass
class EpisodeSpec(_Record):
    KIND: ClassVar[str] = "episode_spec"
    job_id: str
    episode_id: str  # the protocol's env_id and the model session id
    group_id: str
    group_size: int
    env_name: str
    base_url: str
    env_params: dict[str, Any]  # the entry's params plus "dataset": <row> when there is one
    seed: int | None = None
    queue: str = ""
    source: str = ""  # "file.yaml entry 2 row 17", for error messages and the DLQ
    transport: str = "http"  # "http" (base_url) or "inproc" (env_class run inside the worker)
    env_class: str = ""  # "module:Class" for the inproc transport


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
    messages: list[Any]  # the messages actually sent to the model
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


@dataclass
class AttemptRecord(_Record):
    KIND: ClassVar[str] = "attempt"
    job_id: str
    episode_id: str
    attempt: int
    status: str  # one of ATTEMPT_STATUSES
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

    @property
    def duration_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


_KINDS = {cls.KIND: cls for cls in (JobSpec, EpisodeSpec, StepRecord, AttemptRecord)}


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
