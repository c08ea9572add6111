"""``interactor bench``: runs the benchmark harness, ``python -m bench`` (bench/cli.py,
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
    if not (ROOT / "bench" / "harness.py").exists():
        print("interactor bench: needs a checkout of the repository (bench/ is not installed)", file=sys.stderr)
        return 2
<<<<<<< HEAD
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.run import BenchConfig, run, write
    from interactor.common import settings_from_args

    base = settings_from_args(args)
    kw = {}
    for name in ("pool_level", "feed_level", "caps_level", "caps_factor", "workers", "model_latency_ms", "env_latency_ms", "steps", "ingest_records",
                 "enqueue_episodes", "out", "png", "work", "src"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.window is not None:
        kw["window_s"] = args.window
    if args.warmup is not None:
        kw["warmup_s"] = args.warmup
    if args.levels is not None:
        kw["levels"] = _ints(args.levels)
    if args.single_turn_levels is not None:
        kw["single_turn_levels"] = _ints(args.single_turn_levels)
    if args.pools is not None:
        kw["pools"] = _words(args.pools)
    if args.process_counts is not None:
        kw["process_counts"] = _ints(args.process_counts)
    if args.skip is not None:
        kw["skip"] = _words(args.skip)
    kw["pool"] = base.pool
    cfg = BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)
    try:
        cfg.check()
    except ValueError as exc:
        print(f"interactor bench: {exc}", file=sys.stderr)
        return 2
    if args.render:
        res = json.loads(Path(args.render).read_text())
    else:
        res = run(cfg, base)
    write(res, cfg)
    return 0


def register(sub, add) -> None:
    sp = add("bench", cmd_bench, "run the benchmark harness; writes docs/benchmarks.md and docs/benchmarks.png")
    sp.add_argument("--quick", action="store_true", help="a small, fast configuration (writes under runs/bench/)")
    sp.add_argument("--levels", help="concurrency levels of the load runs, e.g. 64,256,1000")
    sp.add_argument("--single-turn-levels", help="concurrency levels of the 1-step load runs, e.g. 256,1000 ('' for none)")
    sp.add_argument("--pools", help="pools to compare, e.g. gevent,threads,prefork ('' for none)")
    sp.add_argument("--pool-level", type=int, help="concurrency of the pool and process comparisons (1000)")
    sp.add_argument("--feed-level", type=int, help="concurrency of the rollout feed run (1000; 0 for none)")
    sp.add_argument("--caps-level", type=int,
                    help="concurrency of the caps' cost run: that load with never-binding caps (256; 0 for none)")
    sp.add_argument("--caps-factor", type=float, help="the caps of that run, times its concurrency (10; above 1)")
    sp.add_argument("--workers", type=int, help="worker processes sharing the concurrency (2)")
    sp.add_argument("--model-latency-ms", type=float)
    sp.add_argument("--env-latency-ms", type=float)
    sp.add_argument("--steps", type=int, help="steps per episode (20)")
    sp.add_argument("--window", type=float, help="measured window per load run, seconds (20)")
    sp.add_argument("--warmup", type=float, help="seconds between all slots busy and the window (3)")
    sp.add_argument("--ingest-records", type=int)
    sp.add_argument("--enqueue-episodes", type=int)
    sp.add_argument("--skip", help="parts to skip: load,single,processes,pools,feed,caps,ingest,tokens,enqueue")
    sp.add_argument("--process-counts", help="worker process counts compared at --pool-level, e.g. 2,4 ('' for none)")
    sp.add_argument("--out", help="the Markdown report (docs/benchmarks.md)")
    sp.add_argument("--png", help="the plot (docs/benchmarks.png); '' for none")
    sp.add_argument("--work", help="scratch folder (runs/bench)")
    sp.add_argument("--src", help="run workers, consumer and stand-ins from another checkout of the code")
    sp.add_argument("--render", metavar="RESULTS_JSON", help="only re-render the report from a results.json")
=======
    exec_program("bench", (["--verbose"] if args.verbose else []) + args.rest)
    return 0  # pragma: no cover - exec_program does not return


def register(sub, add) -> None:
    if "bench" in sub.choices:  # run by python -m bench, which registers the command itself
        return
    # Every argument goes to the harness's own parser (prefix_chars: REMAINDER alone drops flags).
    sp = sub.add_parser("bench", help="run the benchmark harness; writes docs/benchmarks.md and docs/benchmarks.png",
                        add_help=False, prefix_chars="\0")
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(fn=cmd_bench)
>>>>>>> house
