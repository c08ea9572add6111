"""``interactor jobs``: the jobs a results store holds, one line each, newest first; and what
``jobs``, ``results`` and ``export`` say when the store they would read is missing.

The list is the results browser's own (consumer/storage: ``job_ids`` and ``job_progress``, one
pass over a job's rows each), read from the store only: no Redis, so it works after a local run
ended, when its embedded Redis is gone.

A missing store: ``make demo`` writes ``runs/demo/results.sqlite`` (``--run-dir runs/demo``), and
``interactor results JOB`` right after it read the default ``runs/results.sqlite``, which no run
wrote, and said only that it was missing. The error now names the run folders under ``./runs``
(and under ``--run-dir``) that do hold a results database, and the flag that picks one.

Registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from broker.settings import STORE, Settings
from broker.states import StoredStatus

RUNS = "runs"  # where `interactor run` and `make demo` keep their run folders (the default --run-dir)
SHOWN_FOLDERS = 5  # run folders a missing-store error names at most


def register(sub, add) -> None:
    sp = add("jobs", cmd_jobs, "list the jobs a results store holds, newest first: id, created, model, episodes, "
                               "mean reward", reads=(STORE,))
    sp.add_argument("--json", action="store_true", help="print them as JSON")


def cmd_jobs(args) -> int:
    from consumer.storage import open_store
    from interactor.common import settings_from_args

    settings = settings_from_args(args)
    require_store(settings)
    store = open_store(settings.results_store, readonly=True)
    try:
        rows = [job_row(store.job_progress(job_id)) for job_id in reversed(store.job_ids())]
    finally:
        store.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no jobs in {settings.results_store_shown}")
        return 0
    table = [("job", "created (UTC)", "model", "episodes", "completed", "failed", "other", "mean reward")]
    for r in rows:
        table.append((r["job_id"], r["created_utc"] or "-", r["model"] or "-", str(r["episodes"]),
                      str(r["completed"]), str(r["failed"]), str(r["other"]),
                      "-" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return 0


def job_row(p: dict) -> dict:
    """One job of the list from its progress (``ResultStore.job_progress``): episodes in all
    (as submitted, or as stored when more), completed, failed and every other (not started,
    running, retrying, cancelled: ``statuses`` has the stored ones each)."""
    statuses = p["statuses"]
    completed = statuses.get(StoredStatus.COMPLETED, 0)
    failed = statuses.get(StoredStatus.FAILED, 0)
    total = max(int(p["episodes_expected"] or 0), sum(statuses.values()))
    created = p["created_at"] if p["created_at"] is not None else p["first_started"]
    return {"job_id": p["job_id"], "created_at": created,
            "created_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(created)) if created is not None else None,
            "model": p["model"], "episodes": total, "completed": completed, "failed": failed,
            "other": total - completed - failed, "statuses": statuses, "mean_reward": p["mean_reward"]}


# --- a missing store ---------------------------------------------------------------------------
def require_store(settings: Settings) -> None:
    """Raise ``StoreError`` saying where results are when the SQLite store to read is missing
    (a PostgreSQL store says for itself why it cannot be opened)."""
    from consumer.storage import StoreError, sqlite_path

    path = sqlite_path(settings.results_store)
    if path is None or "://" in path or os.path.exists(path):
        return
    raise StoreError(missing_store_message(path, settings.run_dir))


def missing_store_message(path: str, run_dir: str) -> str:
    folders = run_folders_with_results(run_dir, RUNS)
    if folders:
        names = ", ".join(str(f) for f in folders[:SHOWN_FOLDERS]) + (", ..." if len(folders) > SHOWN_FOLDERS else "")
        return (f"no results database at {path}; run folders that have one: {names}. Give the run's folder with "
                f"--run-dir, e.g. --run-dir {folders[0]}")
    return (f"no results database at {path}, and no run folder under {RUNS}/ has one: a run writes it into its "
            "--run-dir (interactor run, make demo); name that folder with --run-dir, or the store with --db or --store")


def run_folders_with_results(*roots: str) -> list[Path]:
    """The folders directly under ``roots`` (and the roots themselves) that hold a
    results.sqlite, the most recently written first."""
    found: dict[Path, float] = {}
    for root in roots:
        base = Path(root)
        for db in [base / "results.sqlite", *sorted(base.glob("*/results.sqlite"))]:
            try:
                found.setdefault(db.parent, db.stat().st_mtime)
            except OSError:
                continue
    return sorted(found, key=lambda f: -found[f])
