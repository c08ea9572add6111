"""``interactor dlq``: the dead-letter queue (broker/dlq.py) from the command line: list, show,
re-drive or purge dead-lettered episodes. Registered into the CLI through
``interactor.cli.EXTRA_COMMAND_MODULES``."""

from __future__ import annotations

import argparse
import json
import sys

from broker.settings import REDIS, REDRIVE, SettingsError
from interactor.common import add_setting_flags, redis_for, settings_from_args


def register(sub, add) -> None:
    _add_dlq(add("dlq", cmd_dlq, "the dead-letter queue: list, show, redrive or purge dead-lettered episodes",
                 reads=()))


ERROR_HEAD_CHARS = 100  # of a dead letter's error in `dlq list`; `dlq show` has it whole
ERROR_TAIL_CHARS = 160  # of its last line, the exception that ended the attempt


def error_brief(error: str) -> str:
    """A dead letter's error on one line: its head and its final line (the exception itself, which
    names what was wrong: ``unknown reasoning-gym task 'x'``), the middle elided."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    flat = " | ".join(lines)
    if len(flat) <= ERROR_HEAD_CHARS + ERROR_TAIL_CHARS:
        return flat
    head, last = lines[0][:ERROR_HEAD_CHARS], lines[-1]
    if len(last) > ERROR_TAIL_CHARS:
        last = "..." + last[-ERROR_TAIL_CHARS:]
    return head if head == last else f"{head} ... {last}"


def cmd_dlq(args) -> int:
    from broker.dlq import DeadLetterQueue

    settings = settings_from_args(args)
    dlq = DeadLetterQueue(redis_for(settings), settings)
    if args.dlq_cmd == "list":
        letters = dlq.list(job_id=args.job, reason=args.reason)
        if args.json:
            print(json.dumps([d.to_dict() for d in letters], indent=2, default=str))
        else:
            for d in letters:
                print(f"{d.episode_id}\t{d.reason}\tattempts={d.attempts}\t{error_brief(d.error)}")
            print(f"{len(letters)} dead-lettered episodes")
        return 0
    if args.dlq_cmd == "show":
        d = dlq.get(args.episode_id)
        if d is None:
            print(f"no dead letter for episode {args.episode_id!r}", file=sys.stderr)
            return 2
        print(json.dumps(d.to_dict(), indent=2, default=str))
        return 0
    if args.dlq_cmd == "redrive" and getattr(args, "failed", False):
        if not args.job:
            raise SettingsError("--failed re-drives the failed episodes of one job: say which with --job J")
        sent = dlq.redrive_failed(args.job, who=args.who)
        print(f"re-drove {len(sent)} episodes")
        return 0
    selected = _select_letters(dlq, args)
    if args.dlq_cmd == "redrive":
        cancelled = dlq.cancelled_jobs(selected)
        if cancelled and all(d.job_id in cancelled for d in selected):
            from broker.cancel import JobCancelled

            raise JobCancelled(sorted(cancelled)[0], "its dead letters are not re-driven")
        sent = dlq.redrive(selected, who=args.who)
        print(f"re-drove {len(sent)} episodes")
        if cancelled:
            left = sum(d.job_id in cancelled for d in selected)
            print(f"left alone: {left} dead letters of cancelled jobs ({', '.join(sorted(cancelled))}): a cancelled "
                  "job is not run again")
    else:
        print(f"purged {dlq.purge(selected)} dead letters")
    return 0


def _select_letters(dlq, args):
    if not (args.ids or args.job or args.reason or args.all):
        raise SettingsError("say which dead letters: episode ids, --job J, --reason R or --all")
    letters = dlq.list(job_id=args.job, reason=args.reason)
    if args.ids:
        wanted = set(args.ids)
        letters = [d for d in letters if d.episode_id in wanted]
        missing = wanted - {d.episode_id for d in letters}
        if missing:
            raise SettingsError(f"not in the dead-letter queue: {', '.join(sorted(missing))}")
    return letters


def _add_dlq(dp: argparse.ArgumentParser) -> None:
    """Each action takes the Redis flags itself (``dlq list --run-dir R``, as a user types it)."""
    dsub = dp.add_subparsers(dest="dlq_cmd", required=True, metavar="ACTION")
    lp = dsub.add_parser("list", help="list dead letters, one line each", description="list dead letters")
    add_setting_flags(lp, (REDIS, REDRIVE))
    lp.add_argument("--job", help="only this job's")
    lp.add_argument("--reason", help="only those dead-lettered for this reason (e.g. model_malformed)")
    lp.add_argument("--json", action="store_true", help="print them as JSON")
    shp = dsub.add_parser("show", help="one dead letter in full (JSON)", description="one dead letter in full")
    add_setting_flags(shp, (REDIS, REDRIVE))
    shp.add_argument("episode_id", help="the episode's id")
    for name, what in (("redrive", "send dead-lettered episodes again, with a fresh budget of attempts"),
                       ("purge", "forget dead letters (the episodes stay failed in the ledger and the results)")):
        rp = dsub.add_parser(name, help=what, description=what + "; say which: ids, --job, --reason or --all")
        add_setting_flags(rp, (REDIS, REDRIVE))
        rp.add_argument("ids", nargs="*", help="episode ids")
        rp.add_argument("--job", help="the dead letters of this job")
        rp.add_argument("--reason", help="the dead letters of this reason")
        rp.add_argument("--all", action="store_true", help="every dead letter")
        if name == "redrive":
            rp.add_argument("--failed", action="store_true",
                            help="with --job: every episode the ledger holds as failed, letter or not")
            rp.add_argument("--as", dest="who", default=None, metavar="NAME",
                            help="who the jobs' audit logs say re-drove them (default: your user@host)")
