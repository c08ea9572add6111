"""The model port's response-cache layer: a job run with ``--cache`` has identical requests answered from the cache.

:class:`CachedPolicy` looks each request up in the fleet's cache (broker/cache.py) by the key of
what the call would send (the job's model, the messages, the temperature and body fields as
workers/ports.py ``sent_sampling`` makes them, the token mode). A hit is answered at once as a
:class:`~workers.modelclient.Completion` marked ``cached`` (``latency_s`` 0, ``attempts`` 0), and
goes through the rest of the step loop as any answer does (recorded as a step with
``cached: true``). A miss calls the port it wraps and stores the answer. A Redis error on the
way is logged and the call goes to the model as if there were no cache: the cache may save work,
never fail an episode.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import redis

from broker.cache import request_key
from workers.modelclient import Completion
from workers.ports import sent_sampling
from workers.token_answers import TokenAnswer

log = logging.getLogger("interactor.cache")

# What of a Completion is stored: the answer as the model gave it, not how long it took.
_STORED = ("content", "finish_reason", "weight_version", "prompt_tokens", "completion_tokens", "tool_calls",
           "reasoning_content")


def answer_of(completion: Completion) -> dict:
    """What the cache stores of an answer (JSON-able: the token answer as a map)."""
    out = {name: getattr(completion, name, None) for name in _STORED}
    tokens = getattr(completion, "tokens", None)
    out["tokens"] = dataclasses.asdict(tokens) if tokens is not None else None
    return out


def completion_of(answer: dict) -> Completion:
    """A stored answer as the step loop takes it, marked ``cached``."""
    tokens = answer.get("tokens")
    known = {f.name for f in dataclasses.fields(TokenAnswer)}
    completion = Completion(
        content=answer.get("content") or "", finish_reason=answer.get("finish_reason") or "stop",
        weight_version=answer.get("weight_version"), latency_s=0.0, attempts=0,
        prompt_tokens=answer.get("prompt_tokens"), completion_tokens=answer.get("completion_tokens"),
        tokens=TokenAnswer(**{k: v for k, v in tokens.items() if k in known}) if isinstance(tokens, dict) else None,
        tool_calls=answer.get("tool_calls"), reasoning_content=answer.get("reasoning_content") or "")
    completion.cached = True  # type: ignore[attr-defined]  # the step record's `cached`
    return completion


class CachedPolicy:
    """A policy port answering from the response cache what it has, the model the rest."""

    def __init__(self, inner: Any, cache: Any, job: Any, sampling: dict | None):
        self.inner = inner
        self.cache = cache
        self.job = job
        self.sampling = dict(sampling or {})

    def key(self, messages: list, request: dict) -> str:
        j = self.job
        temperature, params = sent_sampling(j, self.sampling, request)
        return request_key(j.model, messages, temperature, params, getattr(j, "tokens", "") or "")

    def complete(self, messages: list, **request: Any):
        key = self.key(messages, request)
        try:
            answer = self.cache.get(key, self.job.job_id)
        except redis.RedisError as exc:
            log.warning("job %s: the response cache could not be read (%s); asking the model", self.job.job_id, exc)
            answer = None
        if answer is not None:
            return completion_of(answer)
        completion = self.inner.complete(messages, **request)
        if completion is not None and completion.finish_reason != "error":
            try:
                self.cache.put(key, answer_of(completion))
            except (redis.RedisError, TypeError, ValueError) as exc:
                log.warning("job %s: an answer could not be cached (%s)", self.job.job_id, exc)
        return completion
