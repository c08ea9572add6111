"""The consumer's side of the online-RL feed: announce each group of a feed job once every
member is settled (broker/feed.py has the contract).

Called after a batch is committed and before its stream entries are acknowledged: a crash in
between re-delivers the batch, the store's writes are idempotent, and the announcement is
too (a marker per group, set in the same script as the XADD). Reading the group back from
the store, rather than from the batch, is what makes that true: a group's last member may
complete in a batch that holds only a late step of it.

A group is settled when all ``size`` members are completed (``ready``) or some failed and the
rest completed (``failed``, with the first failure's reason): never left pending.
"""

from __future__ import annotations

import logging

import redis

from broker import feed
from broker.keys import Keys
from broker.records import AttemptRecord, FeedGroup, StepRecord
from broker.states import FeedGroupStatus, StoredStatus

log = logging.getLogger("interactor.feed")


class FeedAnnouncer:
    def __init__(self, client: redis.Redis, keys: Keys, store):
        self.r = client
        self.keys = keys
        self.store = store
        self.announced = 0

    def after_commit(self, records) -> int:
        """Announce the settled groups among those ``records`` touch (feed jobs only)."""
        feeds = None
        touched: set[str] = set()
        for rec in records:
            t = type(rec)
            if t is not StepRecord and t is not AttemptRecord:
                continue
            if feeds is None:
                feeds = {m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(self.keys.feeds)}
                if not feeds:
                    return 0
            if rec.job_id in feeds and rec.group_id:
                touched.add(rec.group_id)
        return self.announce_groups(sorted(touched)) if touched else 0

    def backfill(self, job_id: str) -> int:
        """Announce every settled group of the job the store knows (those announced are skipped)."""
        return self.announce_groups(self.store.settled_group_ids(job_id))

    def announce_groups(self, group_ids: list[str]) -> int:
        n = 0
        for gid, g in self.store.feed_groups(group_ids).items():
            group = settled_group(g)
            if group is None:
                continue
            if feed.announce(self.r, self.keys, group.pack(), group.job_id, gid):
                n += 1
                log.debug("group %s announced to the feed (%s)", gid, group.status)
        self.announced += n
        return n


def settled_group(g: dict) -> FeedGroup | None:
    """The group as the feed announces it, or None while a member may still run."""
    size = int(g.get("size") or 0)
    members = g["members"]
    done = [m for m in members if m[1] == StoredStatus.COMPLETED]
    failed = [m for m in members if m[1] == StoredStatus.FAILED]
    if size <= 0 or len(done) + len(failed) < size:
        return None
    versions = [v for v in (feed.parse_version(x) for x in g["versions"]) if v is not None]
    common = dict(job_id=g["job_id"], group_id=g["group_id"], members=[m[0] for m in members],
                  rewards=[m[2] for m in done], size=size,
                  oldest_version=min(versions) if versions else None,
                  newest_version=max(versions) if versions else None)
    if failed:
        ep, _, _, reason = failed[0]
        why = f"episode {ep} failed: {reason or 'unknown'}" + (f" (+{len(failed) - 1} more)" if len(failed) > 1 else "")
        return FeedGroup(status=FeedGroupStatus.FAILED, reason=why, **common)
    return FeedGroup(status=FeedGroupStatus.READY, **common)
