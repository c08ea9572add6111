"""``interactor job JOB rerun EPISODE...`` (episodes run again, broker/rerun.py) and
``interactor job JOB log`` (who changed the job and when, broker/audit.py)."""

from __future__ import annotations

import json
import sys

from broker.audit import JobAudit, describe
from broker.keys import Keys
from broker.ledger import Ledger
from broker.rerun import RerunRefused, rerun_episodes

LOG_LIMIT = 1000  # entries printed at most (the log keeps broker/audit.py MAX_ENTRIES)


def cmd_rerun(args, settings, client) -> int:
    """Run the named episodes again (broker/rerun.py); a refusal is one line and exit 2."""
    try:
        report = rerun_episodes(client, settings, args.job, args.episodes, who=args.who)
    except RerunRefused as exc:
        print(f"interactor job rerun: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"job_id": report.job_id, "rerun": report.rerun, "redriven": report.redriven}))
        return 0
    print(f"job {args.job}: {len(report.rerun)} completed episodes run again (their trajectories kept as superseded "
          f"attempts), {len(report.redriven)} failed episodes re-driven")
    from interactor.stopped_run import started_for_command

    if started_for_command():
        print(f"no worker runs for it: its run in {settings.run_dir}/ has stopped; run them with  interactor run "
              f"--resume {args.job} --run-dir {settings.run_dir}")
    return 0


def cmd_log(args, settings, client) -> int:
    """The job's audit log from Redis, oldest first (a log read top-down), or as JSON."""
    keys = Keys(settings.key_prefix)
    entries = JobAudit(client, keys).entries(args.job, LOG_LIMIT)
    if not entries and Ledger.for_settings(client, settings).job_spec(args.job) is None:
        print(f"interactor: no job {args.job!r} in Redis (prefix {settings.key_prefix}); the results browser's job "
              "page shows the log of a job whose keys are gone", file=sys.stderr)
        return 2
    entries.reverse()
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    for entry in entries:
        print(describe(entry))
    print(f"{len(entries)} changes to job {args.job}")
    return 0
