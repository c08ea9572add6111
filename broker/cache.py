"""The response cache's store: model answers in Redis keyed by a hash of the exact request.

A job run with ``--cache`` (``JobSpec.cache``) has its model calls looked up here first
(workers/response_cache.py, a layer of the model port): an identical request of any job (or a
re-run) is answered from here. The key is :func:`request_key`, the sha256 of a canonical JSON of
what the request sends that can change the answer: the model, the messages in order, the
temperature, every other body field sent (``max_tokens``, ``top_p``, ``stop``, ``seed``,
``tools``, ``tool_choice``, an entry's own sampling...) and the job's token mode. The endpoint's
URL is not part of it: the same model behind another proxy answers alike (a server that serves
other weights under the same name is the operator's to tell apart: ``cache clear``).

Values are the answers as JSON (never pickle). The cache is bounded: at most
``cache_max_entries`` answers (a setting); each write evicts the oldest beyond it in the same
Lua script (broker/lua/cache_put.lua). Each look-up counts a hit or a miss, fleet-wide and per
job (broker/lua/cache_get.lua), which ``interactor cache stats`` and ``status`` show.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import redis

from broker.keys import Keys
from broker.lua_scripts import lua_file, lua_script

# JobSpec.cache: "" off; CACHE_ON: answers cached for a job whose every request is greedy
# (temperature 0); CACHE_SAMPLED: also for sampled requests, asked for explicitly.
CACHE_OFF, CACHE_ON, CACHE_SAMPLED = "", "on", "sampled"
CACHE_MODES = (CACHE_OFF, CACHE_ON, CACHE_SAMPLED)

_PUT = lua_script(lua_file("now") + "\n" + lua_file("cache_put"))
_GET = lua_script(lua_file("cache_get"))


def request_key(model: str, messages: list, temperature: Any, params: dict | None, tokens: str = "") -> str:
    """The cache key of one chat request: sha256 hex of its canonical JSON (keys sorted, no
    spaces). Message order matters; any sampling field's change is another key. The temperature
    is compared as a number (0 and 0.0 are one request)."""
    temp = float(temperature) if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
        else temperature
    body = {"model": model, "messages": messages, "temperature": temp, "params": params or {}, "tokens": tokens or ""}
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(raw).hexdigest()


class ResponseCache:
    """The fleet's cache in Redis, for workers (get, put) and the command line (stats, clear)."""

    def __init__(self, client: redis.Redis, keys: Keys, max_entries: int = 100_000):
        self.r = client
        self.keys = keys
        self.max_entries = max(1, int(max_entries))

    def get(self, key: str, job_id: str) -> dict | None:
        """The answer stored under ``key`` (None: a miss); the look-up counted for ``job_id``."""
        k = self.keys
        raw = _GET(keys=[k.cache_answers, k.cache_stats, k.job_cache(job_id)], args=[key], client=self.r)
        if raw is None:
            return None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return answer if isinstance(answer, dict) else None

    def put(self, key: str, answer: dict) -> int:
        """Store ``answer`` under ``key``; the number of older answers evicted to stay in bounds."""
        k = self.keys
        return int(_PUT(keys=[k.cache_answers, k.cache_order, k.cache_stats],
                        args=[key, orjson.dumps(answer), self.max_entries], client=self.r))

    def stats(self) -> dict[str, int]:
        """entries, bytes, hits, misses, evicted: the fleet's cache as a whole."""
        k = self.keys
        with self.r.pipeline(transaction=False) as p:
            p.hlen(k.cache_answers)
            p.hgetall(k.cache_stats)
            entries, raw = p.execute()
        counts = {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in raw.items()}
        return {"entries": int(entries), "bytes": counts.get("bytes", 0), "hits": counts.get("hits", 0),
                "misses": counts.get("misses", 0), "evicted": counts.get("evicted", 0),
                "max_entries": self.max_entries}

    def job_counts(self, job_id: str) -> dict[str, int]:
        """hits and misses of one job's look-ups ({} when it made none)."""
        raw = self.r.hgetall(self.keys.job_cache(job_id))
        return {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in raw.items()}

    def clear(self) -> int:
        """Drop every answer and the fleet's counters; the number of answers dropped."""
        k = self.keys
        with self.r.pipeline(transaction=True) as p:
            p.hlen(k.cache_answers)
            p.delete(k.cache_answers, k.cache_order, k.cache_stats)
            entries, _ = p.execute()
        return int(entries)
