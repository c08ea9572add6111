"""One benchmark run: load levels, worker-process and pool comparisons, the rollout feed, ingest,
enqueue, the comparison against the original driver; then the report (bench/benchmarks_page.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import benchmarks_page
from bench.benchmarks_plot import plot
from bench.benchlog import log
from bench.cluster import ROOT
from bench.enqueue_run import run_enqueue
from bench.feature_costs import caps_cost, resume_cost, run_commit_waits, waits_cost
from bench.feed_run import run_feed
from bench.gateway_cost import run_gateway_cost
from bench.ingest_run import run_fleet_ingest
from bench.cluster import LoadSpec
from bench.load_runs import run_load
from bench.measures import machine, to_json
from bench.original_driver import run_comparison
from bench.token_storage import run_token_storage
from broker.settings import Settings


@dataclass
class BenchConfig:
    levels: list[int] = field(default_factory=lambda: [256, 1000, 2000])
    # single-turn episodes (one step each: GRPO on math and code), where the cost of an episode
    # itself, not of its steps, decides; compared with the multi-step levels at the same C
    single_turn_levels: list[int] = field(default_factory=lambda: [256, 1000])
    pool: str = "gevent"
    pools: list[str] = field(default_factory=lambda: ["gevent", "threads"])
    pool_level: int = 1000
    workers: int = 2  # worker processes of the load runs (one per core: the comparison shows why)
    process_counts: list[int] = field(default_factory=lambda: [2, 4])  # compared at pool_level
    # (backend, consumer processes) of the ingest measurements; the first is the headline
    ingest_runs: list[tuple[str, int]] = field(default_factory=lambda: [
        ("sqlite", 1), ("sqlite", 2), ("postgres", 1), ("postgres", 2)])
    model_latency_ms: float = 1000.0
    env_latency_ms: float = 20.0
    steps: int = 20
    window_s: float = 20.0
    warmup_s: float = 3.0
    ingest_records: int = 50_000
    enqueue_episodes: int = 100_000
    token_episodes: int = 200  # 5-turn full-history episodes written with and without token ids
    gateway_calls: int = 2000  # calls through the model gateway and direct (bench/gateway_cost.py); 0: none
    # the rollout feed: a continuous job at this concurrency served to a trainer that takes a
    # batch, acknowledges it and trains for feed_train_s (bench/feed_run.py run_feed); 0: none
    feed_level: int = 1000
    feed_train_s: float = 1.0
    # the caps' cost: the load of this level again with a model cap and an env-server cap at
    # caps_factor x C (never binding), against the uncapped level of the same run; 0: none
    caps_level: int = 256
    caps_factor: float = 10.0
    # the replica waits' cost: the load of caps_level with a replica, waits off and on, and this
    # many commit points timed one by one each way
    wait_commits: int = 2000
    # against the original driver (bench/original_driver.py): a checkout of it (None: skipped),
    # at this concurrency and these episode lengths; its log level and reset concurrency (0: C)
    original: str | None = None
    original_level: int = 1000
    original_steps: list[int] = field(default_factory=lambda: [1, 5, 20])
    original_log_level: str = "none"  # none: the reference's (Python's default logging); a level: the launcher's setup
    original_reset_concurrency: int = 0
    # the interpreter that runs it (a venv with its dependencies; None: this one) and how
    # (bench/original_runner.py: "interactor", its Interactor as the reference driver runs it; "launcher")
    original_python: str | None = None
    original_setup: str = "interactor"
    skip: list[str] = field(default_factory=list)  # load, single, processes, pools, feed, caps, resume, waits, ingest, tokens, gateway, enqueue, original
    out: str = str(ROOT / "docs" / "benchmarks.md")
    png: str = str(ROOT / "docs" / "benchmarks.png")
    work: str = str(ROOT / "runs" / "bench")
    src: str | None = None

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        base = dict(levels=[16], single_turn_levels=[16], pools=[], pool_level=16, process_counts=[],
                    model_latency_ms=200.0, steps=5,
                    window_s=5.0, warmup_s=1.0, ingest_records=3000, enqueue_episodes=5000, token_episodes=20, gateway_calls=200,
                    feed_level=16, caps_level=16, wait_commits=200, original_level=16,
                    ingest_runs=[("sqlite", 1)],
                    out=str(ROOT / "runs" / "bench" / "benchmarks.md"), png=str(ROOT / "runs" / "bench" / "benchmarks.png"))
        base.update(kw)
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that would measure something else, before any run starts."""
        if "caps" not in self.skip and self.caps_level and self.caps_factor <= 1:
            raise ValueError(f"caps factor {self.caps_factor:g} would let the caps bind (they must not: the run "
                             "measures what holding them costs); give one above 1")

    def spec(self, concurrency: int, pool: str, workers: int | None = None, steps: int | None = None,
             caps_factor: float = 0.0) -> LoadSpec:
        return LoadSpec(concurrency=concurrency, pool=pool, workers=workers or self.workers,
                        model_latency_ms=self.model_latency_ms, env_latency_ms=self.env_latency_ms,
                        steps=steps or self.steps, window_s=self.window_s, warmup_s=self.warmup_s,
                        caps_factor=caps_factor)


