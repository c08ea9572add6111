"""Stamp each model call of a feed job with the trainer's policy version (broker/feed.py).

The version in effect when the request was *sent* is what staleness is measured from, so it is
read right before the call: one GET, and only for jobs that have a feed. Whether a job has one
is asked at most every ``CHECK_S`` seconds per job (a feed can be attached to a running job),
so a job without a feed costs nothing per step.
"""

from __future__ import annotations

import logging
import time

import redis

from broker import feed
from broker.keys import Keys

log = logging.getLogger("interactor.versions")

CHECK_S = 2.0


class PolicyVersions:
    """Per worker process: which jobs have a feed (cached), and the current version of one."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self._has: dict[str, tuple[bool, float]] = {}

    def has_feed(self, job_id: str) -> bool:
        now = time.monotonic()
        cached = self._has.get(job_id)
        if cached is None or now - cached[1] > CHECK_S:
            try:
                cached = (feed.has_feed(self.r, self.keys, job_id), now)
            except redis.RedisError:
                cached = (cached[0] if cached else False, now)
            if len(self._has) > 1024:
                self._has.clear()
            self._has[job_id] = cached
        return cached[0]

    def wrap(self, policy, job_id: str):
        return VersionedPolicy(policy, self, job_id) if self.has_feed(job_id) else policy


class VersionedPolicy:
    """A policy port whose completions carry ``policy_version`` (workers/loop.py records it)."""

    def __init__(self, inner, versions: PolicyVersions, job_id: str):
        self.inner = inner
        self.versions = versions
        self.job_id = job_id

    def complete(self, messages, **request):
        try:
            version = feed.current_version(self.versions.r, self.versions.keys, self.job_id)
        except redis.RedisError as exc:  # the step is still worth having; it is recorded unversioned
            log.warning("job %s: reading the policy version failed (%s); step recorded without one", self.job_id, exc)
            version = None
        completion = self.inner.complete(messages, **request)
        if completion is not None:
            completion.policy_version = version
        return completion
