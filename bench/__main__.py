"""``python -m bench [-v] ARGS``: the benchmark harness, as ``interactor [-v] bench ARGS`` ran it
before (bench/bench_command.py); ``interactor bench`` runs this."""

import sys

from bench.bench_command import register
from interactor.cli import main

argv = sys.argv[1:]
lead = argv[:1] if argv[:1] in (["-v"], ["--verbose"]) else []
sys.exit(main([*lead, "bench", *argv[len(lead):]], commands=[register]))
