"""Delivering a job's feed to trainers: take, acknowledge, versions, statistics, and the
original system's ``/get_rollout_data`` shape (docs/protocol.md, "The rollout feed").

The contract and its atomic steps are in broker/feed.py; this module decides, per group read
from the stream, whether it goes to the trainer:

* a failed group (a member dead-lettered) is reported: counted, kept in the failures list the
  trainer reads in stats, or run again as fresh episodes (``failed_policy=refill``);
* a stale group (oldest step more than ``max_staleness`` versions behind the current one) is
  re-queued as fresh episodes of the same tasks, or dropped, and counted;
* a filtered group (``drop_uniform``, the user filter) is counted by reason;
* the rest are handed over with their samples (trajectories, rewards, GRPO advantages), read
  from the results store. A take waits up to its timeout to fill the batch, so filtered groups
  are replaced by the next ones (over-sampling).

A group taken and not acknowledged within ``ack_timeout_s`` is claimed (XCLAIM) by the next
take, whichever trainer makes it: the one that took it too (restarted under the same name).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import msgpack
import redis

from broker import feed
from broker.keys import Keys
from broker.records import FeedGroup, RecordError, unpack
from broker.replicas import ReplicaWait
from broker.settings import Settings, redact_url
from broker.states import FeedGroupStatus
from consumer.announce import FeedAnnouncer
from consumer.storage.group_stats import group_stats, reward_mean_std
from envs.base import import_object, valid_object_path
from workers.allowlist import PathAllowlist

log = logging.getLogger("interactor.feed")

MAX_TIMEOUT_S = 300.0
COMPAT_TRAINER = "rollout-compat"  # the trainer name /get_rollout_data takes as


def load_filter(path: str, allowed: str) -> Callable[[dict], bool] | None:
    """The user filter, allow-listed exactly as episode hooks are (``module:function``, the
    object defined in that module): the feed server imports only what its own settings allow."""
    if not path:
        return None
    if not valid_object_path(path):
        raise feed.FeedError(f"feed_filter must be 'module:function', got {path!r}")
    if not PathAllowlist(allowed, also=(path,) if not allowed else ()).allows(path):
        raise feed.FeedError(f"feed_filter {path!r} is not in feed_filters ({allowed})")
    try:
        fn = import_object(path)
    except (ImportError, AttributeError) as exc:
        raise feed.FeedError(f"feed_filter {path!r}: cannot import: {exc}") from None
    if not callable(fn):
        raise feed.FeedError(f"feed_filter {path!r} is not callable")
    return fn


class FeedService:
    COMPAT_TRAINER = COMPAT_TRAINER

    def __init__(self, client: redis.Redis, settings: Settings, job_id: str, store=None):
        self.r = client
        self.settings = settings
        self.job_id = job_id
        self.keys = Keys(settings.key_prefix)
        self.store = store
        cfg = feed.config(client, self.keys, job_id)
        if cfg is None:
            raise feed.FeedError(f"job {job_id!r} has no feed (create it with `interactor feed serve`)", 404)
        self.cfg = cfg
        self.check_store()
        self.user_filter = load_filter(cfg.filter, settings.feed_filters)
        self.replicas = ReplicaWait.for_settings(settings)  # takes and acks wait for a replica (broker/replicas.py)
        self.announcer = FeedAnnouncer(client, self.keys, store) if store is not None else None

    def check_store(self) -> None:
        """Refuse (409) to hand out groups read from another store than the one the job's
        consumer writes: every sample would come without its steps."""
        if self.store is None:
            return
        theirs = self.r.get(self.keys.job_store(self.job_id))
        theirs = theirs.decode() if isinstance(theirs, bytes) else theirs
        if theirs and theirs != self.store.identity:
            raise feed.FeedError(f"job {self.job_id}'s results are written to {theirs}, but this feed server reads "
                                 f"{self.store.identity}: start it with that store (--db / --store)", 409)

    def refresh(self) -> None:
        self.cfg = feed.config(self.r, self.keys, self.job_id) or self.cfg

    # --- taking ---------------------------------------------------------------------------
    def take(self, trainer: str, batch: int, timeout_s: float) -> list[dict]:
        """Up to ``batch`` distinct groups for ``trainer``, waiting up to ``timeout_s`` for the
        first ones and for replacements of filtered ones.

        Once it holds a group, a take waits at most half the ack timeout more: a group held
        inside a take longer than the ack timeout could be claimed by another take (or by this
        one, a second time). Before answering, the groups' idle clocks are reset, so that the
        ack timeout runs from the answer, not from the read."""
        if not isinstance(trainer, str) or not trainer or len(trainer) > 200 or " " in trainer:
            raise feed.FeedError(f"trainer must be a name without spaces, got {trainer!r}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise feed.FeedError(f"batch must be an integer >= 1, got {batch!r}")
        if batch > self.cfg.max_ahead:
            raise feed.FeedError(f"batch {batch} is larger than max_ahead {self.cfg.max_ahead}: "
                                 "the producer would never have that many groups ready")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 <= timeout_s <= MAX_TIMEOUT_S:
            raise feed.FeedError(f"timeout must be a number of seconds in [0, {MAX_TIMEOUT_S:.0f}], got {timeout_s!r}")
        self.check_store()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        out: list[dict] = []
        held: list[str] = []  # entry ids this take hands out, in order
        stream = self.keys.feed_stream(self.job_id)
        while len(out) < batch:
            want = batch - len(out)
            entries = [(e, True) for e in self._claim(trainer, want)]
            if not entries:
                left_ms = int((deadline - time.monotonic()) * 1000)
                resp = self.r.xreadgroup(feed.TRAINERS, trainer, {stream: ">"}, count=want,
                                         block=max(1, min(left_ms, 1000)) if left_ms > 0 else None)
                entries = [(e, False) for e in (resp[0][1] if resp else [])]
            for (entry_id, fields), again in entries:
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if entry_id in held:
                    continue  # never one group twice in an answer
                item = self._decide(entry_id, fields, again)
                if item is not None:
                    out.append(item)
                    held.append(entry_id)
                    if len(held) == 1:
                        deadline = min(deadline, time.monotonic() + self.cfg.ack_timeout_s / 2)
            if time.monotonic() >= deadline:
                break
        waited = time.monotonic() - t0
        stats = self.keys.feed_stats(self.job_id)

        def finish(pipe) -> None:
            if held:  # the ack timeout runs from the answer (JUSTID: not counted as a delivery)
                pipe.xclaim(stream, feed.TRAINERS, trainer, 0, held, justid=True)
            pipe.hincrbyfloat(stats, feed.C_WAIT_S, waited)
            pipe.hset(stats, feed.C_LAST_TAKE, f"{time.time():.3f}")
            if out:
                pipe.hincrby(stats, feed.C_TAKES, 1)

        # With replica waits on, the answer goes out once a replica has the take (broker/replicas.py).
        # The claim names the groups the primary that answers holds as this trainer's: after a
        # failover that lost the read, the others are not in the answer (they are read afresh).
        done = self.replicas.run(self.r, finish)
        if held:
            kept = {e.decode() if isinstance(e, bytes) else e for e in done[0]}
            if len(kept) < len(held):
                log.warning("job %s: %d groups read for trainer %s are not recorded as taken (a Redis failover lost "
                            "the read); they are handed out later", self.job_id, len(held) - len(kept), trainer)
                out = [item for item, entry in zip(out, held) if entry in kept]
        return out

    def give_back(self, trainer: str, group_ids: list[str]) -> int:
        """Groups handed out in an answer that never reached the trainer (its connection was
        gone): made claimable by the next take at once, as if their ack timeout had passed.
        Only those ``trainer`` still holds; returns how many."""
        stream = self.keys.feed_stream(self.job_id)
        entries = [e.decode() for e in self.r.hmget(self.keys.feed_seen(self.job_id), group_ids) if e is not None] \
            if group_ids else []
        mine = [e for e in entries if self._holder(stream, e) == trainer]
        if mine:
            self.r.xclaim(stream, feed.TRAINERS, trainer, 0, mine, idle=int(self.cfg.ack_timeout_s * 1000),
                          justid=True)
            log.warning("job %s: %d groups handed to trainer %s were not received (connection gone); "
                        "they go to the next take", self.job_id, len(mine), trainer)
        return len(mine)

    def _holder(self, stream: str, entry: str) -> str | None:
        """The trainer holding a feed entry (taken, not acknowledged); None when none does."""
        pending = self.r.xpending_range(stream, feed.TRAINERS, min=entry, max=entry, count=1)
        if not pending:
            return None
        holder = pending[0]["consumer"]
        return holder.decode() if isinstance(holder, bytes) else holder

    def _claim(self, trainer: str, count: int) -> list:
        """Groups taken and not acknowledged within the ack timeout, whoever took them: this
        trainer too. A trainer that restarts under its own name has lost what it held; were its
        old groups kept from it, the only trainer of a feed would never get them (and they would
        never be settled, so production would stop at ``max_ahead``). The timeout is the
        contract: a group held past it may be handed out again, to anyone. XCLAIM re-checks the
        idle time, so two takers never claim one group, and an acknowledged group is no longer
        pending, so it never comes back."""
        stream, idle = self.keys.feed_stream(self.job_id), int(self.cfg.ack_timeout_s * 1000)
        try:
            pending = self.r.xpending_range(stream, feed.TRAINERS, min="-", max="+", count=count, idle=idle)
        except redis.ResponseError:
            return []
        ids = [p["message_id"] for p in pending]
        if not ids:
            return []
        return [e for e in self.r.xclaim(stream, feed.TRAINERS, trainer, idle, ids) if e[1]]

    def _decide(self, entry_id: str, fields: dict, again: bool) -> dict | None:
        stats = self.keys.feed_stats(self.job_id)
        if not again:
            self.r.hincrby(stats, feed.C_READ, 1)
        try:
            group = unpack(fields[b"g"])
            if not isinstance(group, FeedGroup):
                raise RecordError(f"expected a feed_group, got {type(group).__name__}")
        except (RecordError, KeyError) as exc:
            log.error("feed entry %s of job %s is not a group (%s): set aside as failed", entry_id, self.job_id, exc)
            feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_FAILED)
            return None
        cfg = self.cfg
        if group.status == FeedGroupStatus.FAILED:
            runs = int(self.r.hget(self.keys.feed_refills(self.job_id), group.group_id) or 0)
            if cfg.failed_policy == feed.FAILED_REFILL and runs < cfg.refill_max:
                feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_REFILLED,
                            redo=_redo(group, "failed member", runs + 1), failure=group.pack())
                log.warning("group %s failed (%s): its tasks run again as a fresh group (re-run %d of %d)",
                            group.group_id, group.reason, runs + 1, cfg.refill_max)
                return None
            if cfg.failed_policy == feed.FAILED_REFILL:
                group.reason += f"; re-run {runs} times (feed_refill_max {cfg.refill_max}), reported"
            feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_FAILED, failure=group.pack())
            log.warning("group %s failed: %s", group.group_id, group.reason)
            return None
        current = feed.current_version(self.r, self.keys, self.job_id)
        behind = (current - group.oldest_version
                  if current is not None and group.oldest_version is not None else None)
        if cfg.max_staleness >= 0 and behind is not None and behind > cfg.max_staleness:
            self._stale(entry_id, group, behind)
            return None
        reason = self._filtered(group)
        if reason:
            feed.settle(self.r, self.keys, self.job_id, entry_id, f"{feed.C_FILTERED}:{reason}")
            return None
        try:
            item = self._item(group, behind, again)
        except UnreadableGroup as exc:
            # Never delivered as if it had no steps: reported, as a failed group is.
            group.reason = str(exc)
            log.error("job %s: %s; reported as failed", self.job_id, exc)
            feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_FAILED, failure=group.pack())
            return None
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(stats, feed.C_REDELIVERED if again else feed.C_DELIVERED, 1)
        if behind is not None:
            pipe.hincrby(stats, feed.C_BEHIND, behind)
            pipe.hincrby(stats, feed.C_BEHIND_N, 1)
        pipe.execute()
        return item

    def _stale(self, entry_id: str, group: FeedGroup, behind: int) -> None:
        """A group too many versions behind: re-run as a fresh group of the same tasks (at most
        ``refill_max`` re-runs in one group's line, as for failed groups: a model server whose
        versions count differently from the trainer's would make every group stale for ever),
        or dropped; either way counted, and reported once the bound is reached."""
        cfg = self.cfg
        runs = int(self.r.hget(self.keys.feed_refills(self.job_id), group.group_id) or 0)
        if cfg.stale_policy == feed.STALE_REQUEUE and runs < cfg.refill_max:
            feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_STALE_REQUEUED,
                        redo=_redo(group, f"{behind} versions behind", runs + 1))
            return
        failure = b""
        if cfg.stale_policy == feed.STALE_REQUEUE:
            group.reason = (f"{behind} versions behind after {runs} re-runs of its tasks (feed_refill_max "
                            f"{cfg.refill_max}): dropped")
            failure = group.pack()
            log.warning("group %s: %s", group.group_id, group.reason)
        feed.settle(self.r, self.keys, self.job_id, entry_id, feed.C_STALE_DROPPED, failure=failure)

    def _filtered(self, group: FeedGroup) -> str:
        if self.cfg.drop_uniform and group.rewards and max(group.rewards) == min(group.rewards):
            return feed.FILTER_UNIFORM
        if self.user_filter is not None:
            try:
                keep = self.user_filter(_public(group))
            except Exception:  # noqa: BLE001 - the user's code: kept, and said
                log.exception("feed_filter %s raised on group %s: the group is kept", self.cfg.filter, group.group_id)
                return ""
            if keep is False:
                return feed.FILTER_USER
        return ""

    def _item(self, group: FeedGroup, behind: int | None, again: bool) -> dict:
        item = _public(group) | {"versions_behind": behind, "redelivered": again}
        if self.store is None:
            return item
        rewards = group.rewards
        adv = group_stats(rewards)[2] if rewards else []
        samples = []
        for i, ep in enumerate(group.members):
            rows = self.store.feed_steps(ep)
            if not rows:
                raise UnreadableGroup(f"group {group.group_id}: member {ep} has no stored steps in "
                                      f"{redact_url(str(getattr(self.store, 'url', '?')))}")
            token_rows = self.store.episode_tokens(ep)
            steps = _with_tokens([_step(row) for row in rows], token_rows)
            sample = {"episode_id": ep, "reward": rewards[i] if i < len(rewards) else None,
                      "advantage": adv[i] if i < len(adv) else None, "steps": steps}
            if token_rows:
                sample["stream"] = _stream(token_rows)
            samples.append(sample)
        item["samples"] = samples
        return item

    # --- acknowledging ----------------------------------------------------------------------
    def ack(self, trainer: str, group_ids: list[str]) -> dict:
        """Acknowledge the groups this trainer holds. Those it does not (unknown, or held by
        another trainer since its ack timeout passed) are refused, named, and answered 404,
        while the ones it holds are acknowledged all the same: a trainer that trained on them
        must not get them again."""
        if not isinstance(group_ids, list) or not all(isinstance(g, str) for g in group_ids):
            raise feed.FeedError(f"ids must be a list of group ids, got {group_ids!r}")
        stream = self.keys.feed_stream(self.job_id)
        entries = self.r.hmget(self.keys.feed_seen(self.job_id), group_ids) if group_ids else []
        acked, already, refused = [], [], {}
        for gid, entry in zip(group_ids, entries):
            if entry is None:
                refused[gid] = f"not on the feed of job {self.job_id}"
                continue
            entry = entry.decode()
            holder = self._holder(stream, entry)
            if holder is not None and holder != trainer:
                refused[gid] = (f"held by trainer {holder!r}, not {trainer!r} (its ack timeout passed and it was "
                                "handed out again)")
            elif holder is not None and feed.settle(self.r, self.keys, self.job_id, entry, feed.C_ACKED,
                                                    replicas=self.replicas):
                acked.append(gid)
            else:
                already.append(gid)  # settled already (acknowledged before, or never delivered)
        if refused:
            raise feed.FeedError("; ".join(f"group {g!r} {why}" for g, why in refused.items()), 404,
                                 extra={"acked": acked, "already": already, "refused": refused})
        return {"acked": acked, "already": already}

    # --- versions and stats -----------------------------------------------------------------
    def set_version(self, version) -> int:
        return feed.set_version(self.r, self.keys, self.job_id, version)

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: the feed's one view (broker/feed.py ``summary``), its recent failures
        and its configuration."""
        failures = []
        for raw in self.r.lrange(self.keys.feed_failures(self.job_id), 0, 19):
            try:
                g = unpack(raw)
                failures.append({"group_id": g.group_id, "reason": g.reason})
            except RecordError:
                continue
        return {"job_id": self.job_id, **feed.summary(self.r, self.keys, self.job_id),
                "recent_failures": failures, "config": self.cfg.to_hash()}

    def backfill(self) -> int:
        """Announce settled groups the consumer has not (a feed attached to a running job, or a
        member failed outside a batch): the announcement marker keeps this idempotent."""
        return self.announcer.backfill(self.job_id) if self.announcer is not None else 0

    # --- the original system's shape ------------------------------------------------------------
    def rollout_data(self, batch: int, timeout_s: float) -> tuple[dict, list[str]]:
        """``/get_rollout_data``: complete groups as the original buffer server answered, one
        item per trainable step row, and the ids of the groups in it. That route has no ack: the
        server acknowledges them once the answer is written (interactor/feedserve.py), and
        gives them back when the connection is gone."""
        groups = self.take(COMPAT_TRAINER, batch, timeout_s)
        items, rewards, versions = [], [], []
        for g in groups:
            for s in g.get("samples", []):
                for st in s["steps"]:
                    if not st["is_trainable"]:
                        continue
                    wv = st["weight_version"]
                    v = feed.parse_version(wv)
                    if v is not None:
                        versions.append(v)
                    reward = s["reward"] if s["reward"] is not None else 0.0
                    rewards.append(reward)
                    item = {
                        "uid": f"{st['session_id']}:{st['step_id']}",
                        "instance_id": g["group_id"],
                        # The original contract's "messages": the prompt, then the answer (verl's
                        # and TRL's conversation). "prompt" is the prompt alone, as in /take's steps
                        # ("messages" there, the store's column) and the export's "prompt".
                        "messages": list(st["messages"] or []) + [{"role": "assistant", "content": st["response"]}],
                        "prompt": list(st["messages"] or []),
                        "reward": reward,
                        "extra_info": {"timestamp": st["created_at"], "steps": len(s["steps"]),
                                       "finish_reason": st["finish_reason"], "session_id": st["session_id"],
                                       "env_id": st["session_id"], "group_id": g["group_id"],
                                       "weight_version": wv, "truncated": st["is_truncated"]},
                    }
                    # Same item, more fields, where the step has the ids the model sampled.
                    item.update({k: st[k] for k in TOKEN_FIELDS if k in st})
                    items.append(item)
        return {"success": True, "message": f"{len(groups)} groups, {len(items)} samples",
                "data": {"data": items, "meta_info": {
                    "total_samples": len(items),
                    # finite for finite rewards, however large (a plain sum of two 1e308 is inf)
                    "avg_reward": reward_mean_std(rewards)[0] if rewards else 0.0,
                    "finished_groups": len(groups),
                    "avg_weight_version": sum(versions) / len(versions) if versions else None,
                    "max_weight_version": max(versions) if versions else None}}}, [g["group_id"] for g in groups]


class UnreadableGroup(Exception):
    """A group whose stored steps cannot be read: never handed to a trainer without them."""


def _public(group: FeedGroup) -> dict:
    return {"group_id": group.group_id, "job_id": group.job_id, "status": group.status, "size": group.size,
            "members": list(group.members), "rewards": list(group.rewards),
            "oldest_version": group.oldest_version, "newest_version": group.newest_version}


def _redo(group: FeedGroup, why: str, refills: int = 0) -> bytes:
    """What the producer runs again (producer/continuous.py): the old group, its episodes (whose
    specs are copied), why, and how many re-runs for failed members its new group descends from."""
    return msgpack.packb([group.group_id, list(group.members), why, refills], use_bin_type=True)


_STEP_KEYS = ("job_id", "session_id", "group_id", "env_name", "step_id", "attempt", "messages", "response",
              "step_reward", "weight_version", "is_trainable", "is_terminal", "is_truncated", "prompt_tokens",
              "completion_tokens", "ended_by", "finish_reason", "created_at")


# A step's token fields as a trainer gets them (consumer/storage/step_tokens.py): present only on
# steps that asked the model for tokens; ids as lists of ints, logprobs as floats.
TOKEN_FIELDS = ("token_status", "prompt_ids", "completion_ids", "completion_logprobs")


def _with_tokens(steps: list[dict], token_rows: list[dict]) -> list[dict]:
    """The steps, each with its token fields where its trajectory stored some (the token rows
    are of the attempt the steps' rows are of: ``episode_tokens`` joins on it)."""
    by_step = {t["step_id"]: t for t in token_rows}
    for st in steps:
        t = by_step.get(st["step_id"])
        if t is not None:
            st.update({k: t.get(k) for k in TOKEN_FIELDS})
    return steps


def _stream(token_rows: list[dict]) -> dict:
    """The episode's token stream with its loss mask (consumer/streams.py), as a trainer takes it:
    its segments (one while every turn's, or an agent's call's, prompt extends the stream so far;
    each later one says why it began) and the steps that had no ids."""
    from consumer.streams import build

    stream = build(token_rows)
    return {"single": stream.single, "steps_without_ids": stream.steps_without_ids, "segments": [
        {"first_step": seg.first_step, "last_step": seg.last_step, "steps": seg.steps,
         "starts_because": seg.starts_because, "drift_at": seg.drift_at, "ids": seg.ids, "mask": seg.mask,
         "logprobs": seg.logprobs} for seg in stream.segments]}


def _step(row: tuple) -> dict:
    import orjson

    d = dict(zip(_STEP_KEYS, row))
    if isinstance(d["messages"], str):
        d["messages"] = orjson.loads(d["messages"])
    for k in ("is_trainable", "is_terminal", "is_truncated"):
        d[k] = bool(d[k])
    return d
