"""A take is a set, and the feed loses nothing: a seeded random driver interleaves, on real
Redis, announcements, takes, acks (some naming groups the trainer no longer holds), ack
timeouts passing, stale groups re-queued or dropped as versions move, filtered and failed
groups, trainers that die holding groups, answers that never reached their trainer, and feed
server restarts, for thousands of operations. After each one it checks:

* no answer holds a group twice (also when the ack timeout of what a take read passes while it
  still waits for its batch), and every group in an answer is held by its taker;
* nothing acknowledged is ever handed out again;
* nothing held is lost: every announced group is ready, held by one trainer, or settled once
  (and the feed's counters say so: read = held + settled, announced = read + ready).
"""

from __future__ import annotations

import random
import threading

import pytest

from broker import feed
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import FeedGroup, JobSpec
from broker.states import FeedGroupStatus
from interactor.feed_service import COMPAT_TRAINER, FeedService

pytestmark = pytest.mark.integration

JOB = "interleaved"
TRAINERS = ["t1", "t2", "t3", COMPAT_TRAINER]


class Driver:
    def __init__(self, settings, client, seed: int):
        self.rng = random.Random(seed)
        self.r = client
        self.settings = settings.replace(feed_max_staleness=1, feed_stale_policy=feed.STALE_REQUEUE,
                                         feed_drop_uniform=True, feed_refill_max=1, feed_ack_timeout_s=30.0)
        self.keys = Keys(settings.key_prefix)
        Ledger.for_settings(client, settings).create_job(
            JobSpec(job_id=JOB, llm_base_url="http://llm/v1", model="m", episodes=0, groups=0), [])
        feed.enable(client, self.keys, JOB, feed.FeedConfig.from_settings(self.settings))
        cfg = feed.config(client, self.keys, JOB)
        cfg.max_ahead = 64
        feed.enable(client, self.keys, JOB, cfg)
        self.svc = FeedService(client, self.settings, JOB)
        self.version = 0
        feed.set_version(client, self.keys, JOB, 0)
        self.announced: list[str] = []
        self.acked: set[str] = set()
        # What each trainer holds within its ack timeout (must stay its own until it acks), and
        # what it held when the timeout passed (may have gone to another take since).
        self.holding: dict[str, set[str]] = {t: set() for t in TRAINERS}
        self.expired: dict[str, set[str]] = {t: set() for t in TRAINERS}
        self.delivered_after_ack: list[str] = []
        self.ops = 0

    # --- operations -----------------------------------------------------------------------
    def announce(self) -> None:
        gid = f"g{len(self.announced) + 1}"
        kind = self.rng.random()
        status, rewards, reason = FeedGroupStatus.READY, [self.rng.random(), self.rng.random()], ""
        if kind < 0.1:
            status, reason = FeedGroupStatus.FAILED, "episode x failed: env_bad_request"
        elif kind < 0.2:
            rewards = [0.5, 0.5]  # uniform: filtered
        oldest = self.version - self.rng.choice([0, 0, 0, 1, 2])
        g = FeedGroup(job_id=JOB, group_id=gid, status=status, members=[f"{gid}.1", f"{gid}.2"], rewards=rewards,
                      size=2, oldest_version=max(0, oldest), newest_version=self.version, reason=reason)
        assert feed.announce(self.r, self.keys, g.pack(), JOB, gid)
        assert not feed.announce(self.r, self.keys, g.pack(), JOB, gid)  # once
        self.announced.append(gid)

    def take(self, trainer: str) -> None:
        answer = self.svc.take(trainer, self.rng.randint(1, 4), 0)
        ids = [g["group_id"] for g in answer]
        assert len(ids) == len(set(ids)), f"one answer held a group twice: {ids}"
        for gid in ids:
            if gid in self.acked:
                self.delivered_after_ack.append(gid)
            assert self.holder(gid) == trainer, (gid, self.holder(gid), trainer)
            for other in self.expired.values():
                other.discard(gid)  # handed out again after its timeout: the old holder lost it
            assert all(gid not in h for h in self.holding.values()), f"{gid} handed out within its ack timeout"
        if self.rng.random() < 0.1:  # the answer never reached the trainer
            self.svc.give_back(trainer, ids)
        else:
            self.holding[trainer] |= set(ids)

    def ack(self, trainer: str) -> None:
        held = sorted(self.holding[trainer] | self.expired[trainer])
        ids = self.rng.sample(held, self.rng.randint(0, len(held))) if held else []
        if self.announced and self.rng.random() < 0.3:
            ids.append(self.rng.choice(self.announced))  # one it may not hold (late, or never had)
        try:
            out = self.svc.ack(trainer, ids)
            refused = {}
        except feed.FeedError as exc:
            out, refused = exc.extra, exc.extra.get("refused", {})
            assert exc.status == 404 and refused
        for gid in out.get("acked", []):
            assert gid not in self.acked, f"{gid} acknowledged twice"
            self.acked.add(gid)
        for gid in ids:
            if gid in self.holding[trainer]:
                assert gid not in refused, f"{gid}: held by {trainer} within its ack timeout, yet refused"
                assert gid in self.acked, f"{gid}: held by {trainer}, acknowledged, yet not settled"
            self.holding[trainer].discard(gid)
            self.expired[trainer].discard(gid)

    def age_pending(self) -> None:
        """What the clock does to the stream when the ack timeout passes: each pending entry
        made idle past the timeout, its holder kept."""
        stream = self.keys.feed_stream(JOB)
        for p in self.r.xpending_range(stream, feed.TRAINERS, "-", "+", 1000):
            holder = p["consumer"].decode() if isinstance(p["consumer"], bytes) else p["consumer"]
            self.r.xclaim(stream, feed.TRAINERS, holder, 0, [p["message_id"]], idle=31_000, justid=True)

    def ack_timeout_passes(self) -> None:
        self.age_pending()
        for trainer, held in self.holding.items():
            self.expired[trainer] |= held
            held.clear()

    def take_while_the_clock_runs(self, trainer: str) -> None:
        """A take that is still waiting for its batch when the ack timeout of what it already
        read passes: it must not claim those groups a second time into its own answer."""
        aged = threading.Event()
        ager = threading.Timer(0.05, lambda: (self.age_pending(), aged.set()))
        ager.start()
        try:
            # longer than one blocking read (1 s), so that the take looks for claimable groups
            # again after the clock passed
            answer = self.svc.take(trainer, 4, 1.2)
            answered_after_the_clock = aged.is_set()  # else the answer's own ack timeout passed too
        finally:
            ager.join()
        ids = [g["group_id"] for g in answer]
        assert len(ids) == len(set(ids)), f"one answer held a group twice: {ids}"
        assert not self.acked & set(ids), f"acknowledged, then handed out again: {self.acked & set(ids)}"
        for other in (*self.holding.values(), *self.expired.values()):
            other -= set(ids)
        for t, held in self.holding.items():  # the clock passed for everyone
            self.expired[t] |= held
            held.clear()
        (self.holding if answered_after_the_clock else self.expired)[trainer] |= set(ids)

    def trainer_dies(self, trainer: str) -> None:
        self.holding[trainer] = set()
        self.expired[trainer] = set()

    def version_moves(self) -> None:
        self.version += 1
        feed.set_version(self.r, self.keys, JOB, self.version)

    def feed_restarts(self) -> None:
        self.svc = FeedService(self.r, self.settings, JOB)

    def step(self) -> None:
        self.ops += 1
        trainer = self.rng.choice(TRAINERS)
        x = self.rng.random()
        if x < 0.25:
            self.announce()
        elif x < 0.55:
            self.take(trainer)
        elif x < 0.75:
            self.ack(trainer)
        elif x < 0.83:
            self.ack_timeout_passes()
        elif x < 0.84:
            self.take_while_the_clock_runs(trainer)
        elif x < 0.88:
            self.trainer_dies(trainer)
        elif x < 0.94:
            self.version_moves()
        else:
            self.feed_restarts()
        self.check()

    # --- what must hold after every operation ---------------------------------------------
    def holder(self, gid: str) -> str | None:
        entry = self.r.hget(self.keys.feed_seen(JOB), gid).decode()
        return self.svc._holder(self.keys.feed_stream(JOB), entry)

    def check(self) -> None:
        assert not self.delivered_after_ack, f"acknowledged, then handed out again: {self.delivered_after_ack}"
        stream = self.keys.feed_stream(JOB)
        c = feed.counters(self.r, self.keys, JOB)
        pending = int(self.r.xpending(stream, feed.TRAINERS)["pending"])
        last = [g for g in self.r.xinfo_groups(stream) if g["name"] in (feed.TRAINERS, feed.TRAINERS.encode())][0]
        last_id = last["last-delivered-id"]
        last_id = last_id.decode() if isinstance(last_id, bytes) else last_id
        ready = len(self.r.xrange(stream, min=f"({last_id}", max="+")) if last_id != "0-0" else self.r.xlen(stream)
        read, settled = int(c.get(feed.C_READ, 0)), int(c.get(feed.C_SETTLED, 0))
        assert int(c.get(feed.C_ANNOUNCED, 0)) == len(self.announced) == read + ready, (c, ready)
        assert read == pending + settled, f"a group read is neither held nor settled: {c}, pending {pending}"
        assert int(c.get(feed.C_ACKED, 0)) == len(self.acked)
        for trainer, held in self.holding.items():
            for gid in held:  # what a trainer holds within its ack timeout is still its own
                assert self.holder(gid) == trainer, f"{gid} held by {trainer}: now {self.holder(gid)}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_takes_acks_timeouts_restarts_and_deaths_interleaved(settings, redis_client, seed):
    d = Driver(settings.replace(key_prefix=f"{settings.key_prefix}s{seed}"), redis_client, seed)
    for _ in range(1500):
        d.step()
    # Drain: the clock passes, and one trainer takes and acknowledges whatever is left.
    d.ack_timeout_passes()
    d.holding["drain"], d.expired["drain"] = set(), set()
    for _ in range(200):
        d.take("drain")
        d.ack("drain")
        c = feed.counters(d.r, d.keys, JOB)
        if not d.r.xpending(d.keys.feed_stream(JOB), feed.TRAINERS)["pending"] and c[feed.C_READ] == len(d.announced):
            break
    c = feed.counters(d.r, d.keys, JOB)
    assert int(c[feed.C_READ]) == int(c[feed.C_SETTLED]) == int(c[feed.C_ANNOUNCED]) == len(d.announced)
    outcomes = {k: int(v) for k, v in c.items() if k in (feed.C_ACKED, feed.C_FAILED, feed.C_STALE_REQUEUED,
                                                           feed.C_STALE_DROPPED) or k.startswith(feed.C_FILTERED)}
    assert sum(outcomes.values()) == len(d.announced), outcomes
    assert all(outcomes.get(k) for k in (feed.C_ACKED, feed.C_FAILED, feed.C_STALE_REQUEUED)), outcomes
    assert d.ops >= 1500
