"""``interactor job JOB set|rerun|log``: live control of a job from any machine of the fleet.

``set`` changes a running job's limits (interactor/job_set.py), ``rerun`` runs episodes of it
again, keeping what they did before as a superseded attempt, and ``log`` prints who changed the
job and when (interactor/job_rerun.py; broker/audit.py keeps the log). One flat parser: the
settings flags (``--redis-url``...) may come anywhere on the line.

Registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``.
"""

from __future__ import annotations

from broker.settings import REDIS

ACTIONS = ("set", "rerun", "log")


def register(sub, add) -> None:
    sp = add("job", cmd_job, "control a job while it runs: set its limits, rerun episodes, read its audit log",
             reads=(REDIS,))
    sp.add_argument("job", help="the job's id (printed by run and submit; interactor status lists those in Redis)")
    sp.add_argument("action", choices=ACTIONS,
                    help="set: change the job's limits fleet-wide (--concurrency ...); rerun EPISODE...: run "
                         "episodes again, their previous trajectory kept as a superseded attempt; log: who changed "
                         "the job and when")
    sp.add_argument("episodes", nargs="*", metavar="EPISODE", help="rerun: the episodes to run again")
    sp.add_argument("--as", dest="who", default=None, metavar="NAME",
                    help="who the audit log says made the change (default: your user@host)")
    sp.add_argument("--json", action="store_true", help="print the outcome as JSON")
    # --- set's flags (interactor/job_set.py) ---
    from interactor.job_set import add_flags

    add_flags(sp)
    # --- rerun's and log's flags (interactor/job_rerun.py) ---


def cmd_job(args) -> int:
    from interactor.common import redis_for, settings_from_args, with_local_redis

    settings = with_local_redis(settings_from_args(args))
    client = redis_for(settings)
    if args.action == "set":
        from interactor.job_set import cmd_set

        return cmd_set(args, settings, client)
    from interactor.job_rerun import cmd_log, cmd_rerun

    return (cmd_rerun if args.action == "rerun" else cmd_log)(args, settings, client)
