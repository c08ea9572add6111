"""docs/benchmarks.md and its plot, from one run's results (a JSON-able dict).

Every figure of a table comes from the same run. ``bench/notes.md`` (hand-written: the
before/after of each fix and why a target misses) is appended verbatim.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

TARGETS = {
    "efficiency_256": 0.97,
    "efficiency_1000": 0.93,
    "cpu_ms_per_step": 1.0,  # at concurrency 256 and 1000
    "mem_mb_per_episode": 0.2,
    "ingest_rate": 40_000,  # SQLite, one consumer
    "enqueue_rate": 20_000,
    "latency_p99_ms_1000": 250.0,
    # single-turn episodes (1 step each)
    "single_efficiency_1000": 0.9,
    "single_cpu_ms_per_step": 1.5,
    "cpu_ms_per_episode_overhead": 1.0,  # beyond its steps: workers + consumer + Redis
    # Redis commands (INFO commandstats, a Lua script's own commands included) per 1-step
    # episode, set after counting what one costs (bench/notes.md): kombu's delivery 10 (BRPOP;
    # MULTI ZADD HSET EXEC on receipt; MULTI ZREM HDEL EXEC on ack), the ledger's START and
    # FINISH scripts about 22 (lease, attempt, counters, clock), the step and attempt records 2,
    # the reservation and the consumer's and sweeper's share about 6; runs read 39 to 41.
    "redis_commands_per_single_episode": 42.0,
    # what fleet-wide caps that never bind add to a 20-step episode's step (issue 25: "the cost of
    # the caps per step (Redis round trips)"): every round trip is at least one command, so the
    # commands added bound the round trips added
    "caps_redis_per_step": 0.5,
    "caps_cpu_ratio": 1.10,
}
CPU_TARGET_LEVELS = (256, 1000)

NOTES = Path(__file__).resolve().parent / "notes.md"


def _f(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, (int, float)) and abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def orch_ms(r: dict) -> float:
    c = r["cpu_s"]
    if not r["steps"]:
        return float("nan")
    return 1000 * (c.get("workers", 0) + c.get("consumer", 0) + c.get("redis", 0)) / r["steps"]


def role_ms(r: dict, role: str) -> float:
    if not r["steps"]:
        return float("nan")
    return 1000 * r["cpu_s"].get(role, 0.0) / r["steps"]


def mem_per_ep(r: dict) -> float:
    return (r["worker_pss_load_mb"] - r["worker_pss_idle_mb"]) / r["spec"]["concurrency"]


def ms_per_episode(r: dict) -> float:
    c = r["cpu_s"]
    if not r.get("episodes"):
        return float("nan")
    return 1000 * (c.get("workers", 0) + c.get("consumer", 0) + c.get("redis", 0)) / r["episodes"]


def redis_calls_per_episode(r: dict) -> float:
    return sum((r.get("redis_calls") or {}).values()) / r["episodes"] if r.get("episodes") else float("nan")


def episode_overhead_ms(single: dict, multi: dict) -> float:
    """CPU per episode beyond its steps, from two levels at the same concurrency: per step,
    a 1-step run costs a + b and an n-step run a + b / n, so b = (1-step - n-step) * n / (n - 1)."""
    n = multi["spec"]["steps"]
    if n <= 1:
        return float("nan")
    return (orch_ms(single) - orch_ms(multi)) * n / (n - 1)


def redis_extra_per_episode(single: dict, multi: dict) -> float:
    """Redis commands per episode beyond its steps' own, the same way as :func:`episode_overhead_ms`."""
    n = multi["spec"]["steps"]
    per_step = lambda r: sum((r.get("redis_calls") or {}).values()) / r["steps"] if r["steps"] else float("nan")  # noqa: E731
    return (per_step(single) - per_step(multi)) * n / (n - 1) if n > 1 else float("nan")


def _by_c(runs: list[dict], c: int) -> dict | None:
    for r in runs:
        if r["spec"]["concurrency"] == c:
            return r
    return None


