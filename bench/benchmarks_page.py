"""docs/benchmarks.md, from one run's results (a JSON-able dict); its plot is bench/benchmarks_plot.py.

Every figure of a table comes from the same run. ``bench/notes.md`` (hand-written: the
before/after of each fix and why a target misses) is appended verbatim.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from bench.original_driver import section as original_section

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
    # issue 49: resuming costs nothing a user would notice (20 steps, C=256, on / off), and the
    # Redis ceiling: Redis' own CPU per step with resume on (one primary, 20,000 steps/s)
    "resume_cpu_ratio": 1.10,
    "resume_redis_per_step": 7.0,
    "redis_us_per_step": 50.0,
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


def redis_us(r: dict, per: str = "steps") -> float:
    """Redis' own CPU (the server process's user + system time in the window) per step or per
    episode, in microseconds: what sets how many steps a second one primary carries."""
    n = r.get(per) or 0
    return 1e6 * (r.get("cpu_s") or {}).get("redis", 0.0) / n if n else float("nan")


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
    rs = res.get("resume")
    if rs:
        row(f"Orchestration CPU per step, resume on / off, concurrency {rs['level']}", "<= 1.10", rs["cpu_ratio"],
            TARGETS["resume_cpu_ratio"], False, 2)
        row(f"Redis commands per step with resume on, concurrency {rs['level']}", "<= 7", rs["redis_per_step_on"],
            TARGETS["resume_redis_per_step"], False, 2)
        row(f"Redis CPU per step with resume on, concurrency {rs['level']}", "<= 50 us", redis_us(rs["on"]),
            TARGETS["redis_us_per_step"], False, 0, " us")
    for r in res.get("single_turn", []):
        rows.append((f"Redis CPU per single-turn episode, concurrency {r['spec']['concurrency']}", "(none)",
                     _f(redis_us(r, "episodes"), 0) + " us", "", ""))
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
    """The rollout feed's figures (bench/feed_run.py ``run_feed``)."""
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


def cost_rows(level: int, runs: list[tuple[str, dict]], cost: dict, names: tuple[str, str]) -> str:
    """The table of a feature's cost per step: one row per load run (label, run), the CPU and
    Redis figures of ``cost`` (bench/feature_costs.py ``added_cost``, keys named by ``names``)."""
    return _table(
        ["C", runs[0][0].split("=")[0], "steps/s", "efficiency", "orchestration CPU per step",
         "Redis commands per step", "problems"],
        [(level, label.split("=")[-1], _f(r["rate"], 1), _f(r["efficiency"], 3),
          _f(cost[f"cpu_ms_per_step_{n}"], 3) + " ms", _f(cost[f"redis_per_step_{n}"], 2),
          "; ".join(r.get("errors") or []))
         for (label, r), n in zip(runs, names)]) + "\n"


def cost_line(what: str, cost: dict, names: tuple[str, str]) -> str:
    """``**<what> cost per step:** ...`` (``what`` possessive: "Caps'"): the CPU ratio and difference, the Redis commands added,
    and whether the per-step CPU target holds with the feature."""
    without, with_ = names
    target = TARGETS["cpu_ms_per_step"]
    within = "yes" if cost[f"cpu_ms_per_step_{with_}"] <= target else "**no**"
    return (f"**{what} cost per step:** orchestration CPU x{_f(cost['cpu_ratio'], 2)} "
            f"({_f(cost[f'cpu_ms_per_step_{with_}'] - cost[f'cpu_ms_per_step_{without}'], 3)} ms), "
            f"{_f(cost['redis_extra_per_step'], 2)} Redis commands more (so at most that many round trips); "
            f"with it, within the per-step CPU target (<= {target:g} ms): {within}.\n")


