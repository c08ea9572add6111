"""Adaptive concurrency's rule (broker/lua/caps_adapt.lua) and a cap's live limit (broker/caps.py)
against a real Redis; the flag's parsing without one. The whole thing in real worker processes
against a server that answers 429: tests/test_adaptive_concurrency.py."""

from __future__ import annotations

import time

import pytest

from broker.adaptive import AdaptiveCaps, Concurrency, parse_concurrency
from broker.caps import CAP_MODEL, Cap, FleetSlots
from broker.keys import Keys
from broker.redisconn import connect
from workers.fleetcaps import FleetGate


@pytest.mark.unit
def test_parse_concurrency_names_what_is_wrong():
    assert parse_concurrency("8") == Concurrency(fixed=8)
    assert parse_concurrency("auto") == Concurrency(low=1, high=256) and parse_concurrency("auto").start == 20
    assert parse_concurrency("auto:2-9").start == 9 and parse_concurrency("AUTO:30-40").start == 30
    for bad, words in (("auto:9-3", "1 <= MIN <= MAX"), ("auto:x", "auto:MIN-MAX"), ("auto:0-4", "MIN=0"),
                       ("eight", "a number, auto or auto:MIN-MAX")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            parse_concurrency(bad)


def test_aimd_grows_with_demand_only_and_cuts_once_per_cooldown(settings):
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    ad = AdaptiveCaps(client, keys)
    cap = keys.cap(CAP_MODEL, "http://m-aimd")
    assert ad.configure(cap, 2, 6, 4, "start") == 4
    assert ad.report(cap, 4, successes=50, demand=False) == (4, False), "no demand: healthy answers do not grow it"
    assert ad.report(cap, 4, successes=3, demand=True) == (4, False)
    assert ad.report(cap, 4, successes=1, demand=True) == (5, True), "+1 per window of `limit` successes"
    assert ad.state(cap)["reason"] == "+1: 4 ok at 4"
    assert ad.report(cap, 4, overload="HTTP 429") == (4, True), "x0.8, floored"
    assert ad.report(cap, 4, overload="HTTP 503") == (4, False), "a second overload within the cooldown: no cut"
    assert ad.state(cap)["reason"] == "x0.8: HTTP 429"
    time.sleep(0.02)
    assert ad.report(cap, 4, overload="read timeout", cooldown_ms=10) == (3, True)
    assert ad.report(cap, 4, overload="HTTP 429", cooldown_ms=0) == (2, True)
    assert ad.report(cap, 4, overload="HTTP 429", cooldown_ms=0) == (2, False), "never below MIN"
    assert ad.report(cap, 4, successes=10, demand=True) == (2, False), "no growth within a cooldown of a cut"
    for _ in range(20):
        ad.report(cap, 4, successes=10, demand=True, cooldown_ms=0)
    assert int(client.hget(keys.caps, cap)) == 6, "never above MAX"
    assert [c["limit"] for c in ad.history(cap)] == [4, 5, 4, 3, 2, 3, 4, 5, 6]
    ad.fix(cap, 3, "set: 3 by someone")
    assert ad.report(cap, 4, overload="HTTP 429", cooldown_ms=0) == (-1, False), "a fixed cap does not adapt"
    assert int(client.hget(keys.caps, cap)) == 3 and ad.last_change(cap)["reason"] == "set: 3 by someone"


def test_a_lowered_live_limit_makes_holders_give_back_to_their_share(settings):
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    slots = FleetSlots(client, keys, ttl_ms=3000)
    cap = Cap.of(keys, CAP_MODEL, "http://m-live", 10)  # the spec says 10
    slots.register([cap])
    gates = [FleetGate(FleetSlots(connect(settings), keys, ttl_ms=3000), f"g{i}", ttl_s=3.0, renew_s=0.2)
             for i in range(2)]
    tokens = [[g.acquire([cap], lambda: None, None) for _ in range(5)] for g in gates]
    assert sum(u["in_use"] for u in slots.use()) == 10
    client.hset(keys.caps, cap.key, 4)  # lowered while they hold 10
    assert slots.take([cap], "newcomer", 1) == (0, 0), "a take reads the live limit"
    for g, held in zip(gates, tokens):  # the calls end one by one: each pool keeps its share (2)
        for token in held:
            g.release([cap], token)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and sum(u["in_use"] for u in slots.use()) > 4:
        time.sleep(0.05)
    assert sum(u["in_use"] for u in slots.use()) <= 4
    client.hset(keys.caps, cap.key, 12)
    assert slots.take([cap], "newcomer", 20)[0] >= 8, "a raised limit has room at once"
    slots.give([cap], "newcomer", 20)
    for g in gates:
        g.stop()


def test_job_set_writes_live_limits_workers_read_and_refuses_a_finished_job(settings, tmp_path):
    """`job set`'s effect as a worker sees it (workers/adaptive_caps.py LiveLimits, the rates a
    pacer uses), its audit entry, and its refusals; the end-to-end holds in real workers:
    tests/test_adaptive_concurrency.py."""
    from broker.audit import JobAudit
    from broker.caps import Limits
    from interactor.job_set import SetRefused, set_limits
    from producer.enqueue import submit
    from tests.test_fleet_limits import arith_job
    from workers.adaptive_caps import LiveLimits

    client = connect(settings)
    keys = Keys(settings.key_prefix)
    settings = settings.replace(llm_base_url="http://127.0.0.1:9/v1", llm_fleet_rpm=600)
    job = submit(client, settings, [arith_job(tmp_path, "http://127.0.0.1:9", 3)]).job
    live = LiveLimits(client, keys, ttl_s=0)
    spec = Limits.from_dict(job.limits)
    assert live.over(job.job_id, spec) == spec and live.rates(job.job_id, 600, 0) == (600, 0)
    out = set_limits(client, settings, job.job_id, concurrency="auto:2-8", rpm=120, who="ops")
    assert out["set"] == {"concurrency": "auto:2-8", "model_rpm": 120}
    assert "episodes that start from now on" in " ".join(out["said"]), "the job had no model cap: said so"
    now = live.over(job.job_id, spec)
    assert (now.model, now.model_auto, now.model_rpm) == (8, "2-8", 120) and live.rates(job.job_id, 600, 0) == (120, 0)
    cap = keys.cap(CAP_MODEL, "http://127.0.0.1:9/v1")
    assert int(client.hget(keys.caps, cap)) == 8 and AdaptiveCaps(client, keys).state(cap)["low"] == 2
    set_limits(client, settings, job.job_id, concurrency="5")
    assert AdaptiveCaps(client, keys).state(cap) is None and live.over(job.job_id, spec).model == 5
    assert [e["who"] for e in JobAudit(client, keys).entries(job.job_id)][:2][-1] == "ops"
    with pytest.raises(SetRefused, match="must be >= 1"):
        set_limits(client, settings, job.job_id, concurrency="0")
    client.hset(keys.job_counts(job.job_id), mapping={"queued": 0, "done": 3})
    with pytest.raises(SetRefused, match="finished"):
        set_limits(client, settings, job.job_id, concurrency="4")
    client.hset(keys.job_limits(job.job_id), "model", "lots")  # written by someone else: no limit, no crash
    assert live.over(job.job_id, spec).model == spec.model == 0, "a model field not a number: the spec's"