def target_rows(res: dict) -> list[tuple]:
    """(metric, target text, measured text, ratio, met) rows; ratio >= 1 means met by that margin."""
    rows = []
    load = res.get("load", [])

    def row(metric, target_txt, measured, target, higher_is_better, nd=2, unit=""):
        if measured is None or (isinstance(measured, float) and math.isnan(measured)):
            rows.append((metric, target_txt, "n/a", "n/a", "not measured"))
            return
        if measured <= 0 and higher_is_better:
            rows.append((metric, target_txt, _f(measured, nd) + unit, "0.00x", "**no**"))
            return
        ratio = measured / target if higher_is_better else (target / measured if measured > 0 else math.inf)
        rows.append((metric, target_txt, _f(measured, nd) + unit, f"{ratio:.2f}x", "yes" if ratio >= 1 else "**no**"))

    for r in load:
        c = r["spec"]["concurrency"]
        tgt = {256: TARGETS["efficiency_256"], 1000: TARGETS["efficiency_1000"]}.get(c)
        if tgt is None:
            rows.append((f"Efficiency at concurrency {c}", "(none)", _f(r["efficiency"], 3), "", ""))
        else:
            row(f"Efficiency at concurrency {c}", f">= {tgt}", r["efficiency"], tgt, True, 3)
    for r in load:
        c = r["spec"]["concurrency"]
        if c in CPU_TARGET_LEVELS:
            row(f"Orchestration CPU per step, concurrency {c}", "<= 1 ms", orch_ms(r), TARGETS["cpu_ms_per_step"],
                False, 3, " ms")
        else:
            rows.append((f"Orchestration CPU per step, concurrency {c}", "(none)", _f(orch_ms(r), 3) + " ms", "", ""))
    for r in load:
        c = r["spec"]["concurrency"]
        row(f"Worker memory per concurrent episode, concurrency {c}", "<= 0.2 MB", mem_per_ep(r),
            TARGETS["mem_mb_per_episode"], False, 3, " MB")
    for r in res.get("single_turn", []):
        c = r["spec"]["concurrency"]
        if c == 1000:
            row("Single-turn efficiency, concurrency 1000", ">= 0.9", r["efficiency"],
                TARGETS["single_efficiency_1000"], True, 3)
        row(f"Single-turn orchestration CPU per step, concurrency {c}", "<= 1.5 ms", orch_ms(r),
            TARGETS["single_cpu_ms_per_step"], False, 3, " ms")
        row(f"Redis commands per single-turn episode, concurrency {c}", "<= 42", redis_calls_per_episode(r),
            TARGETS["redis_commands_per_single_episode"], False, 1)
        multi = _by_c(load, c)
        if multi is not None:
            row(f"Orchestration CPU per episode beyond its steps, concurrency {c}", "<= 1 ms",
                episode_overhead_ms(r, multi), TARGETS["cpu_ms_per_episode_overhead"], False, 3, " ms")
    ing = res.get("ingest")
    if ing:
        row("Consumer ingest (records/s into SQLite, one consumer)", ">= 40,000", ing["rate"], TARGETS["ingest_rate"],
            True, 0)
    enq = res.get("enqueue")
    if enq:
        row(f"Enqueue ({enq['episodes']:,}-episode job, episodes/s)", ">= 20,000", enq["rate"],
            TARGETS["enqueue_rate"], True, 0)
    cp = res.get("caps")
    if cp:
        extra = cp["redis_extra_per_step"]
        if isinstance(extra, float) and not math.isnan(extra) and extra <= 0:
            rows.append((f"Redis commands the caps add per step, concurrency {cp['level']}", "<= 0.5",
                         _f(extra, 2), "", "yes"))
        else:
            row(f"Redis commands the caps add per step, concurrency {cp['level']}", "<= 0.5", extra,
                TARGETS["caps_redis_per_step"], False, 2)
        row(f"Orchestration CPU per step with caps / without, concurrency {cp['level']}", "<= 1.10",
            cp["cpu_ratio"], TARGETS["caps_cpu_ratio"], False, 2)
    for r in load:
        c = r["spec"]["concurrency"]
        lat = r.get("latency_ms") or {}
        if c == 1000:
            row("Record latency p99, concurrency 1000", "<= 250 ms", lat.get("p99"), TARGETS["latency_p99_ms_1000"],
                False, 0, " ms")
        else:
            rows.append((f"Record latency p99, concurrency {c}", "(none)", _f(lat.get("p99"), 0) + " ms", "", ""))
    return rows