def caps_section(cp: dict) -> list[str]:
    """The caps' cost per step (bench/run.py ``run_caps``, bench/feature_costs.py ``caps_cost``): the
    same load with and without fleet-wide caps that never bind."""
    u, c = cp["uncapped"], cp["capped"]
    s = c["spec"]
    n = math.ceil(cp["factor"] * cp["level"])
    names = ("uncapped", "capped")
    return ["## Cost of the fleet-wide caps\n",
            f"The load at concurrency {cp['level']} ({s['steps']}-step `countdown` episodes, the load runs' "
            f"latencies) run again with a model cap and an env-server cap (`max_concurrency` {n:,}, "
            f"{cp['factor']:g}x C: they never bind), against the uncapped run of the same level in this run. "
            "What is left is what holding the caps costs: each worker process takes slots from Redis in blocks, "
            "lends them to its calls, renews its lease every second and gives back what it did not need "
            "(workers/fleetcaps.py). Every round trip is at least one command, so the commands the caps add "
            "per step bound the round trips they add.\n",
            cost_rows(cp["level"], [("caps=none", u), (f"caps={n:,}", c)], cp, names),
            cost_line("Caps'", cp, names)]


def resume_section(rs: dict) -> list[str]:
    """The progress snapshots' cost per step (bench/run.py ``run_resume``): the same load with
    resume off and on."""
    names = ("off", "on")
    return ["## Cost of resumable episodes\n",
            f"The load at concurrency {rs['level']} run with `resume: false` against the same load with resume on "
            "(the default): what the workers' progress snapshots cost (broker/resume.py: from an episode's second "
            "step, one after each prompt, through the step publisher with the records, and one written and waited "
            "for before each `step` call, `Ledger.mark`).\n",
            cost_rows(rs["level"], [("resume=off", rs["off"]), ("resume=on", rs["on"])], rs, names),
            cost_line("Resume's", rs, names),
            f"**Redis' own CPU per step** (the server process, user + system, in the window): "
            f"{_f(redis_us(rs['off']), 0)} us with resume off, {_f(redis_us(rs['on']), 0)} us on; one primary's "
            f"core then carries about {_f(1e6 / redis_us(rs['on']), 0)} steps/s of such episodes "
            "(docs/deployment.md, *One Redis and past it*).\n"]


def waits_section(wt: dict) -> list[str]:
    """What waiting for a replica costs (bench/run.py ``run_waits``): the same load with a replica,
    the commit points' waits off and on, and the commit points' own latency each way."""
    names = ("off", "on")
    c = wt["commits"]
    off, on = c["ms_per_commit"].get("off", {}), c["ms_per_commit"].get("on", {})
    steps = wt["on"]["spec"]["steps"]
    return ["## Cost of waiting for a replica\n",
            f"The load at concurrency {wt['level']} with a replica beside the primary (on loopback; its CPU counted "
            "as Redis's), run with the commit points' waits off and on (`INTERACTOR_REDIS_WAIT`, broker/replicas.py: a "
            "`WAIT 1` after each START and FINISH, in the same round trip, so an episode pays two replica "
            f"acknowledgements; with {steps}-step episodes that is 2/{steps} per step).\n",
            cost_rows(wt["level"], [("waits=off", wt["off"]), ("waits=on", wt["on"])], wt, names),
            cost_line("Replica waits'", wt, names),
            f"Each commit point alone ({c['commits']:,} START and FINISH pairs, one at a time, against the same "
            f"primary and replica): {_f(off.get('p50'), 3)} ms without a wait, {_f(on.get('p50'), 3)} ms with "
            f"(median; p99 {_f(off.get('p99'), 3)} and {_f(on.get('p99'), 3)} ms). **A wait adds "
            f"{_f(c['added_ms_p50'], 3)} ms to a commit point**, so {_f(2 * c['added_ms_p50'], 3)} ms to an episode "
            f"and {_f(2 * c['added_ms_p50'] / steps, 3)} ms to each step of a {steps}-step one; on a network, add the "
            "round trip to the replica." + (f" Problems: {'; '.join(c['errors'])}." if c.get("errors") else "") + "\n"]


