"""A job's audit log (broker/audit.py) against a real Redis: entries newest first, who bounded
to one line, a detail too large cut, an entry that is not ours skipped, the log bounded."""

from __future__ import annotations

import json

from broker import audit
from broker.audit import JobAudit
from broker.keys import Keys


def test_entries_come_back_newest_first_with_who_and_when(redis_client):
    log = JobAudit(redis_client, Keys("t-audit"))
    log.record("j1", "set", {"concurrency": 8}, who="alice")
    log.record("j1", "cancel", who="bob\n\x1b[31m  at  desk")
    got = log.entries("j1")
    assert [e["action"] for e in got] == ["cancel", "set"]
    assert got[1]["detail"] == {"concurrency": 8} and got[1]["who"] == "alice"
    assert got[0]["who"] == "bob \x1b[31m at desk"  # one line; the browser escapes what it shows
    assert got[0]["at"] >= got[1]["at"] > 0
    assert log.entries("other") == []


def test_defaults_bounds_and_foreign_entries(redis_client, monkeypatch):
    keys = Keys("t-audit2")
    log = JobAudit(redis_client, keys)
    assert log.record("j", "resume")["who"] == audit.default_who()
    big = log.record("j", "set", {"x": "y" * 10_000}, who="w" * 500)
    assert len(big["who"]) == audit.MAX_WHO and "not kept" in big["detail"]["cut"]
    redis_client.rpush(keys.job_audit("j"), b"\xff not json", json.dumps([1, 2]))
    assert [e["action"] for e in log.entries("j")] == ["set", "resume"]
    monkeypatch.setattr(audit, "MAX_ENTRIES", 3)
    for i in range(5):
        log.record("j", f"a{i}")
    assert [e["action"] for e in log.entries("j", limit=10)] == ["a4", "a3", "a2"]
    assert keys.job_audit("j") in keys.job_keys("j")  # given the job's retention with its other keys
