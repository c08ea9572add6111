"""``interactor compare JOB_A JOB_B``: two jobs of the results store side by side (consumer/storage/compare.py).
Registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``."""

from __future__ import annotations

import json
import sys

from broker.settings import STORE
from interactor.common import settings_from_args

ROWS_SHOWN = 20  # of each side's rows solved by one job only; --all-rows shows every one
TASK_CHARS = 70


def register(sub, add) -> None:
    sp = add("compare", cmd_compare, "compare two jobs: per-env reward with standard errors, the difference and "
                                     "whether it is more than noise, the rows one solves and the other does not",
             reads=(STORE,))
    sp.add_argument("job_a", help="the first job's id (A)")
    sp.add_argument("job_b", help="the second job's id (B); differences are B - A")
    sp.add_argument("--json", action="store_true", help="print the comparison as JSON (every row)")
    sp.add_argument("--pass-threshold", type=float, default=None, metavar="X",
                    help="a task row is solved when the mean reward of its completed samples is at least X "
                         "(default: above 0)")
    sp.add_argument("--all-rows", action="store_true",
                    help=f"list every row solved by one job only (default: the first {ROWS_SHOWN} of each, and a count)")


def cmd_compare(args) -> int:
    from consumer.storage import open_store
    from interactor.jobs import require_store

    settings = settings_from_args(args)
    require_store(settings)
    store = open_store(settings.results_store, readonly=True)
    try:
        known = set(store.job_ids())
        missing = [j for j in (args.job_a, args.job_b) if j not in known]
        if missing:
            print(f"no job {', '.join(map(repr, missing))} in {settings.results_store_shown}", file=sys.stderr)
            return 2
        res = store.compare_jobs(args.job_a, args.job_b, args.pass_threshold)
    finally:
        store.close()
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        for line in compare_lines(res, None if args.all_rows else ROWS_SHOWN):
            print(line)
    return 0


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pm(side: dict) -> str:
    return _f(side["mean"]) + ("" if side["stderr"] is None else f" ± {side['stderr']:.3f}")


def _noise(d: dict) -> str:
    if d["beyond_noise"] is None:
        return "unknown (a side has < 2 tasks)" if d["diff"] is not None else "-"
    return "more than noise" if d["beyond_noise"] else "within noise"


def compare_lines(res: dict, cap: int | None) -> list[str]:
    """The comparison as the terminal shows it; ``cap``: rows listed per side (None: all)."""
    head = ("env_name", "A tasks", "A mean ± se", "B tasks", "B mean ± se", "B - A", "± se", "verdict")
    rows = [head]
    for env, d in [*res["by_env"].items(), ("all", res["job"])]:
        diff = "-" if d["diff"] is None else f"{d['diff']:+.3f}"
        rows.append((env, str(d["a"]["tasks"]), _pm(d["a"]), str(d["b"]["tasks"]), _pm(d["b"]), diff,
                     _f(d["se_diff"]), _noise(d)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    out = [f"A = {res['a']}, B = {res['b']}: mean reward of completed episodes, standard errors over tasks; "
           f"{res['rule']}"]
    for i, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
                   + "  " + r[-1])
        if i == 0 or i == len(rows) - 2:
            out.append("  ".join("-" * w for w in widths) + "  -------")
    out.append(f"task rows matched by env_name and what they asked: {res['matched']} in both"
               + (f", {res['unmatched_a']} in A only" if res["unmatched_a"] else "")
               + (f", {res['unmatched_b']} in B only" if res["unmatched_b"] else "")
               + f"; a row is solved when the {res['solved_rule']}")
    for side, other, rows_ in (("A", "B", res["only_a"]), ("B", "A", res["only_b"])):
        out.append(f"solved by {side}, not by {other}: {len(rows_)} rows")
        shown = rows_ if cap is None else rows_[:cap]
        for r in shown:
            task = r["task"] if len(r["task"]) <= TASK_CHARS else r["task"][:TASK_CHARS - 3] + "..."
            out.append(f"  {r['env_name']}  A {_f(r['mean_a'])}  B {_f(r['mean_b'])}  {task}")
        if len(shown) < len(rows_):
            out.append(f"  ... and {len(rows_) - len(shown)} more (--all-rows, or --json)")
    return out
