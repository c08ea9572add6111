"""What the terminal shows: progress, the summary table, status, what was left."""

from __future__ import annotations

from pathlib import Path
from broker.states import LEDGER_FINAL, LEDGER_WAITING, LedgerState, Phase, StoredStatus


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def progress_line(counts: dict, job: dict, total: int, steps_per_s: float, elapsed_s: float,
                  stalled: int = 0) -> str:
    """``counts``: the ledger's, ``running`` the attempts alive (interactor/localrun.py
    RunningAttempts); ``stalled``: attempts whose worker is gone or stopped renewing, shown apart
    until their leases expire and they are re-queued."""
    done, failed = counts.get(LedgerState.DONE, 0), counts.get(LedgerState.FAILED, 0)
    cancelled = counts.get(LedgerState.CANCELLED, 0)
    ended = sum(counts.get(s, 0) for s in LEDGER_FINAL)
    running = counts.get(LedgerState.RUNNING, 0)
    waiting = sum(counts.get(s, 0) for s in LEDGER_WAITING)
    width = 24
    filled = int(width * ended / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    return (f"[{bar}] {ended}/{total} done={done} failed={failed} "
            + (f"cancelled={cancelled} " if cancelled else "")
            + f"running={running} " + (f"stalled={stalled} " if stalled else "") + f"waiting={waiting} "
            f"| {steps_per_s:6.1f} steps/s | mean reward {_f(job.get('mean_reward'))} | {elapsed_s:5.0f}s")


def print_results(job_id: str, res: dict, db_path: str) -> None:
    job = res["job"]
    rows = [("env_name", "episodes", "completed", "failed", "mean", "min", "max")]
    for env, e in sorted(res["by_env"].items()):
        rows.append((env, str(e["episodes"]), str(e["completed"]), str(e["failed"]), _f(e["mean"]), _f(e["min"]),
                     _f(e["max"])))
    rows.append(("all", str(job["episodes"]), str(job["completed"]), str(job["failed"]), _f(job["mean_reward"]),
                 "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"job {job_id}: {job['steps']} steps, {job['attempts']} attempts")
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0 or i == len(rows) - 2:
            print("  ".join("-" * w for w in widths))
    ended = job.get("ended_by") or {}
    if ended:
        print("ended by: " + ", ".join(f"{why} {n}" for why, n in ended.items()))
    print(tokens_line(job))
    if res.get("usage"):
        print(usage_line(res["usage"]))
    if res.get("token_ids"):
        print(token_ids_line(res["token_ids"]))
    print(phases_line(res.get("phases")))
    if res.get("resumes"):
        print(resumes_line(res["resumes"]))
    for line in retry_lines(res.get("retries")):
        print(line)
    for line in failure_lines(res.get("failures") or []):
        print(line)
    if job.get(StoredStatus.CANCELLED):
        print(f"cancelled: {job[StoredStatus.CANCELLED]} episodes (the job was cancelled before they ended; "
              "what completed is kept)")
    g = res["groups"]
    print(f"groups: {g['total']} total, {g['complete']} complete, {g['incomplete']} incomplete "
          f"({g['failed']} with a dead-lettered episode"
          + (f", {g['cancelled']} cancelled" if g.get("cancelled") else "")
          + f"), mean reward std {_f(g['mean_std'])}")
    if res.get("scores"):
        for line in score_lines(res["scores"]):
            print(line)
    print(f"results database: {Path(db_path).resolve()}")


def _pm(x, se) -> str:
    return _f(x) + ("" if se is None else f" ± {se:.3f}")


def score_lines(scores: dict) -> list[str]:
    """How sure the scores are (consumer/storage/score_stats.py): per env_name and for the job,
    the mean reward ± its standard error, the 95% interval, pass@1, pass@k and mean@k over each
    task's k samples."""
    head = ("env_name", "tasks", "k", "mean ± stderr", "95% interval", "pass@1", "pass@k", "mean@k")
    rows = [head]
    for env, e in [*scores["by_env"].items(), ("all", scores["job"])]:
        ci = e["ci95"]
        rows.append((env, str(e["tasks"]), str(e["k"] if e["k"] is not None else "-"), _pm(e["mean"], e["stderr"]),
                     "-" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]", _pm(e["pass@1"], e["pass@1_stderr"]),
                     _pm(e["pass@k"], e["pass@k_stderr"]), _pm(e["mean@k"], e["mean@k_stderr"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = [f"scores (completed episodes; standard errors over tasks; a sample solves its task at reward >= "
           f"{scores['threshold']:g}; docs/results.md):"]
    for i, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0 or i == len(rows) - 2:
            out.append("  ".join("-" * w for w in widths))
    return out


TASK_CHARS = 60  # of a task's question in `results --rows`


def print_task_rows(rows: list[dict]) -> None:
    """``interactor results JOB --rows``: one line per task, which the model always, sometimes or
    never solves, and a count of each."""
    table = [("group_id", "env_name", "samples", "done", "solved", "mean", "solved by", "task")]
    for r in rows:
        task = r["task"] if len(r["task"]) <= TASK_CHARS else r["task"][:TASK_CHARS - 3] + "..."
        table.append((r["group_id"], r["env_name"], str(r["samples"]), str(r["completed"]), str(r["solved"]),
                      _f(r["mean"]), r["solved_by"], task))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]) - 1)]
    for i, t in enumerate(table):
        print("  ".join(c.ljust(w) if j in (0, 1, 6) else c.rjust(w) for j, (c, w) in enumerate(zip(t, widths)))
              + "  " + t[-1])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  ----")
    tally = {k: sum(1 for r in rows if r["solved_by"] == k) for k in ("always", "sometimes", "never")}
    print(f"{len(rows)} tasks: solved always {tally['always']}, sometimes {tally['sometimes']}, never {tally['never']}")


def retry_lines(r: dict | None) -> list[str]:
    """Retry honesty (consumer/storage/retry_split.py): per env_name, the episodes that completed on
    their first try and their mean reward, apart from those that needed retries; one line when
    none needed one and none failed."""
    if not r or not (r["job"]["first_try"]["completed"] or r["job"]["failed"]):
        return []
    if not r["job"]["retried"]["completed"] and not r["job"]["failed"]:
        return [f"retries: none (all {r['job']['first_try']['completed']} completed episodes completed on their "
                "first try)"]
    head = ("env_name", "first try", "mean", "retried", "mean", "failed")
    rows = [head]
    for env, e in [*r["by_env"].items(), ("all", r["job"])]:
        f, a = e["first_try"], e["retried"]
        rows.append((env, str(f["completed"]), _pm(f["mean"], f["stderr"]), str(a["completed"]),
                     _pm(a["mean"], a["stderr"]), str(e["failed"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out = ["retries (completed on the first try apart from after a counted failed attempt; a reward earned by "
           "retrying is rosier than a first-try run's; docs/results.md):"]
    for i, row in enumerate(rows):
        out.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0 or i == len(rows) - 2:
            out.append("  ".join("-" * w for w in widths))
    return out


def resumes_line(r: dict) -> str:
    """What worker crashes cost: attempts that continued their predecessor's env instance (and
    the steps they did not run again), and those that had to start afresh, by why."""
    fallbacks = ", ".join(f"{why} {n}" for why, n in sorted(r["fallbacks"].items()))
    return (f"resumed: {r['resumed']} attempts continued their predecessor's env instance ({r['steps_saved']} steps "
            f"not run again)" + (f"; started afresh: {fallbacks}" if fallbacks else ""))


def failure_lines(failures: list[dict]) -> list[str]:
    """Why episodes failed: each reason, how many, and one of them with its error."""
    if not failures:
        return []
    out = ["failed, by reason:"]
    for f in failures:
        error = " ".join(str(f.get("error") or "").split())
        out.append(f"  {f['reason']}: {f['count']}, e.g. {f['episode_id']}: "
                   f"{error[:300] + ('...' if len(error) > 300 else '') or '(no message)'}")
    return out


def tokens_line(job: dict) -> str:
    """Token usage as the model server reported it (``usage``); servers that send none count 0."""
    prompt, completion = job.get("prompt_tokens") or 0, job.get("completion_tokens") or 0
    if not prompt and not completion:
        return "tokens: none reported by the model server"
    per_episode, per_s = job.get("tokens_per_episode"), job.get("tokens_per_s")
    return (f"tokens: {prompt + completion} ({prompt} prompt, {completion} completion), "
            f"{_f(per_episode, 1)} per episode, {_f(per_s, 1)} tokens/s")


def usage_line(u: dict) -> str:
    """What the job's model calls used, over every stored step (set-aside attempts' too:
    consumer/storage/job_usage.py), its cost at its model's price, and its budgets."""
    parts = [f"{u['tokens']:,} tokens ({u['prompt_tokens']:,} prompt, {u['completion_tokens']:,} completion)"]
    if u.get("cost_usd") is not None:
        parts.append(f"cost ${u['cost_usd']:,.4f} (at ${u['price'][0]:g}/${u['price'][1]:g} per 1M tokens)")
    if u.get("unknown_steps"):
        parts.append(f"{u['unknown_steps']:,} steps with no usage reported (not counted)")
    if u.get("cached_steps"):
        parts.append(f"{u['cached_steps']:,} steps from the cache (free)")
    if u.get("max_tokens_total"):
        parts.append(f"token budget {u['max_tokens_total']:,} ({u['tokens_used']:.0%} used)")
    if u.get("budget_usd"):
        used = "" if u.get("cost_used") is None else f" ({u['cost_used']:.0%} used)"
        parts.append(f"cost budget ${u['budget_usd']:,.2f}{used}")
    line = "usage of all calls: " + ", ".join(parts)
    return line + (f"; {u['budget_reached']}: the job was stopped" if u.get("budget_reached") else "")


def phases_line(ph: dict | None) -> str:
    """Where the attempts' time went (records v5): mean seconds per attempt of each phase, over
    the attempts that timed it (a re-run's queue wait is not timed)."""
    if not ph:
        return "phases: not timed (records before v5, or a store written by older code)"
    parts = [f"{p} {ph['mean_s'][p]:.3f}s" for p in Phase if ph["mean_s"].get(p) is not None]
    return f"phases (mean per attempt, {ph['attempts']} attempts): " + ", ".join(parts)


def token_ids_line(t: dict) -> str:
    """The job's stored token ids: how many steps have them, and where turns drifted (their
    episode's token stream is cut there: consumer/streams.py)."""
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(t["by_status"].items()))
    ids = t["prompt_ids"] + t["completion_ids"]
    per = f", {t['bytes'] / ids:.2f} bytes per id stored" if ids else ""
    drift = (f"token drift in {t['drift_steps']} steps of {t['drift_episodes']} episodes (their token streams are "
             "cut there; each turn keeps its own ids)" if t["drift_steps"] else "no token drift")
    return f"token ids: {t['steps']} steps ({statuses}){per}; {drift}"


def print_groups(groups: list[dict]) -> None:
    rows = [("group_id", "env_name", "size", "done", "failed", "mean", "std", "complete")]
    for g in groups:
        rows.append((g["group_id"], g["env_name"] or "", str(g["size"]), str(g["completed"]), str(g["failed"]),
                     _f(g["reward_mean"]), _f(g["reward_std"]),
                     "yes" if g["complete"] else f"no: {g['incomplete_reason'] or 'not finished'}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  --------")


def print_left(counts: dict, job_id: str, run_dir: Path) -> None:
    left = {k: v for k, v in counts.items() if k not in LEDGER_FINAL and v}
    print("left unfinished: " + (", ".join(f"{v} {k}" for k, v in left.items()) or "nothing"))
    if left:
        print(f"the ledger is kept in {run_dir / 'redis'}; finish with: interactor run --resume {job_id} "
              f"--run-dir {run_dir}")
