"""The comparison against the original driver (issue 39): ours and theirs on the same stand-ins.

This system's load run and the original's driver (BinHuangPJLAB/Safactory, from a checkout
given with ``--original``; nothing of it is in this repository), back to back on the same
stand-in processes, at one concurrency and several episode lengths; steps/s and orchestration
CPU per step, and their ratios ours / original.

Ours is the ordinary load run (bench/load_runs.py: workers + consumer + Redis). The original is
run by bench/original_runner.py, with the interpreter of a venv holding its dependencies
(``--original-python``), in one process whose CPU (children included) is its orchestration CPU:
by default its ``Interactor`` driven directly as the reference driver of issue 49 drives it
(``--original-setup interactor``), or its whole launcher (``launcher``); see that file. It gets
the same task file (the same ``countdown`` episodes in groups of 4) and is measured the same way:
ramp until C episodes have started, warm-up, then a window read off the env stand-in's counters
and psutil.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.benchlog import log
from bench.cluster import ROOT, LoadSpec, Standins, child_env
from bench.load_runs import run_load, write_countdown_tasks
from bench.measures import cpu_delta, cpu_snapshot, http_json, procs, to_json
from broker.settings import Settings
from interactor.children import spawn
from interactor.children import stop as stop_process

RUNNER = Path(__file__).resolve().parent / "original_runner.py"


def unavailable(original: str | None, python: str | None = None, setup: str = "interactor") -> str | None:
    """Why the original driver cannot be run from ``original`` with ``python`` (None: it can)."""
    if not original:
        return "no checkout of the original driver given (`interactor bench --original /path/to/Safactory`)"
    path = Path(original)
    if not (path / "launcher.py").is_file() or not (path / "interactor.py").is_file():
        return f"{original} is not a checkout of BinHuangPJLAB/Safactory (no launcher.py and interactor.py)"
    proc = subprocess.run([python or sys.executable, str(RUNNER), "--original", str(path.resolve()), "--setup", setup,
                           "--check"],
                          capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
        return f"the original driver is not importable: {reason}"
    return None


def run_comparison(cfg, work: Path, base: Settings) -> dict:
    """At ``cfg.original_level`` and each of ``cfg.original_steps``: ours, then the original, on
    one pair of stand-ins; or why it was skipped."""
    python, setup = cfg.original_python or sys.executable, cfg.original_setup
    why = unavailable(cfg.original, python, setup)
    if why:
        log(f"against the original driver: skipped ({why})")
        return {"skipped": why}
    original = str(Path(cfg.original).resolve())
    rows = []
    for steps in cfg.original_steps:
        spec = cfg.spec(cfg.original_level, cfg.pool, steps=steps)
        folder = Path(tempfile.mkdtemp(prefix=f"original-{steps}-", dir=work)).resolve()
        st = Standins.start(spec, child_env(base, cfg.src), folder / "logs", cfg.src or str(ROOT))
        try:
            log(f"against the original driver: {steps}-step episodes, C={spec.concurrency}: ours")
            ours = run_load(spec, work, src=cfg.src, base=base, standins=st)
            log(f"against the original driver: {steps}-step episodes, C={spec.concurrency}: the original")
            theirs = run_original(spec, folder, st, original, log_level=cfg.original_log_level,
                                  reset_concurrency=cfg.original_reset_concurrency, python=python, setup=setup)
        finally:
            st.stop()
        rows.append(compare(steps, _to_json(ours), theirs))
    return {"level": cfg.original_level, "original": original, "commit": _commit_of(original),
            "log_level": cfg.original_log_level, "python": python, "setup": setup,
            "reset_concurrency": cfg.original_reset_concurrency or cfg.original_level, "rows": rows}


def _to_json(r) -> dict:

    return to_json(r)


def _commit_of(path: str) -> str:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:
        out = ""
    return out or "?"


def orch_ms(r: dict) -> float:
    """Orchestration CPU ms per step of either side's result."""
    if not r.get("steps"):
        return float("nan")
    c = r["cpu_s"]
    return 1000 * sum(c.get(k, 0.0) for k in ("workers", "consumer", "redis", "original")) / r["steps"]


