"""``interactor job JOB rerun|log``: episodes run again, and the job's audit log (not built yet: issue 50)."""

from __future__ import annotations

import sys


def cmd_rerun(args, settings, client) -> int:
    print("interactor job rerun: not built yet", file=sys.stderr)
    return 2


def cmd_log(args, settings, client) -> int:
    print("interactor job log: not built yet", file=sys.stderr)
    return 2