def render(res: dict, png_name: str | None) -> str:
    """The page: how it was made and measured, the machine, the targets, then one section per
    part of the run that has results, then the hand-written notes."""
    out = intro_section(res) + machine_section(res["machine"]) + targets_section(res)
    out += load_section(res) + single_turn_section(res)
    if png_name:
        out.append(f"![benchmarks]({png_name})\n")
    out += processes_section(res) + pools_section(res)
    if res.get("feed"):
        out += feed_section(res["feed"])
    if res.get("caps"):
        out += caps_section(res["caps"])
    if res.get("resume"):
        out += resume_section(res["resume"])
    if res.get("waits"):
        out += waits_section(res["waits"])
    out += ingest_section(res) + token_storage_section(res) + gateway_section(res) + enqueue_section(res)
    out += original_section(res)
    if NOTES.exists():
        out.append(NOTES.read_text().rstrip() + "\n")
    return "\n".join(out)


def intro_section(res: dict) -> list[str]:
    """The title, when and from which code the run was made, how to run it, and how each figure
    is measured."""
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
               "interactor bench --original /path/to/Safactory   # also against the original driver, from a checkout\n"
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
    return out


def machine_section(m: dict) -> list[str]:
    """The machine the run was made on, and how busy it was when the run started."""
    out = []
    out.append("## The machine\n")
    out.append(f"{m['cores']} cores ({m['cpu']}), {m['ram_gb']} GB RAM, {m['os']}, Python {m['python']}, "
               f"Redis {m.get('redis', '?')}, Celery {m.get('celery', '?')}. Load average when the run started: "
               f"{', '.join(str(x) for x in m['loadavg'])} (the machine is shared: the *machine busy* column is "
               "everything running on it, not only this benchmark).\n")
    return out


def targets_section(res: dict) -> list[str]:
    """Each target against the run's figure, then the misses named."""
    out = []
    out.append("## Targets\n")
    out.append("Ratio: measured / target for a floor, target / measured for a ceiling; at least 1.00x means met.\n")
    out.append(_table(["Metric", "Target", "Measured", "Ratio", "Met?"], target_rows(res)) + "\n")

    misses = [r for r in target_rows(res) if r[4] == "**no**"]
    if misses:
        out.append("Missed in this run: " + "; ".join(f"{r[0]} ({r[2]} against {r[1]}, {r[3]})" for r in misses)
                   + ". Why, and what would close each gap: see *Notes* below.\n")
    return out


def load_section(res: dict) -> list[str]:
    """The load levels' table."""
    if not res.get("load"):
        return []
    cfg = res["config"]
    return ["## Load runs\n",
            f"Model latency {cfg['model_latency_ms']:g} ms, env latency {cfg['env_latency_ms']:g} ms per call, "
            f"pool `{res['load'][0]['spec']['pool']}`. CPU columns are ms per step.\n",
            _table(LOAD_HEADER, load_rows(res["load"])) + "\n"]


def single_turn_section(res: dict) -> list[str]:
    """The 1-step levels' table, and what an episode costs beyond its steps against the load
    level of the same concurrency."""
    single = res.get("single_turn") or []
    if not single:
        return []
    out = []
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
    return out


def processes_section(res: dict) -> list[str]:
    """The same load over different numbers of worker processes."""
    procs = res.get("processes") or []
    if not procs:
        return []
    return ["## Worker processes\n",
            f"The same load (concurrency {procs[0]['spec']['concurrency']}, pool "
            f"`{procs[0]['spec']['pool']}`) split over a different number of worker processes:\n",
            _table(LOAD_HEADER, load_rows(procs)) + "\n"]