def compare(steps: int, ours: dict, theirs: dict) -> dict:
    """One row: both results and the ratios ours / original."""
    row: dict[str, Any] = {"steps": steps, "ours": ours, "original": theirs}
    row["rate_ratio"] = ours["rate"] / theirs["rate"] if theirs.get("rate") else float("nan")
    o, t = orch_ms(ours), orch_ms(theirs)
    row["cpu_ratio"] = o / t if t and t == t else float("nan")
    log(f"  {steps}-step: ours {ours['rate']:.1f} steps/s at {o:.3f} ms/step; original {theirs.get('rate', 0):.1f} "
        f"steps/s at {t:.3f} ms/step: x{row['rate_ratio']:.2f} steps/s, x{row['cpu_ratio']:.2f} CPU per step")
    return row


def run_original(spec: LoadSpec, folder: Path, st: Standins, original: str, *, log_level: str = "none",
                 reset_concurrency: int = 0, python: str | None = None, setup: str = "interactor") -> dict:
    """The original driver at ``spec``'s concurrency and episode length on ``st``, in ``setup``
    (bench/original_runner.py) run by ``python``: start it, wait until C episodes have started,
    warm up, measure a window, stop it."""
    res: dict[str, Any] = {"spec": {"concurrency": spec.concurrency, "steps": spec.steps,
                                    "model_latency_ms": spec.model_latency_ms, "env_latency_ms": spec.env_latency_ms,
                                    "window_s": spec.window_s, "warmup_s": spec.warmup_s, "setup": setup},
                           "steps": 0, "episodes": 0, "rate": 0.0, "efficiency": 0.0, "cpu_s": {}, "errors": []}
    ramp_limit = max(60.0, spec.concurrency * 0.12)
    # as many episodes as our load run submits (bench/load_runs.py _submit_load_job), in groups of 4
    factor = 1.5 * (1 + (max(30.0, spec.concurrency * 0.02) + spec.window_s + spec.warmup_s + 15)
                    / (spec.steps * spec.step_latency_s))
    episodes = max(spec.concurrency, int(spec.concurrency * factor))
    tasks = write_countdown_tasks(folder, st.env_url, episodes, spec.steps)
    res["rows"] = max(1, episodes // 4) * 4
    env = original_env()
    if setup == "launcher":  # its first wave spread as our workers' (the interactor setup keeps its 2 s, as the reference)
        env["AIEVOBOX_LLM_STARTUP_JITTER_S"] = str(spec.model_latency_ms / 1000)
    cmd = [python or sys.executable, str(RUNNER), "--original", original, "--setup", setup, "--folder", str(folder),
           "--tasks", tasks,
           "--env-url", st.env_url, "--model-url", st.model_url, "--concurrency", str(spec.concurrency),
           "--steps", str(spec.steps), "--reset-concurrency", str(reset_concurrency), "--log-level", log_level]
    log_path = folder / "logs" / "original.log"
    proc = spawn(cmd, env=env, log_path=log_path, cwd=str(folder))
    try:
        start = http_json(st.env_url + "/stats")
        _ramp_original(res, proc, st, start, spec, ramp_limit, folder / "original.sqlite" if setup == "launcher" else None)
        left = res["rows"] - (http_json(st.env_url + "/stats")["resets"] - start["resets"])
        if left < 1.2 * (spec.warmup_s + spec.window_s) * spec.ideal_rate / spec.steps:
            res["errors"].append(f"only {left} of its task rows were left for warm-up and window: it may have "
                                 "run short of episodes (its rows went in slower than it used them)")
        time.sleep(spec.warmup_s)
        _window_original(res, proc, st, spec)
        if proc.poll() is not None:
            res["errors"].append(f"the original driver exited with {proc.returncode} (see {log_path})")
    except Exception as exc:
        res["errors"].append(f"{type(exc).__name__}: {exc} (see {log_path})")
    finally:
        stop_process(proc, 10, signal.SIGKILL)
    log(f"  original: {res['rate']:.1f} steps/s of ideal {spec.ideal_rate:.1f}; orchestration CPU "
        f"{orch_ms(res):.3f} ms/step" + (f"; problems: {res['errors']}" if res["errors"] else ""))
    return res


def original_env() -> dict[str, str]:
    """The original's environment: this process's without our settings (``INTERACTOR_*``,
    ``REDIS_URL``: the ~100 of ``Settings.as_environ`` that our children get), ``PYTHONPATH`` and
    proxies. Its size is part of the original's cost per step: its aiohttp sessions trust the
    environment, so every request scans all of ``os.environ`` twice for proxy settings (in a
    thread); with our settings added that cost ~25% more CPU per step than the reference
    driver's (bench/notes.md)."""
    proxies = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("INTERACTOR_") and k not in ("REDIS_URL", "PYTHONPATH", *proxies)}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _rows_in(db: Path) -> int:
    """The task rows the original's launcher has put in its table so far."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute("SELECT count(*) FROM job_environments").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _ramp_original(res: dict, proc: subprocess.Popen, st: Standins, start: dict, spec: LoadSpec,
                   ramp_limit: float, db: Path | None) -> None:
    """Until C episodes have asked for a prompt since the start; in the launcher setup (``db``),
    also until C instances are live (its pool resets them ahead) and its background insert of the
    task rows has finished (it inserts the first 2 x C rows, then the rest in batches of C while the episodes
    run: not in the window)."""
    t0 = time.monotonic()
    started = 0
    rows = res["rows"] if db is None else 0
    while time.monotonic() - t0 < ramp_limit:
        if proc.poll() is not None:
            raise RuntimeError(f"the original driver exited with {proc.returncode} during ramp-up")
        now = http_json(st.env_url + "/stats")
        live = now.get("live", 0) - start.get("live", 0)
        started = now["prompts"] - start["prompts"]
        if started >= spec.concurrency and (db is None or (  # the interactor setup holds no instance between episodes
                live >= spec.concurrency and (rows := _rows_in(db)) >= res["rows"])):
            break
        time.sleep(0.2)
    res["ramp_s"] = time.monotonic() - t0
    if started < spec.concurrency:
        res["errors"].append(f"only {started} of {spec.concurrency} episodes started in {ramp_limit:.0f} s")
    elif rows < res["rows"]:
        res["errors"].append(f"only {rows} of its {res['rows']} task rows inserted in {ramp_limit:.0f} s")


def _window_original(res: dict, proc: subprocess.Popen, st: Standins, spec: LoadSpec) -> None:
    roles = {"original": lambda: procs(proc), "env": lambda: procs(st.env_p), "model": lambda: procs(st.model_p)}
    snap0 = {r: cpu_snapshot(f()) for r, f in roles.items()}
    env0 = http_json(st.env_url + "/stats")
    mach0 = psutil.cpu_times()
    t0 = time.monotonic()
    time.sleep(spec.window_s)
    env1 = http_json(st.env_url + "/stats")
    t1 = time.monotonic()
    snap1 = {r: cpu_snapshot(f()) for r, f in roles.items()}
    mach1 = psutil.cpu_times()
    res["steps"] = env1["steps"] - env0["steps"]
    res["episodes"] = env1.get("closes", 0) - env0.get("closes", 0)
    res["window_s"] = t1 - t0
    res["rate"] = res["steps"] / res["window_s"]
    res["efficiency"] = res["rate"] / spec.ideal_rate
    res["cpu_s"] = {r: cpu_delta(snap0[r], snap1[r]) for r in snap0}
    busy = (sum(mach1) - mach1.idle - getattr(mach1, "iowait", 0)) - (sum(mach0) - mach0.idle - getattr(mach0, "iowait", 0))
    res["machine_busy"] = busy / max(1e-9, sum(mach1) - sum(mach0))


def _f(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:,.{nd}f}"


def section(res: dict) -> list[str]:
    """docs/benchmarks.md's "Against the original driver"."""
    cmp = res.get("original")
    if not cmp:
        return []
    out = ["## Against the original driver\n"]
    commit = cmp.get("commit")
    if cmp.get("skipped"):
        return out + [f"Not measured in this run: {cmp['skipped']}.\n"]
    setup = cmp.get("setup", "launcher")
    out.append(
        f"The driver this project was rebuilt from (BinHuangPJLAB/Safactory at `{commit}`, a checkout given "
        f"with `--original`), {SETUP_TEXT[setup].format(**cmp)}, one process, and this system's load run, back to "
        f"back on the same stand-in processes, at C={cmp['level']}; the same task file for both. Orchestration "
        "CPU: ours workers + consumer + Redis, the original its one process (children included). Ratios are "
        "ours / original.\n")
    rows = []
    for r in cmp["rows"]:
        o, t = r["ours"], r["original"]
        rows.append((r["steps"], _f(o["rate"], 1), _f(t.get("rate"), 1), f"x{_f(r['rate_ratio'])}",
                     _f(orch_ms(o), 3), _f(orch_ms(t), 3), f"x{_f(r['cpu_ratio'])}",
                     _f(o.get("efficiency"), 3), _f(t.get("efficiency"), 3),
                     "; ".join((o.get("errors") or []) + [f"original: {e}" for e in t.get("errors") or []])))
    header = ["steps/episode", "ours steps/s", "original steps/s", "steps/s ratio", "ours orch. CPU ms/step",
              "original CPU ms/step", "CPU/step ratio", "ours efficiency", "original efficiency", "problems"]
    out.append("| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|")
    out += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    out.append("\nWhat the two do differently, per step and per episode (so the ratios are read for what they are):\n")
    cfg = res.get("config") or {}
    out += ["* " + d.format(workers=cfg.get("workers", "?"), pool=cfg.get("pool", "?"))
            for d in (SETUP_DIFFERENCES[setup], *DIFFERENCES)]
    return out + [""]


