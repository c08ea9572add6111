"""``interactor jobs``: the jobs a results store holds, one line each, newest first; and what
``jobs``, ``results`` and ``export`` say when the store they would read is missing.

The list is the results browser's own (consumer/storage: ``job_ids`` and ``job_progress``, one
pass over a job's rows each), read from the store only: no Redis, so it works after a local run
ended, when its embedded Redis is gone.

A missing store: ``make demo`` writes ``runs/demo/results.sqlite`` (``--run-dir runs/demo``), and
``interactor results JOB`` right after it read the default ``runs/results.sqlite``, which no run
wrote, and said only that it was missing. The error now names the run folders under ``./runs``
(and under ``--run-dir``) that do hold a results database, and the flag that picks one.

Across run folders: ``--run-dir`` may be a folder of run folders (``runs/``, where every
``interactor run --run-dir runs/NAME`` keeps its own store); the list then holds the jobs of
every results.sqlite found up to two levels below it, each with its run folder. ``--db`` or
``--store`` (a SQLite path or a postgresql:// URL) lists that one store's jobs.

Each job has a state: ``finished`` (every episode completed or failed), ``cancelled``,
``running`` (its run folder's Redis runs), or ``stopped``: its run ended before the job did
(interrupted, or paused), and the job waits in the folder's Redis for ``interactor run --resume``
or ``interactor cancel`` with that ``--run-dir`` (interactor/stopped_run.py); a store given by
URL says ``unfinished``, not knowing where its jobs run.

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
                               "mean reward, state; --run-dir may be a folder of run folders (every store below it)",
             reads=(STORE,))
    sp.add_argument("--json", action="store_true", help="print them as JSON")


def cmd_jobs(args) -> int:
    from interactor.common import settings_from_args

    settings = settings_from_args(args)
    if settings.store_url or settings.db_path:
        require_store(settings)
        rows = store_jobs(settings.results_store, None)
        where = settings.results_store_shown
    else:
        folders = run_folders_below(settings.run_dir)
        if not folders:
            require_store(settings)  # says where results are
        rows = [row for folder in folders for row in store_jobs(str(folder / "results.sqlite"), folder)]
        rows.sort(key=lambda r: -(r["created_at"] or 0))
        where = f"{settings.run_dir}/ and the run folders below it"
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no jobs in {where}")
        return 0
    many = len({r["run_dir"] for r in rows}) > 1
    head = ("job", "created (UTC)", "model", "episodes", "completed", "failed", "cancelled", "other", "mean reward",
            "state")
    table = [head + (("run dir",) if many else ())]
    for r in rows:
        table.append((r["job_id"], r["created_utc"] or "-", r["model"] or "-", str(r["episodes"]),
                      str(r["completed"]), str(r["failed"]), str(r["cancelled"]), str(r["other"]),
                      "-" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}", r["state"])
                     + ((r["run_dir"] or "-",) if many else ()))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) if i < 3 or i >= 9 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    stopped = [r for r in rows if r["state"] == STOPPED]
    if stopped:
        r = stopped[0]
        print(f"{len(stopped)} stopped: their run ended first; finish one with  interactor run --resume {r['job_id']} "
              f"--run-dir {r['run_dir']}  or end it with  interactor cancel {r['job_id']} --run-dir {r['run_dir']}")
    return 0


FINISHED, CANCELLED, RUNNING, STOPPED, UNFINISHED = "finished", "cancelled", "running", "stopped", "unfinished"
FOLDER_DEPTH = 2  # run folders this far below --run-dir are listed


def run_folders_below(root: str) -> list[Path]:
    """``root`` and the folders up to ``FOLDER_DEPTH`` levels below it that hold a results.sqlite."""
    base = Path(root)
    found = [base / "results.sqlite", *sorted(base.glob("*/results.sqlite")), *sorted(base.glob("*/*/results.sqlite"))]
    return [db.parent for db in found if db.is_file()]


def store_jobs(url: str, run_dir: Path | None) -> list[dict]:
    """The jobs of one store, newest first, each with its state (``run_dir``: the run folder the
    store is in, whose Redis says whether an unfinished job runs; None for a store by URL)."""
    from broker.embedded import EmbeddedRedis
    from consumer.storage import open_store

    store = open_store(url, readonly=True)
    try:
        rows = [job_row(store.job_progress(job_id)) for job_id in reversed(store.job_ids())]
    finally:
        store.close()
    running = run_dir is not None and EmbeddedRedis.running_url(run_dir / "redis") is not None
    for r in rows:
        r["run_dir"] = None if run_dir is None else str(run_dir)
        if not r["other"]:
            r["state"] = CANCELLED if r["cancelled"] else FINISHED
        elif run_dir is None:
            r["state"] = UNFINISHED
        else:
            r["state"] = RUNNING if running else STOPPED
    return rows


def job_row(p: dict) -> dict:
    """One job of the list from its progress (``ResultStore.job_progress``): episodes in all
    (as submitted, or as stored when more), completed, failed, cancelled, and every other (not
    started, running, retrying: ``statuses`` has the stored ones each)."""
    statuses = p["statuses"]
    completed = statuses.get(StoredStatus.COMPLETED, 0)
    failed = statuses.get(StoredStatus.FAILED, 0)
    cancelled = statuses.get(StoredStatus.CANCELLED, 0)
    total = max(int(p["episodes_expected"] or 0), sum(statuses.values()))
    created = p["created_at"] if p["created_at"] is not None else p["first_started"]
    return {"job_id": p["job_id"], "created_at": created,
            "created_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(created)) if created is not None else None,
            "model": p["model"], "episodes": total, "completed": completed, "failed": failed, "cancelled": cancelled,
            "other": total - completed - failed - cancelled, "statuses": statuses, "mean_reward": p["mean_reward"]}


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