def _commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "") if rev else "?"
    except Exception:
        return "?"


def run(cfg: BenchConfig, base: Settings | None = None) -> dict:
    cfg.check()
    base = base or Settings.from_env({})
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res: dict = {
        "machine": machine(),
        "started": benchmarks_page.now_text(),
        "commit": _commit(),
        "config": {"workers": cfg.workers, "model_latency_ms": cfg.model_latency_ms,
                   "env_latency_ms": cfg.env_latency_ms, "steps": cfg.steps, "window_s": cfg.window_s,
                   "warmup_s": cfg.warmup_s, "levels": cfg.levels, "pool": cfg.pool, "pools": cfg.pools,
                   "pool_level": cfg.pool_level, "process_counts": cfg.process_counts, "src": cfg.src,
                   "single_turn_levels": cfg.single_turn_levels, "feed_level": cfg.feed_level,
                   "feed_train_s": cfg.feed_train_s, "caps_level": cfg.caps_level,
                   "caps_factor": cfg.caps_factor, "original_level": cfg.original_level,
                   "original_steps": cfg.original_steps},
        "load": [], "single_turn": [], "pools": [], "processes": [], "ingest_runs": [],
    }
    load_by_c: dict[int, dict] = {}
    if "load" not in cfg.skip:
        for c in cfg.levels:
            r = to_json(run_load(cfg.spec(c, cfg.pool), work, src=cfg.src, base=base))
            res["load"].append(r)
            load_by_c[c] = r
    if "single" not in cfg.skip:
        for c in cfg.single_turn_levels:
            res["single_turn"].append(to_json(run_load(cfg.spec(c, cfg.pool, steps=1), work,
                                                       src=cfg.src, base=base)))
    if "processes" not in cfg.skip:
        for n in cfg.process_counts:
            if n == cfg.workers and cfg.pool_level in load_by_c:
                res["processes"].append(load_by_c[cfg.pool_level])  # the same load, already measured
                continue
            res["processes"].append(to_json(run_load(cfg.spec(cfg.pool_level, cfg.pool, n), work,
                                                     src=cfg.src, base=base)))
    if "pools" not in cfg.skip:
        for pool in cfg.pools:
            if pool == cfg.pool and cfg.pool_level in load_by_c:
                res["pools"].append(load_by_c[cfg.pool_level])  # the same load, already measured
                continue
            res["pools"].append(to_json(run_load(cfg.spec(cfg.pool_level, pool), work, src=cfg.src,
                                                 base=base)))
    if "feed" not in cfg.skip and cfg.feed_level:
        res["feed"] = to_json(run_feed(cfg.spec(cfg.feed_level, cfg.pool), work,
                                       train_s=cfg.feed_train_s, src=cfg.src, base=base))
    if "caps" not in cfg.skip and cfg.caps_level:
        res["caps"] = run_caps(cfg, load_by_c, base)
    if "resume" not in cfg.skip and cfg.caps_level:
        res["resume"] = run_resume(cfg, load_by_c, base)
    if "waits" not in cfg.skip and cfg.caps_level:
        res["waits"] = run_waits(cfg, base)
    if "ingest" not in cfg.skip:
        for backend, consumers in cfg.ingest_runs:
            r = to_json(run_fleet_ingest(cfg.ingest_records, work, backend=backend,
                                         consumers=consumers, base=base))
            res["ingest_runs"].append(r)
        if res["ingest_runs"]:
            res["ingest"] = res["ingest_runs"][0]
    if "tokens" not in cfg.skip:
        res["token_storage"] = to_json(run_token_storage(
            work, episodes=cfg.token_episodes))
    if "gateway" not in cfg.skip and cfg.gateway_calls:
        res["gateway"] = run_gateway_cost(cfg.gateway_calls)
    if "enqueue" not in cfg.skip:
        res["enqueue"] = to_json(run_enqueue(cfg.enqueue_episodes, work, base=base))
    if "original" not in cfg.skip:
        res["original"] = run_comparison(cfg, work, base)
    res["finished"] = benchmarks_page.now_text()
    res["duration_s"] = time.monotonic() - t0
    return res