SETUP_TEXT = {
    "interactor": "its `Interactor` driven directly as the reference driver of issue 49 drives it "
                  "(`bench/original_runner.py`, `--original-setup interactor`: a minimal pool over the task file "
                  "that resets an instance as a worker takes it and deletes it when the episode ends, its real "
                  "`DataManager` with the launcher's arguments, C keep-alive connections opened before the "
                  "episodes; logging {log_level})",
    "launcher": "run as its launcher runs it (`bench/original_runner.py`, `--original-setup launcher`: its SQLite "
                "task table, its pool manager resetting C x 1.2 env instances ahead and refilling one as an "
                "episode ends, its `Interactor`, its buffered SQLite step sink; log level {log_level}, reset "
                "concurrency (`cluster.http.startup_concurrency`, 16 in its shipped config) {reset_concurrency})",
}

SETUP_DIFFERENCES = {
    "interactor": "**Reset and close.** Both reset the env instance at the start of the episode and close it at "
                  "the end, inside the episode's slot (two env latencies per episode): the same ideal.",
    "launcher": "**Reset and close.** Ours resets the env instance at the start of the episode and closes it at "
                "the end, inside the episode's slot (two env latencies per episode). The original resets C x 1.2 "
                "instances ahead and closes and refills one in a background task after its episode, so its slot "
                "holds only the steps: at 1 step, model 1 s, env 20 ms, its ideal is about 4% more steps/s than "
                "ours at the same C.",
}

