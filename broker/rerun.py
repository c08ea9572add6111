"""Episodes run again: ``interactor job JOB rerun EPISODE...``.

A completed episode is queued again (``done`` -> ``queued``, with a fresh budget of attempts and
no progress snapshot: its next attempt starts from a fresh env reset) by one script
(``lua/rerun_episode.lua``) that also writes an :class:`~broker.control_records.EpisodeRerun`
record to the results stream before any step of the new attempt can be: the store sets the
trajectory it completed with aside as superseded (consumer/storage/plan.py) and takes the new
attempt's. A failed (dead-lettered) episode is re-driven, as ``interactor dlq redrive`` does.

Refused, before anything changes: a job not in Redis, a cancelled job, a feed job (its groups
were handed to a trainer already: a new trajectory would change a group it learned from), and
an episode the job does not have or that has not finished (queued, retrying, running). A job
that had finished is running again until its reruns end: its keys lose their retention expiry
at once (the sweeper's housekeeping would take it back on its next round too). Each call is
one ``rerun`` entry in the job's audit log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from broker.audit import JobAudit, bounded_who
from broker.cancel import JobCancel, JobCancelled
from broker.control_records import EpisodeRerun
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import COUNTS_FN, Ledger
from broker.lua_scripts import lua_file
from broker.queueing import push_episodes
from broker.settings import Settings
from broker.states import LedgerState

log = logging.getLogger("interactor.rerun")

_RERUN = COUNTS_FN + lua_file("rerun_episode")
MAX_EPISODES = 10_000  # per call: a rerun names episodes, it is not a way to re-run a job


class RerunRefused(ValueError):
    """Nothing was run again, and why (a clear sentence for the command line)."""


@dataclass
class RerunReport:
    job_id: str
    rerun: list[str] = field(default_factory=list)  # completed episodes queued again
    redriven: list[str] = field(default_factory=list)  # failed episodes re-driven


def rerun_episodes(client: redis.Redis, settings: Settings, job_id: str, episode_ids: list[str],
                   who: str | None = None) -> RerunReport:
    """Run ``episode_ids`` of ``job_id`` again (see the module's docstring); raises
    :class:`RerunRefused` or :class:`~broker.cancel.JobCancelled` with nothing changed."""
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(client, settings)
    wanted = list(dict.fromkeys(e for e in episode_ids if e))
    if not wanted:
        raise RerunRefused("say which episodes to run again: interactor job JOB rerun EPISODE [EPISODE...]")
    if len(wanted) > MAX_EPISODES:
        raise RerunRefused(f"{len(wanted)} episodes named; at most {MAX_EPISODES} per rerun")
    job = ledger.job_spec(job_id)
    if job is None:
        raise RerunRefused(f"no job {job_id!r} in Redis (prefix {settings.key_prefix}): a job is run again only "
                           "while its keys are kept (INTERACTOR_JOB_RETENTION_S after it finished)")
    if JobCancel(client, settings).is_cancelled(job_id):
        raise JobCancelled(job_id, "its episodes are not run again")
    if client.sismember(keys.feeds, job_id):
        raise RerunRefused(f"job {job_id!r} serves an online-RL feed: its groups were handed to a trainer as they "
                           "settled, so an episode run again would change a group it already learned from; "
                           "the feed re-runs a failed group itself")
    states = dict(zip(wanted, client.hmget(keys.job_state(job_id), wanted)))
    unknown = [e for e, st in states.items() if st is None]
    if unknown:
        raise RerunRefused(f"job {job_id!r} has no episode {', '.join(map(repr, unknown[:5]))}"
                           + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
                           + f": interactor results {job_id} lists its episodes")
    busy = {e: st.decode() for e, st in states.items() if st.decode() not in (LedgerState.DONE, LedgerState.FAILED)}
    if busy:
        named = ", ".join(f"{e} ({st})" for e, st in list(busy.items())[:5])
        raise RerunRefused(f"not finished, so not run again: {named}; an episode is run again once it completed "
                           "or failed")
    report = RerunReport(job_id)
    script = client.register_script(_RERUN)
    done = [e for e, st in states.items() if st.decode() == LedgerState.DONE]
    failed = [e for e, st in states.items() if st.decode() == LedgerState.FAILED]
    for episode_id in done:
        if _rerun_one(script, ledger, keys, job_id, episode_id, job.max_attempts, who):
            report.rerun.append(episode_id)
    if failed:
        report.redriven = DeadLetterQueue(client, settings).redrive_episodes(job_id, failed, audit=False)
    specs = ledger.episode_specs(job_id, report.rerun)
    push_episodes(client, [(job_id, e, settings.queue_for(specs[e].queue if e in specs else "")) for e in report.rerun])
    if report.rerun or report.redriven:
        pipe = client.pipeline(transaction=False)
        for key in keys.job_keys(job_id):  # running again: no longer a finished job's retention
            pipe.persist(key)
        pipe.execute()
        JobAudit(client, keys).record(job_id, "rerun", {"episodes": report.rerun[:20], "count": len(report.rerun),
                                                        "redriven": report.redriven[:20]}, who=who)
        log.info("job %s: %d episodes run again, %d re-driven", job_id, len(report.rerun), len(report.redriven))
    return report


def _rerun_one(script, ledger: Ledger, keys: Keys, job_id: str, episode_id: str, max_attempts: int,
               who: str | None) -> bool:
    """One completed episode queued again with its record; False when it was no longer done
    (someone else ran it again meanwhile)."""
    for _ in range(3):  # 'changed': an attempt counted between the read and the script
        attempts = ledger.attempts(job_id, episode_id)
        record = EpisodeRerun(job_id, episode_id, attempts, who=bounded_who(who))
        out = script(keys=[keys.job_state(job_id), keys.job_counts(job_id), keys.job_attempts(job_id),
                           keys.job_attempt_limit(job_id), keys.results, keys.job_cancel(job_id),
                           keys.job_progress(job_id), keys.job_progress_seq(job_id)],
                     args=[episode_id, record.pack(), attempts, max(1, int(max_attempts))])
        out = out.decode() if isinstance(out, bytes) else out
        if out == "queued_again":
            return True
        if out == "job_cancelled":
            raise JobCancelled(job_id, "its episodes are not run again")
        if out != "changed":
            return False
    return False
