"""``interactor job JOB set``: a running job's limits changed fleet-wide (not built yet: issue 50)."""

from __future__ import annotations

import sys


def cmd_set(args, settings, client) -> int:
    print("interactor job set: not built yet", file=sys.stderr)
    return 2