def pools_section(res: dict) -> list[str]:
    """The same load with each pool, and the default chosen from them."""
    pools = res.get("pools") or []
    if not pools:
        return []
    out = []
    out.append("## Worker pools\n")
    out.append(f"The same load (concurrency {pools[0]['spec']['concurrency']}, same latencies, "
               f"{pools[0]['spec']['workers']} worker processes) with each pool:\n")
    out.append(_table(LOAD_HEADER, load_rows(pools)) + "\n")
    pick, why = choose_pool(pools)
    out.append(f"**Chosen default: `{pick}`** (rule: the best efficiency, within 0.02 counting as a tie, then the "
               "least orchestration CPU per step, then memory).\n")
    out += [f"* {w}" for w in why]
    out.append("")
    return out


def ingest_section(res: dict) -> list[str]:
    """The consumer's ingest runs: records/s and CPU per record of each role."""
    runs = res.get("ingest_runs") or []
    if not runs:
        return []
    rows = []
    for r in runs:
        n = max(1, r["records"])
        rows.append((r["backend"], r["consumers"], f"{r['records']:,}", f"{r['seconds']:.2f}",
                     f"**{r['rate']:,.0f}**", f"{1e6 * r['cpu_consumers_s'] / n:.0f}",
                     f"{1e6 * r['cpu_redis_s'] / n:.0f}",
                     f"{1e6 * r['cpu_database_s'] / n:.0f}" if r["backend"] == "postgres" else "(in the consumer)",
                     "; ".join(r.get("errors") or [])))
    return ["## Consumer ingest\n",
            _table(["backend", "consumer processes", "records", "seconds", "records/s",
                    "consumer CPU us/record", "Redis CPU us/record", "database server CPU us/record",
                    "problems"], rows) + "\n"]


def token_storage_section(res: dict) -> list[str]:
    """What token-exact trajectories cost on disk."""
    tok = res.get("token_storage")
    if not tok:
        return []
    ids = max(1, tok["stored_ids"])
    return ["## Token storage\n",
            f"{tok['episodes']} full-history episodes of {tok['turns']} turns (each turn's prompt is the last "
            "one plus the answer and the env's reply) written through the real SQLite store with their token "
            "fields: prompt ids and completion ids packed little-endian int32, logprobs float32, as blobs.\n",
            _table(["figure", "value"], [
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
            ]) + "\n"]


def gateway_section(res: dict) -> list[str]:
    """What the model gateway costs per call an agent makes (bench/gateway_cost.py)."""
    gw = res.get("gateway")
    if not gw:
        return []
    extra = gw["gateway_cpu_ms_per_call"] + gw["caller_cpu_ms_per_call_proxied"] - gw["caller_cpu_ms_per_call_direct"]
    return ["## Model gateway\n",
            f"{gw['calls']:,} sequential calls to the model stand-in through the gateway (each recorded and packed "
            "as a step record) and as many direct: **the gateway's CPU per proxied call "
            f"{gw['gateway_cpu_ms_per_call']:.3f} ms**, the caller's {gw['caller_cpu_ms_per_call_proxied']:.3f} ms "
            f"against {gw['caller_cpu_ms_per_call_direct']:.3f} ms direct: {extra:.3f} ms more CPU per call in all "
            f"(wall {gw['wall_ms_per_call_proxied']:.2f} ms against {gw['wall_ms_per_call_direct']:.2f} ms).\n"]


def enqueue_section(res: dict) -> list[str]:
    """The producer's enqueue rate."""
    enq = res.get("enqueue")
    if not enq:
        return []
    return ["## Enqueue\n",
            f"{enq['episodes']:,} episodes: plan {enq['plan_s']:.2f} s, ledger + queue {enq['enqueue_s']:.2f} s: "
            f"**{enq['rate']:,.0f} episodes/s** end to end ({enq['enqueue_rate']:,.0f}/s for ledger + queue alone)."
            + (f" Problems: {'; '.join(enq['errors'])}." if enq.get("errors") else "") + "\n"]


def now_text() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
