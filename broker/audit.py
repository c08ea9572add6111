"""A job's audit log: every change made to a job while it lives (its limits set, an episode run
again, a pause, a resume, a cancel, a re-drive, a budget's stop), with who made it and when.

Kept in Redis as a bounded list per job (``Keys.job_audit``, newest last), given the job's
retention with its other keys, and in the results store: each entry is also an ``AuditEntry``
record on the results stream, which the consumer stores in ``job_audit``
(consumer/storage/job_audit.py) for after the run's Redis is gone. ``who`` is what the caller says (``--as NAME``, the browser's
client) or this process's user and host; it and the detail are bounded, since a browser's or a
command line's words are untrusted: an entry never grows past :data:`MAX_ENTRY_BYTES`.
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import time
import uuid
from typing import Any

import redis

from broker.control_records import AuditEntry
from broker.keys import Keys

log = logging.getLogger("interactor.audit")

MAX_ENTRIES = 1000  # per job: the oldest go first
MAX_WHO = 120  # characters of ``who``
MAX_ENTRY_BYTES = 4096  # one entry's JSON at most; a larger detail is cut and said so


def default_who() -> str:
    """This process's user at its host (what a change made from a terminal is signed with)."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in a container without a passwd entry
        user = "?"
    return f"{user}@{socket.gethostname()}"


def bounded_who(who: str | None) -> str:
    text = " ".join(str(who or "").split())  # one line: no control characters in a log line
    return text[:MAX_WHO] or default_who()


def describe(entry: dict[str, Any]) -> str:
    """One entry as one line: when (local time), who, what, the detail as ``key=value``."""
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(entry.get("at") or 0)))
    except (TypeError, ValueError, OverflowError):
        when = "?"
    detail = entry.get("detail")
    if isinstance(detail, dict):
        text = " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in detail.items())
    else:
        text = json.dumps(detail, default=str) if detail else ""
    line = f"{when}  {entry.get('who', '?')}  {entry.get('action', '?')}" + (f"  {text}" if text else "")
    return "".join(ch if ch.isprintable() else " " for ch in line)[:600]  # one line on a terminal


class JobAudit:
    """The writer and reader of every job's audit log."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r = client
        self.k = keys

    def record(self, job_id: str, action: str, detail: dict[str, Any] | None = None,
               who: str | None = None) -> dict[str, Any]:
        """Append one entry (at, who, action, detail) to ``job_id``'s log; returns it."""
        entry = {"at": round(time.time(), 3), "who": bounded_who(who), "action": str(action)[:64],
                 "detail": detail or {}}
        text = json.dumps(entry, default=str, ensure_ascii=False)
        if len(text.encode()) > MAX_ENTRY_BYTES:
            entry["detail"] = {"cut": f"detail of {len(text)} characters not kept"}
            text = json.dumps(entry, ensure_ascii=False)
        key = self.k.job_audit(job_id)
        # the id orders entries of one millisecond (the store sorts by at, then by it)
        durable = AuditEntry(job_id, f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}", entry["at"], entry["who"], entry["action"],
                             json.dumps(entry["detail"], default=str, ensure_ascii=False))
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(key, text)
        pipe.ltrim(key, -MAX_ENTRIES, -1)
        pipe.xadd(self.k.results, {"r": durable.pack()})  # the results store's copy (consumer/storage/job_audit.py)
        pipe.execute()
        log.info("job %s: %s by %s %s", job_id, entry["action"], entry["who"], text[:200])
        return entry

    def entries(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` entries, newest first; an entry that is not ours is skipped."""
        out = []
        for raw in reversed(self.r.lrange(self.k.job_audit(job_id), -max(1, int(limit)), -1)):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out
