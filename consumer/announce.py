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
        self.errors = 0  # groups whose announcement failed on their data
        self._noted: set[str] = set()  # feed jobs whose store this process has recorded
        self._backfilled: dict[str, int] = {}  # job -> its settled groups' count at the last backfill

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
                if rec.job_id not in self._noted:
                    self._note_store(rec.job_id)
        return self.announce_groups(sorted(touched)) if touched else 0

    def _note_store(self, job_id: str) -> None:
        """Say where this job's results are written (once per job and process): a feed server
        reading another store would find no steps, and refuses to serve instead."""
        mine = self.store.identity
        before = self.r.set(self.keys.job_store(job_id), mine, get=True)
        before = before.decode() if isinstance(before, bytes) else before
        if before not in (None, mine):
            log.error("job %s: its results were recorded as written to %s; this consumer writes them to %s "
                      "(a feed server reads the store named last)", job_id, before, mine)
        self._noted.add(job_id)

    def after_failure(self, job_id: str, episode_id: str) -> int:
        """An episode the consumer failed outside a batch (its steps were lost): its group is
        announced if that settled it."""
        if not feed.has_feed(self.r, self.keys, job_id):
            return 0
        group_id = (self.store.episode(episode_id) or {}).get("group_id")
        return self.announce_groups([group_id]) if group_id else 0

    def backfill(self, job_id: str) -> int:
        """Announce the settled groups of the job the store knows and the feed has not (a feed
        attached to a running job, a group settled outside a batch, or an announcement a Redis
        failover lost). What it costs is bounded by what is new: a round in which no group
        settled and none lost its marker is one count and one HLEN; otherwise the settled
        ids are checked against the announcement markers in one read per thousand, and only
        the groups missing there are read from the store and announced."""
        count = self.store.settled_group_count(job_id)
        seen_key = self.keys.feed_seen(job_id)
        # Nothing new settled, and the feed still marks at least as many groups announced: a
        # failover that lost announcements (broker/replicas.py) lost their markers with them.
        if self._backfilled.get(job_id) == count and self.r.hlen(seen_key) >= count:
            return 0
        ids = self.store.settled_group_ids(job_id)
        missing: list[str] = []
        for i in range(0, len(ids), 1000):
            chunk = ids[i:i + 1000]
            missing += [gid for gid, entry in zip(chunk, self.r.hmget(seen_key, chunk)) if entry is None]
        n = self.announce_groups(missing) if missing else 0
        self._backfilled[job_id] = count
        return n

    def announce_groups(self, group_ids: list[str]) -> int:
        n = 0
        for gid, g in self.store.feed_groups(group_ids).items():
            try:
                n += self._announce(gid, g)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # an outage: the caller's batch is re-delivered, and announcing is idempotent
            except Exception as exc:  # noqa: BLE001 - one group's data never stops the fleet's consumer
                n += self._unannounceable(gid, g, exc)
        self.announced += n
        return n

    def _announce(self, gid: str, g: dict) -> int:
        group = settled_group(g)
        if group is None:
            return 0
        if feed.announce(self.r, self.keys, group.pack(), group.job_id, gid):
            log.debug("group %s announced to the feed (%s)", gid, group.status)
            return 1
        return 0

    def _unannounceable(self, gid: str, g: dict, exc: Exception) -> int:
        """A settled group whose announcement failed on its data: counted, and announced as
        failed with the reason, so that the trainer is told and the feed's count of groups in
        flight still ends (a group never announced would hold the producer back for good)."""
        self.errors += 1
        job_id = str(g.get("job_id") or "")
        log.exception("group %s of job %s could not be announced to the feed; reported as failed", gid, job_id)
        try:
            self.r.hincrby(self.keys.feed_stats(job_id), feed.C_ANNOUNCE_ERRORS, 1)
            members = [str(m[0]) for m in g.get("members") or []]
            group = FeedGroup(job_id=job_id, group_id=gid, members=members, rewards=[],
                              size=int(g.get("size") or len(members)), status=FeedGroupStatus.FAILED,
                              reason=f"could not be announced: {type(exc).__name__}: {str(exc)[:200]}")
            return 1 if feed.announce(self.r, self.keys, group.pack(), job_id, gid) else 0
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception:  # noqa: BLE001 - logged above; the batch goes on
            log.exception("group %s: reporting it as failed failed too; it stays unannounced", gid)
            return 0


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