def _table(header: list[str], rows: list[tuple]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def load_rows(runs: list[dict]) -> list[tuple]:
    rows = []
    for r in runs:
        s = r["spec"]
        lat = r.get("latency_ms") or {}
        st = r.get("step_time_ms") or {}
        rows.append((
            s["concurrency"], s["pool"], f"{s['workers']}", _f(r["rate"], 1), _f(s["concurrency"] / _step_s(s), 1),
            _f(r["efficiency"], 3), _f(orch_ms(r), 3), _f(role_ms(r, "workers"), 3), _f(role_ms(r, "consumer"), 3),
            _f(role_ms(r, "redis"), 3), _f(role_ms(r, "env") + role_ms(r, "model"), 3), f"{100 * r['machine_busy']:.0f}%",
            " / ".join(_f(st.get(k), 0) for k in ("interval", "model", "env", "own")) if st else "n/a",
            _f(r["worker_pss_idle_mb"], 0), _f(r["worker_pss_load_mb"], 0), _f(mem_per_ep(r), 3),
            _f(lat.get("p50"), 0), _f(lat.get("p99"), 0), _f(r["ramp_s"], 1),
            "; ".join(r.get("errors") or []) or "",
        ))
    return rows


LOAD_HEADER = ["C", "pool", "worker procs", "steps/s", "ideal", "efficiency", "orch. CPU ms/step", "workers",
               "consumer", "redis", "stand-ins (apart)", "machine busy", "step ms: interval / model / env / own",
               "worker PSS idle MB", "loaded MB", "MB/episode", "latency p50 ms", "p99 ms", "ramp s", "problems"]


def compare_rows(before: dict, after: dict) -> list[tuple]:
    """Headline figures of two runs side by side (for bench/notes.md)."""
    rows = []
    bl = {r["spec"]["concurrency"]: r for r in before.get("load", [])}
    for r in after.get("load", []):
        c = r["spec"]["concurrency"]
        b = bl.get(c)
        if b is None:
            continue
        rows.append((f"efficiency, C={c}", _f(b["efficiency"], 3), _f(r["efficiency"], 3)))
        rows.append((f"orchestration CPU ms/step, C={c}", _f(orch_ms(b), 2), _f(orch_ms(r), 2)))
        rows.append((f"record latency p99 ms, C={c}", _f((b.get("latency_ms") or {}).get("p99"), 0),
                     _f((r.get("latency_ms") or {}).get("p99"), 0)))
    bp = {r["spec"]["pool"]: r for r in before.get("pools", [])}
    for r in after.get("pools", []):
        b = bp.get(r["spec"]["pool"])
        if b is not None:
            rows.append((f"pool {r['spec']['pool']} (C={r['spec']['concurrency']}): efficiency, CPU ms/step",
                         f"{b['efficiency']:.3f}, {orch_ms(b):.2f}", f"{r['efficiency']:.3f}, {orch_ms(r):.2f}"))
    for key, label in (("ingest", "consumer ingest records/s"), ("enqueue", "enqueue episodes/s")):
        if before.get(key) and after.get(key):
            rows.append((label, _f(before[key]["rate"], 0), _f(after[key]["rate"], 0)))
    return rows


def _step_s(s: dict) -> float:
    env = s["env_latency_ms"] / 1000
    return s["model_latency_ms"] / 1000 + 2 * env + 2 * env / s["steps"]


def choose_pool(pools: list[dict]) -> tuple[str, list[str]]:
    """The default pool from the comparison: efficiency first (within 2 points counts as a
    tie), then orchestration CPU, then memory."""
    ok = [r for r in pools if not r.get("errors")] or pools
    if not ok:
        return "threads", ["no pool comparison in this run"]
    best_eff = max(r["efficiency"] for r in ok)
    contenders = [r for r in ok if r["efficiency"] >= best_eff - 0.02]
    contenders.sort(key=lambda r: (orch_ms(r), mem_per_ep(r)))
    pick = contenders[0]
    why = []
    for r in pools:
        p = r["spec"]["pool"]
        why.append(f"{p}: efficiency {r['efficiency']:.3f}, {orch_ms(r):.2f} ms CPU/step, "
                   f"{mem_per_ep(r):.2f} MB/episode, p99 {(r.get('latency_ms') or {}).get('p99', float('nan')):.0f} ms"
                   + (f" (problems: {'; '.join(r['errors'])})" if r.get("errors") else ""))
    return pick["spec"]["pool"], why


def feed_section(fd: dict) -> list[str]:
    """The rollout feed's figures (bench/harness.py ``run_feed``)."""
    s = fd["spec"]
    lat = fd.get("latency_ms") or {}
    st = fd.get("stats") or {}
    out = ["## Rollout feed\n",
           f"A continuous job at concurrency {s['concurrency']} (groups of {fd['group']} `countdown` episodes of "
           f"{s['steps']} steps, the load runs' latencies) served by `interactor feed serve --job J` to a trainer "
           f"loop that takes {fd['batch']} groups (what the fleet ideally completes in {fd['train_s']:g} s), "
           f"acknowledges them and trains for {fd['train_s']:g} s, max_ahead {fd['max_ahead']}. "
           "Measured over a "
           f"{fd['window_s']:.0f} s window: **group delivery latency** runs from the group's completion (its last "
           "member's attempt end, as stored) to the return of the take that handed it to the trainer, and the "
           "**trainer idle fraction** is the trainer's time inside take divided by the window.\n",
           _table(["C", "batch", "max_ahead", "takes", "groups delivered", "groups/s", "delivery latency p50",
                   "delivery latency p99", "trainer idle fraction", "redelivered", "problems"],
                  [(s["concurrency"], fd["batch"], fd["max_ahead"], fd["takes"], fd["groups"], _f(fd["rate"], 1),
                    _f(lat.get("p50"), 0) + " ms", _f(lat.get("p99"), 0) + " ms",
                    _f(fd["idle_fraction"], 3), st.get("redelivered", "n/a"),
                    "; ".join(fd.get("errors") or []))]) + "\n"]
    return out


def caps_section(cp: dict) -> list[str]:
    """The caps' cost per step (bench/run.py ``run_caps``, harness ``caps_cost``): the same load
    with and without fleet-wide caps that never bind."""
    u, c = cp["uncapped"], cp["capped"]
    s = c["spec"]
    n = math.ceil(cp["factor"] * cp["level"])
    target = TARGETS["cpu_ms_per_step"]
    within = "yes" if cp["cpu_ms_per_step_capped"] <= target else "**no**"
    return ["## Cost of the fleet-wide caps\n",
            f"The load at concurrency {cp['level']} ({s['steps']}-step `countdown` episodes, the load runs' "
            f"latencies) run again with a model cap and an env-server cap (`max_concurrency` {n:,}, "
            f"{cp['factor']:g}x C: they never bind), against the uncapped run of the same level in this run. "
            "What is left is what holding the caps costs: each worker process takes slots from Redis in blocks, "
            "lends them to its calls, renews its lease every second and gives back what it did not need "
            "(workers/fleetcaps.py). Every round trip is at least one command, so the commands the caps add "
            "per step bound the round trips they add.\n",
            _table(["C", "caps", "steps/s", "efficiency", "orchestration CPU per step", "Redis commands per step",
                    "problems"],
                   [(cp["level"], "none", _f(u["rate"], 1), _f(u["efficiency"], 3),
                     _f(cp["cpu_ms_per_step_uncapped"], 3) + " ms", _f(cp["redis_per_step_uncapped"], 2),
                     "; ".join(u.get("errors") or [])),
                    (cp["level"], f"{n:,}", _f(c["rate"], 1), _f(c["efficiency"], 3),
                     _f(cp["cpu_ms_per_step_capped"], 3) + " ms", _f(cp["redis_per_step_capped"], 2),
                     "; ".join(c.get("errors") or []))]) + "\n",
            f"**Caps' cost per step:** orchestration CPU x{_f(cp['cpu_ratio'], 2)} "
            f"({_f(cp['cpu_ms_per_step_capped'] - cp['cpu_ms_per_step_uncapped'], 3)} ms), "
            f"{_f(cp['redis_extra_per_step'], 2)} Redis commands more (so at most that many round trips); "
            f"with the caps, within the per-step CPU target (<= {target:g} ms): {within}.\n"]


def render(res: dict, png_name: str | None) -> str:
    m = res["machine"]
    cfg = res["config"]
    out = []
    out.append("# Benchmarks\n")
    out.append(f"Generated by `make bench` (`interactor bench`) on {res['finished']}, code at `{res.get('commit', '?')}`; "
               f"the whole run took {res.get('duration_s', 0) / 60:.1f} min. Every figure below comes from that one run; "
               "timings are ratios within it (efficiency = achieved / ideal), because the machine is shared and noisy.\n")
    out.append("## How to run\n")
    out.append("```\nmake bench                     # everything, ~10 min; rewrites docs/benchmarks.md and docs/benchmarks.png\n"
               "interactor bench --quick       # a 20-second smoke version (writes to runs/bench/)\n"
               "interactor bench --levels 256 --pools '' --skip ingest,enqueue   # one load level only\n"
               "interactor bench --src /path/to/other/checkout   # workers, consumer, stand-ins from another checkout\n"
               "interactor bench --render runs/bench/results.json  # re-render this page from a run's raw results\n```\n")
    out.append("The load runs start, per level and in a fresh folder: an embedded Redis (append-only file on, as "
               "`interactor run` uses it), the env and model stand-ins in their own processes (`bench/standins.py`: "
               "same wire protocol as `examples/`, one asyncio loop each, so they stay cheap), "
               f"{cfg['workers']} `interactor worker` processes sharing the concurrency C, and the consumer "
               "(`interactor consumer` plus a latency observer, `bench/consumer.py`). A job of `countdown` episodes "
               f"({cfg['steps']} steps each, prompts of ~2-3 KB: a 1.5 KB system message plus the last 3 turns) keeps "
               "every slot busy; once all C episodes run, a "
               f"{cfg['window_s']:.0f} s window is measured after {cfg['warmup_s']:.0f} s of warm-up.\n")
    out.append(f"* **Ideal steps/s** = C / (model + 2 x env + 2 x env / steps) = C / "
               f"({cfg['model_latency_ms'] / 1000:g} + 2 x {cfg['env_latency_ms'] / 1000:g} + 2 x "
               f"{cfg['env_latency_ms'] / 1000:g} / {cfg['steps']}) s = C / {_step_s(cfg):.3f} s: a step is "
               "get_task_prompt, the model, step; reset and close are two more env calls per episode, spread over "
               "its steps.")
    out.append("* **Steps/s**: the env stand-in's step counter at both ends of the window.")
    out.append("* **Step ms: interval / model / env / own**: the mean time between consecutive steps of an episode "
               "in the window, split into the model and env waits the worker measured and the rest (the worker's own "
               "time: loop, record, publish, and any wait for the GIL or a core). Waits longer than the configured "
               "latencies mean a busy worker or machine (a reply is only read when the thread gets the GIL).")
    out.append("* **Orchestration CPU per step**: CPU seconds (user + system, children included) of the worker "
               "processes, the consumer and Redis in the window, divided by the steps; the stand-ins are measured "
               "the same way and reported apart.")
    out.append("* **Worker memory per concurrent episode**: (PSS of all worker processes in the middle of the window "
               "- PSS once started, idle) / C. PSS, so prefork children are not charged for pages they share.")
    out.append("* **Record latency**: from `StepRecord.created_at` (the worker, when the step is done) to the "
               "consumer's commit + XACK of the batch holding it, for the steps made in the window.")
    out.append("* **Ingest**: records/s through real `interactor consumer` processes (one consumer group: "
               "XREADGROUP, decode, one transaction per batch, XACK after the commit), into SQLite "
               "(`synchronous=FULL`) or a PostgreSQL server the run starts; the consumers wait on an empty stream, "
               "then step records of 256 interleaved episodes (about 3.5 KB each, a closing attempt record per "
               "episode) are added as fast as a pipeline can, and the clock stops when all are acknowledged.")
    out.append("* **Enqueue**: `interactor submit` of a task file expanding to the job (plan: read, validate, "
               "expand; then the ledger and the queue), episodes/s end to end.\n")

    out.append("## The machine\n")
    out.append(f"{m['cores']} cores ({m['cpu']}), {m['ram_gb']} GB RAM, {m['os']}, Python {m['python']}, "
               f"Redis {m.get('redis', '?')}, Celery {m.get('celery', '?')}. Load average when the run started: "
               f"{', '.join(str(x) for x in m['loadavg'])} (the machine is shared: the *machine busy* column is "
               "everything running on it, not only this benchmark).\n")

    out.append("## Targets\n")
    out.append("Ratio: measured / target for a floor, target / measured for a ceiling; at least 1.00x means met.\n")
    out.append(_table(["Metric", "Target", "Measured", "Ratio", "Met?"], target_rows(res)) + "\n")

    misses = [r for r in target_rows(res) if r[4] == "**no**"]
    if misses:
        out.append("Missed in this run: " + "; ".join(f"{r[0]} ({r[2]} against {r[1]}, {r[3]})" for r in misses)
                   + ". Why, and what would close each gap: see *Notes* below.\n")

    if res.get("load"):
        out.append("## Load runs\n")
        out.append(f"Model latency {cfg['model_latency_ms']:g} ms, env latency {cfg['env_latency_ms']:g} ms per call, "
                   f"pool `{res['load'][0]['spec']['pool']}`. CPU columns are ms per step.\n")
        out.append(_table(LOAD_HEADER, load_rows(res["load"])) + "\n")
    single = res.get("single_turn") or []
    if single:
        out.append("## Single-turn episodes\n")
        out.append("The same load with 1-step episodes (a prompt, one answer, one step: single-turn RL), where "
                   "what an episode costs beyond its steps (its task message, lease, reset and close, attempt "
                   "record, rows) is paid on every step. Ideal steps/s = C / (model + 4 x env).\n")
        out.append(_table(LOAD_HEADER, load_rows(single)) + "\n")
        rows = []
        for r in single:
            c = r["spec"]["concurrency"]
            multi = _by_c(res.get("load") or [], c)
            rows.append((c, _f(r.get("episodes"), 0), _f(ms_per_episode(r), 3),
                         _f(episode_overhead_ms(r, multi), 3) if multi else "n/a",
                         _f(redis_calls_per_episode(r), 1),
                         _f(redis_extra_per_episode(r, multi), 1) if multi else "n/a",
                         ", ".join(f"{k} {v / max(1, r['episodes']):.1f}" for k, v in
                                   sorted((r.get("redis_calls") or {}).items(), key=lambda kv: -kv[1])[:8])))
        out.append(_table(["C", "episodes in window", "orch. CPU ms/episode (1 step)",
                           "CPU ms/episode beyond its steps", "Redis commands/episode",
                           "Redis commands/episode beyond its steps", "top commands per episode"], rows) + "\n")
        out.append("*Beyond its steps*: per step, a 1-step episode costs a + b and an n-step episode a + b / n "
                   "(b: what the episode itself costs), so b = (1-step - n-step) x n / (n - 1), from the two runs "
                   "at the same concurrency. Redis commands count those Lua scripts run under their own names.\n")
    if png_name:
        out.append(f"![benchmarks]({png_name})\n")

    procs = res.get("processes") or []
    if procs:
        out.append("## Worker processes\n")
        out.append(f"The same load (concurrency {procs[0]['spec']['concurrency']}, pool "
                   f"`{procs[0]['spec']['pool']}`) split over a different number of worker processes:\n")
        out.append(_table(LOAD_HEADER, load_rows(procs)) + "\n")

    pools = res.get("pools") or []
    if pools:
        out.append("## Worker pools\n")
        out.append(f"The same load (concurrency {pools[0]['spec']['concurrency']}, same latencies, "
                   f"{pools[0]['spec']['workers']} worker processes) with each pool:\n")
        out.append(_table(LOAD_HEADER, load_rows(pools)) + "\n")
        pick, why = choose_pool(pools)
        out.append(f"**Chosen default: `{pick}`** (rule: the best efficiency, within 0.02 counting as a tie, then the "
                   "least orchestration CPU per step, then memory).\n")
        out += [f"* {w}" for w in why]
        out.append("")

    fd = res.get("feed")
    if fd:
        out += feed_section(fd)

    if res.get("caps"):
        out += caps_section(res["caps"])

    runs = res.get("ingest_runs") or []
    if runs:
        out.append("## Consumer ingest\n")
        rows = []
        for r in runs:
            n = max(1, r["records"])
            rows.append((r["backend"], r["consumers"], f"{r['records']:,}", f"{r['seconds']:.2f}",
                         f"**{r['rate']:,.0f}**", f"{1e6 * r['cpu_consumers_s'] / n:.0f}",
                         f"{1e6 * r['cpu_redis_s'] / n:.0f}",
                         f"{1e6 * r['cpu_database_s'] / n:.0f}" if r["backend"] == "postgres" else "(in the consumer)",
                         "; ".join(r.get("errors") or [])))
        out.append(_table(["backend", "consumer processes", "records", "seconds", "records/s",
                           "consumer CPU us/record", "Redis CPU us/record", "database server CPU us/record",
                           "problems"], rows) + "\n")
    tok = res.get("token_storage")
    if tok:
        ids = max(1, tok["stored_ids"])
        out.append("## Token storage\n")
        out.append(f"{tok['episodes']} full-history episodes of {tok['turns']} turns (each turn's prompt is the last "
                   "one plus the answer and the env's reply) written through the real SQLite store with their token "
                   "fields: prompt ids and completion ids packed little-endian int32, logprobs float32, as blobs.\n")
        out.append(_table(["figure", "value"], [
            ("sampled tokens (completion ids)", f"{tok['sampled_tokens']:,}"),
            ("stored ids (each turn's prompt and completion)", f"{tok['stored_ids']:,}"),
            ("**bytes per stored id** (ids + logprobs)", f"**{tok['token_bytes'] / ids:.2f}**"),
            ("bytes per sampled token (the prompts' repeats included)",
             f"{tok['token_bytes'] / max(1, tok['sampled_tokens']):.1f}"),
            ("the same numbers as JSON text, bytes per stored id", f"{tok['json_bytes'] / ids:.2f}"),
            ("sampled tokens' strings (for the browser), bytes per sampled token",
             f"{tok['texts_bytes'] / max(1, tok['sampled_tokens']):.1f}"),
            ("SQLite file growth over the same job without tokens, bytes per stored id",
             f"{tok['file_growth_bytes'] / ids:.2f}"),
        ]) + "\n")
    enq = res.get("enqueue")
    if enq:
        out.append("## Enqueue\n")
        out.append(f"{enq['episodes']:,} episodes: plan {enq['plan_s']:.2f} s, ledger + queue {enq['enqueue_s']:.2f} s: "
                   f"**{enq['rate']:,.0f} episodes/s** end to end ({enq['enqueue_rate']:,.0f}/s for ledger + queue alone)."
                   + (f" Problems: {'; '.join(enq['errors'])}." if enq.get("errors") else "") + "\n")

    if NOTES.exists():
        out.append(NOTES.read_text().rstrip() + "\n")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    load = res.get("load") or []
    pools = res.get("pools") or []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [str(r["spec"]["concurrency"]) for r in load]
    ax.bar(labels, [r["efficiency"] for r in load], color="#4c72b0")
    for i, r in enumerate(load):
        ax.text(i, r["efficiency"] + 0.01, f"{r['efficiency']:.3f}", ha="center", fontsize=9)
        t = {256: TARGETS["efficiency_256"], 1000: TARGETS["efficiency_1000"]}.get(r["spec"]["concurrency"])
        if t:
            ax.hlines(t, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
    ax.set_ylim(0, 1.1)
    ax.set_title("Efficiency (achieved / ideal steps/s)")
    ax.set_xlabel("concurrency")

    ax = axes[1]
    bottom = [0.0] * len(load)
    for role, color in (("workers", "#4c72b0"), ("consumer", "#55a868"), ("redis", "#c44e52"),
                        ("env", "#cccccc"), ("model", "#eeeeee")):
        vals = [role_ms(r, role) for r in load]
        ax.bar(labels, vals, bottom=bottom, label=role + (" (stand-in)" if role in ("env", "model") else ""),
               color=color, edgecolor="#999999" if role in ("env", "model") else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(TARGETS["cpu_ms_per_step"], color="red", linestyle="dashed", label="target (orchestration)")
    ax.set_title("CPU ms per step")
    ax.set_xlabel("concurrency")
    ax.legend(fontsize=8)

    ax = axes[2]
    if pools:
        pl = [r["spec"]["pool"] for r in pools]
        x = range(len(pools))
        ax.bar([i - 0.2 for i in x], [r["efficiency"] for r in pools], width=0.4, label="efficiency", color="#4c72b0")
        ax2 = ax.twinx()
        ax2.bar([i + 0.2 for i in x], [orch_ms(r) for r in pools], width=0.4, label="orch. CPU ms/step",
                color="#dd8452")
        ax.set_xticks(list(x), pl)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("efficiency")
        ax2.set_ylabel("CPU ms/step")
        ax.set_title(f"Pools at concurrency {pools[0]['spec']['concurrency']}")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    else:
        lat = [(r.get("latency_ms") or {}) for r in load]
        ax.plot(labels, [x.get("p50", 0) for x in lat], marker="o", label="p50")
        ax.plot(labels, [x.get("p99", 0) for x in lat], marker="o", label="p99")
        ax.axhline(TARGETS["latency_p99_ms_256"], color="red", linestyle="dashed", label="p99 target")
        ax.set_title("Record latency (ms)")
        ax.legend(fontsize=8)
    fig.suptitle(f"interactor benchmarks ({res['finished']}, {res['machine']['cores']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def now_text() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
