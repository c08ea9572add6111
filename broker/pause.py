"""Jobs that stop burning: a job whose attempts keep failing the same way pauses itself.

One broken env server or a wrong model name would otherwise empty a whole dataset into the
dead-letter queue, attempt after attempt. So every attempt that ends in failure counts its
episode towards its job's *streak* (``<prefix>:job:<job>:streak``: the reason, how many
episodes in a row, and which): an episode counts once however many of its attempts failed, so
that a job pauses after N *episodes* failed alike, not after N/3 episodes' three retries. An
attempt that completes, or completes a turn, or fails for another reason, starts the streak
over: a job whose attempts often fail but get on (a flaky server; the next attempt resumes
where the last stopped) is not what pausing is for. When the streak
reaches the job's ``pause_after_failures`` (JobSpec, default 20, 0 = never) the job is *paused*
(``<prefix>:job:<job>:pause``: why, since when, the last error):

* no new attempt starts: a worker that receives an episode of a paused job parks it
  (``<prefix>:job:<job>:parked``, the episode stays ``queued``) before START, so no attempt
  is spent; the sweeper's reconcile counts parked episodes as accounted for;
* attempts already running finish as they would;
* ``interactor resume JOB`` (or a re-drive from the dead-letter queue) lifts the pause and
  sends the parked episodes again.

Counting is one Lua script per attempt that ends (``record``), so that workers failing at the
same moment count exactly; parking and resuming are scripts too, so that an episode is never
parked after the pause that made it park was lifted (it would wait forever).

Attempts that ended for reasons that are not the job's doing (a worker shut down or lost, a
lease taken over, Redis away), or because the job was cancelled, are neither counted nor reset
the streak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from broker import errors
from broker.audit import JobAudit
from broker.keys import Keys
from broker.ledger import Ledger
from broker.lua_scripts import lua_file
from broker.queueing import push_episodes
from broker.states import LedgerState

# Not the job's doing: these neither count towards a streak nor end one.
NOT_COUNTED = frozenset({errors.WORKER_SHUTDOWN, errors.WORKER_LOST, errors.LEASE_LOST, errors.BROKER_OUTAGE,
                         errors.CANCELLED})

# Who the audit log says paused a job that paused itself.
STREAK_WHO = "interactor (failure streak)"

# Its scripts' Lua: broker/lua/pause_*.lua (broker/lua_scripts.py).
_RECORD = lua_file("pause_record")
_PARK = lua_file("pause_park")
_RESUME = lua_file("pause_resume")


@dataclass(frozen=True)
class PauseState:
    """Why a job is paused: ``streak`` episodes in a row failed with ``reason``."""

    reason: str
    streak: int
    since: float
    detail: str = ""

    def describe(self) -> str:
        return (f"paused: {self.streak} episodes in a row failed with {self.reason}"
                + (f" (last: {self.detail})" if self.detail else ""))


class JobPause:
    """The pause state of jobs, in Redis; shared by workers (record, park), the CLI (resume,
    status) and metrics."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.r = client
        self.k = keys
        self._record = client.register_script(_RECORD)
        self._park = client.register_script(_PARK)
        self._resume = client.register_script(_RESUME)

    def record(self, job_id: str, reason: str, threshold: int, detail: str = "", episode_id: str = "") -> bool:
        """Count an attempt of ``episode_id`` that ended (``reason`` "" = completed). True when
        it paused the job."""
        if reason in NOT_COUNTED:
            return False
        count, paused_now = self._record(keys=[self.k.job_streak(job_id), self.k.job_pause(job_id)],
                                         args=[reason, int(threshold), time.time(), detail[:300], episode_id])
        if paused_now:  # the one process whose count paused it says so in the job's audit log
            JobAudit(self.r, self.k).record(job_id, "pause", {"reason": reason, "streak": int(count),
                                                               "last_error": detail[:300], "episode": episode_id},
                                            who=STREAK_WHO)
        return bool(paused_now)

    def park(self, job_id: str, episode_id: str) -> bool:
        """Hand a delivered episode of a paused job back without starting it: True if parked."""
        return bool(self._park(keys=[self.k.job_pause(job_id), self.k.job_parked(job_id), self.k.reserved,
                                     self.k.job_state(job_id)],
                               args=[episode_id, f"{job_id} {episode_id}"]))

    def is_paused(self, job_id: str) -> bool:
        return bool(self.r.exists(self.k.job_pause(job_id)))

    def state(self, job_id: str) -> PauseState | None:
        return self.states([job_id]).get(job_id)

    def states(self, job_ids: list[str]) -> dict[str, PauseState]:
        """The paused ones among ``job_ids`` (one round trip)."""
        if not job_ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.k.job_pause(job_id))
        out = {}
        for job_id, raw in zip(job_ids, pipe.execute()):
            if raw:
                d = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
                out[job_id] = PauseState(reason=d.get("reason", ""), streak=int(d.get("streak") or 0),
                                         since=float(d.get("since") or 0), detail=d.get("detail", ""))
        return out

    def parked(self, job_id: str) -> set[str]:
        return {m.decode() for m in self.r.smembers(self.k.job_parked(job_id))}

    def resume(self, job_id: str) -> list[str]:
        """Lift the pause (and forget the streak); returns the parked episodes, which the caller
        sends again (broker.queueing.push_episodes)."""
        out = self._resume(keys=[self.k.job_pause(job_id), self.k.job_streak(job_id), self.k.job_parked(job_id)])
        return [m.decode() if isinstance(m, bytes) else m for m in out]


def resume_job(client: redis.Redis, settings, job_id: str, who: str | None = None, why: str = "") -> list[str]:
    """``interactor resume JOB``: lift the pause and send the parked episodes that are still
    queued (one re-driven or finished meanwhile is left alone). Returns those sent. A job that
    was paused gets a ``resume`` entry in its audit log, signed ``who`` (``why``: what resumed
    it when not the resume command, e.g. a re-drive)."""
    ledger = Ledger.for_settings(client, settings)
    keys = Keys(settings.key_prefix)
    pause = JobPause(client, keys)
    was = pause.state(job_id)
    parked = pause.resume(job_id)
    states = ledger.states(job_id) if parked else {}
    waiting = [e for e in parked if states.get(e) == LedgerState.QUEUED]
    specs = ledger.episode_specs(job_id, waiting)
    push_episodes(client, [(job_id, e, settings.queue_for(specs.get(e))) for e in waiting])
    if was is not None or parked:
        detail = {"was": was.describe() if was else "not paused", "parked_sent": len(waiting)}
        JobAudit(client, keys).record(job_id, "resume", detail | ({"by": why} if why else {}), who=who)
    return waiting
