"""``interactor bench``: runs the benchmark harness, ``python -m bench`` (bench/bench_command.py,
docs/benchmarks.md), with the same arguments.

The harness lives in the repository's ``bench/`` folder (a development tool, not part of the
installed package), so this command works from a checkout. ``bench`` sits above ``interactor``
(it imports the command's pieces), so the command runs it as a program and imports none of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from interactor.children import exec_program

ROOT = Path(__file__).resolve().parent.parent


def cmd_bench(args) -> int:
    if not (ROOT / "bench" / "__main__.py").exists():
        print("interactor bench: needs a checkout of the repository (bench/ is not installed)", file=sys.stderr)
        return 2
    exec_program("bench", (["--verbose"] if args.verbose else []) + args.rest)
    return 0  # pragma: no cover - exec_program does not return


def register(sub, add) -> None:
    if "bench" in sub.choices:  # run by python -m bench, which registers the command itself
        return
    # Every argument goes to the harness's own parser (prefix_chars: REMAINDER alone drops flags).
    sp = sub.add_parser("bench", help="run the benchmark harness; writes docs/benchmarks.md and docs/benchmarks.png",
                        add_help=False, prefix_chars="\0")
    sp.add_argument("rest", nargs=argparse.REMAINDER, help="the harness's own flags (interactor bench --help)")
    sp.set_defaults(fn=cmd_bench)
