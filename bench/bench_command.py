"""The benchmark harness's command, ``bench`` (docs/benchmarks.md): ``python -m bench`` runs it
(``make bench``), and so does ``interactor bench`` (interactor/benchcli.py runs this program).

``bench`` sits above ``interactor``: it hands this command to ``interactor.cli.main``, which
gives it the settings flags, logging, the parent watch and the error handling of every other
command; ``interactor`` imports nothing of ``bench``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def cmd_bench(args) -> int:
    from bench.run import BenchConfig, run, write
    from interactor.common import settings_from_args

    base = settings_from_args(args)
    kw = {}
    for name in ("pool_level", "feed_level", "caps_level", "caps_factor", "workers", "model_latency_ms", "env_latency_ms", "steps", "ingest_records",
                 "enqueue_episodes", "out", "png", "work", "src", "original", "original_level", "original_log_level",
                 "original_reset_concurrency", "original_python", "original_setup"):
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
    if args.original_steps is not None:
        kw["original_steps"] = _ints(args.original_steps)
    if args.skip is not None:
        kw["skip"] = _words(args.skip)
    kw["pool"] = base.pool
    cfg = BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)
    try:
        cfg.check()
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.render:
        res = json.loads(Path(args.render).read_text())
    else:
        res = run(cfg, base)
    write(res, cfg)
    return 0


def register(sub, add) -> None:
    # It runs jobs with their workers and consumer here: the flags of `interactor run` (the default).
    sp = add("bench", cmd_bench, "run the benchmark harness; writes docs/benchmarks.md and docs/benchmarks.png")
    sp.add_argument("--quick", action="store_true", help="a small, fast configuration (writes under runs/bench/)")
    sp.add_argument("--levels", help="concurrency levels of the load runs, e.g. 64,256,1000")
    sp.add_argument("--single-turn-levels", help="concurrency levels of the 1-step load runs, e.g. 256,1000 ('' for none)")
    sp.add_argument("--pools", help="pools to compare, e.g. gevent,threads,prefork ('' for none)")
    sp.add_argument("--pool-level", type=int, help="concurrency of the pool and process comparisons (1000)")
    sp.add_argument("--feed-level", type=int, help="concurrency of the rollout feed run (1000; 0 for none)")
    sp.add_argument("--caps-level", type=int,
                    help="concurrency of the caps', resume's and replica waits' cost runs: that load with never-binding "
                         "caps, with resume off, and with a replica, waits off and on (256; 0 for none)")
    sp.add_argument("--caps-factor", type=float, help="the caps of that run, times its concurrency (10; above 1)")
    sp.add_argument("--workers", type=int, help="worker processes sharing the concurrency (2)")
    sp.add_argument("--model-latency-ms", type=float, help="the model stand-in's latency per call, ms (1000)")
    sp.add_argument("--env-latency-ms", type=float, help="the env stand-in's latency per call, ms (20)")
    sp.add_argument("--steps", type=int, help="steps per episode (20)")
    sp.add_argument("--window", type=float, help="measured window per load run, seconds (20)")
    sp.add_argument("--warmup", type=float, help="seconds between all slots busy and the window (3)")
    sp.add_argument("--ingest-records", type=int, help="step records of the consumer's ingest run (50000)")
    sp.add_argument("--enqueue-episodes", type=int, help="episodes of the enqueue run (100000)")
    sp.add_argument("--skip", help="parts to skip: load,single,processes,pools,feed,caps,resume,waits,ingest,tokens,gateway,"
                                   "enqueue,original")
    sp.add_argument("--original", metavar="CHECKOUT",
                    help="a checkout of the original driver (BinHuangPJLAB/Safactory): compare against it "
                         "(bench/original_driver.py); without it that part is skipped")
    sp.add_argument("--original-level", type=int, help="concurrency of the comparison with the original driver (1000)")
    sp.add_argument("--original-steps", help="episode lengths of that comparison (1,5,20)")
    sp.add_argument("--original-log-level", help="the original's logging in that comparison (none: Python's default, "
                                                 "as the reference driver; a level: its launcher's logging setup at it; "
                                                 "the launcher's own defaults are INFO on the console, DEBUG to a file)")
    sp.add_argument("--original-python", metavar="PYTHON",
                    help="the interpreter that runs the original (a venv with its dependencies; default: this one)")
    sp.add_argument("--original-setup", choices=["interactor", "launcher"],
                    help="how the original is run (bench/original_runner.py): its Interactor driven directly, as the "
                         "reference driver (interactor, the default), or its whole launcher.py (launcher)")
    sp.add_argument("--original-reset-concurrency", type=int,
                    help="the original's cluster.http.startup_concurrency (0: C, never binding; 16 in its shipped config)")
    sp.add_argument("--process-counts", help="worker process counts compared at --pool-level, e.g. 2,4 ('' for none)")
    sp.add_argument("--out", help="the Markdown report (docs/benchmarks.md)")
    sp.add_argument("--png", help="the plot (docs/benchmarks.png); '' for none")
    sp.add_argument("--work", help="scratch folder (runs/bench)")
    sp.add_argument("--src", help="run workers, consumer and stand-ins from another checkout of the code")
    sp.add_argument("--render", metavar="RESULTS_JSON", help="only re-render the report from a results.json")