def run_caps(cfg: BenchConfig, load_by_c: dict[int, dict], base: Settings) -> dict:
    """The caps' cost per step: the load at ``caps_level`` with caps that never bind, against the
    same load uncapped in this run (the load level when it was measured, else measured here)."""
    work = Path(cfg.work)
    uncapped = load_by_c.get(cfg.caps_level)
    if uncapped is None:
        uncapped = to_json(run_load(cfg.spec(cfg.caps_level, cfg.pool), work, src=cfg.src,
                                    base=base))
    capped = to_json(run_load(cfg.spec(cfg.caps_level, cfg.pool, caps_factor=cfg.caps_factor),
                              work, src=cfg.src, base=base))
    cost = caps_cost(uncapped, capped)
    log(f"  caps at {cfg.caps_factor:g}x C={cfg.caps_level}: orchestration CPU "
        f"{cost['cpu_ms_per_step_uncapped']:.3f} -> {cost['cpu_ms_per_step_capped']:.3f} ms/step "
        f"(x{cost['cpu_ratio']:.2f}); Redis {cost['redis_per_step_uncapped']:.2f} -> "
        f"{cost['redis_per_step_capped']:.2f} commands/step ({cost['redis_extra_per_step']:+.2f})")
    return {"level": cfg.caps_level, "factor": cfg.caps_factor, "uncapped": uncapped, "capped": capped} | cost


def run_resume(cfg: BenchConfig, load_by_c: dict[int, dict], base: Settings) -> dict:
    """The progress snapshots' cost per step: the load at ``caps_level`` with resume off, against
    the same load with it on (the default, as measured by the load level when it ran)."""
    work = Path(cfg.work)
    on = load_by_c.get(cfg.caps_level)
    if on is None:
        on = to_json(run_load(cfg.spec(cfg.caps_level, cfg.pool), work, src=cfg.src, base=base))
    spec = dataclasses.replace(cfg.spec(cfg.caps_level, cfg.pool), resume=False)
    off = to_json(run_load(spec, work, src=cfg.src, base=base))
    cost = resume_cost(off, on)
    log(f"  resume at C={cfg.caps_level}: orchestration CPU {cost['cpu_ms_per_step_off']:.3f} -> "
        f"{cost['cpu_ms_per_step_on']:.3f} ms/step (x{cost['cpu_ratio']:.2f}); Redis "
        f"{cost['redis_per_step_off']:.2f} -> {cost['redis_per_step_on']:.2f} commands/step "
        f"({cost['redis_extra_per_step']:+.2f})")
    return {"level": cfg.caps_level, "off": off, "on": on} | cost


def run_waits(cfg: BenchConfig, base: Settings) -> dict:
    """What waiting for a replica costs (broker/replicas.py): the load at ``caps_level`` with a
    replica beside the primary, the commit points' waits off and on; and the commit points'
    own latency each way, one at a time (what a wait adds to an episode's wall time)."""
    work = Path(cfg.work)
    runs = {mode: to_json(run_load(
        dataclasses.replace(cfg.spec(cfg.caps_level, cfg.pool), replica=True, redis_wait=mode), work, src=cfg.src,
        base=base)) for mode in ("off", "on")}
    cost = waits_cost(runs["off"], runs["on"])
    commits = to_json(run_commit_waits(work, commits=cfg.wait_commits, base=base))
    log(f"  replica waits at C={cfg.caps_level}: orchestration CPU {cost['cpu_ms_per_step_off']:.3f} -> "
        f"{cost['cpu_ms_per_step_on']:.3f} ms/step (x{cost['cpu_ratio']:.2f}); Redis "
        f"{cost['redis_per_step_off']:.2f} -> {cost['redis_per_step_on']:.2f} commands/step; a commit point "
        f"{commits['added_ms_p50']:+.3f} ms (median)")
    return {"level": cfg.caps_level, **runs, "commits": commits} | cost


def write(res: dict, cfg: BenchConfig) -> None:
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = Path(cfg.png) if cfg.png else None
    png_name = None
    if png is not None:
        try:
            plot(res, str(png))
            png_name = os.path.relpath(png, out.parent)
        except Exception as exc:  # a broken matplotlib must not lose the table
            log(f"plot failed: {exc}")
    out.write_text(benchmarks_page.render(res, png_name))
    js = Path(cfg.work) / "results.json"
    js.write_text(json.dumps(res, indent=1, default=str))
    log(f"wrote {out}" + (f" and {png}" if png_name else "") + f"; raw results in {js}")