DIFFERENCES = (
    "**Delivery and state.** Ours: a Celery message per episode through Redis, the ledger's START and FINISH "
    "(lease, attempt, fencing, counters), the lease renewer, the attempt and step records published to a Redis "
    "stream, and the consumer's batched commit into SQLite: an episode survives a worker's crash. The original: "
    "episodes handed out by a pool in the same process, no lease, no redelivery; an episode whose process dies "
    "is lost.",
    "**Records.** Both store every step with the messages sent. The original's `record_step` buffers ORM "
    "objects and bulk-inserts 100 at a time (or every 5 s) in the same process, then reads their ids back; "
    "ours stores through the consumer (its CPU counted).",
    "**Processes.** Ours: {workers} worker processes ({pool}), a consumer and Redis, so CPU is spread over processes and "
    "the two cores. The original: one asyncio process (one core at most), C worker coroutines, aiohttp.",
    "**Logging.** The original as above (its launcher's defaults are INFO to the console and DEBUG to a file: "
    "several lines per step; `none` is Python's default, as the reference driver runs it); ours at its usual "
    "INFO: one line per episode.",
    "**Environment.** The original runs with the bench's environment without our settings (`INTERACTOR_*`): its "
    "aiohttp sessions scan the whole environment for proxies on every request.",
    "**Imports.** The original's code is run unchanged, from a checkout with the interpreter given by "
    "`--original-python`; the launcher setup shims two imports it never executes (`wandb` and `env.env_factory`, "
    "see `bench/original_runner.py`). The bench's env stand-in accepts `env_param` as JSON text, as the original's "
    "env server does (its launcher sends its DB column as stored).",
)
