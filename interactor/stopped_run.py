"""A stopped local run's jobs stay manageable from its folder: ``interactor cancel``, ``status``,
``dlq``, ``resume`` and ``reconcile`` with ``--run-dir`` of a run that has ended.

``interactor run`` keeps its embedded Redis's data in ``RUN_DIR/redis`` (append-only files and
the password) after it stops, interrupted or paused, so that ``run --resume`` can finish the job.
A command that needs Redis and finds none running for the folder starts that Redis from its data
for as long as the command runs (:func:`folder_redis`): the server stops when the command ends,
and is stopped by the kernel if the command dies (``PR_SET_PDEATHSIG``). While it runs, its
address is in the folder as a running run's is, so a second command finds it rather than
starting another server on the same files; ``interactor run`` refuses to start on a folder
whose Redis another command holds.

A stopped run has no consumer: what a command changes in Redis for the results store (a
cancel's ``EpisodesCancelled`` records, the attempts its sweep ends) is written into the
folder's results store by the command itself (:func:`settle_into_store`), so that ``interactor
jobs`` and ``results`` show the job as it now is.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from broker.settings import Settings

__all__ = ["folder_redis", "started_for_command", "settle_into_store", "held_by_command"]

_started = None  # the EmbeddedRedis this process started for its command, if any


def _stopped_data(folder: Path) -> bool:
    """Whether ``folder`` (a run folder's ``redis/``) holds a stopped run's Redis data."""
    return (folder / "password").is_file() and any(
        (folder / name).exists() for name in ("appendonlydir", "appendonly.aof", "dump.rdb"))


def folder_redis(settings: Settings) -> str | None:
    """The URL of ``settings.run_dir``'s Redis, started from its data for this command when the
    run there has stopped; None when the folder holds no run's data."""
    global _started
    if _started is not None:
        return _started.url
    from broker.embedded import EmbeddedRedis
    from interactor.children import _with_parent

    folder = Path(settings.run_dir) / "redis"
    if not _stopped_data(folder):
        return None
    password = (folder / "password").read_text().strip()
    server = EmbeddedRedis(folder, password=password, preexec_fn=_with_parent(os.getpid()))
    try:
        server.start()
    except RuntimeError as exc:  # its data unreadable, say: one line, not a traceback
        from broker.settings import SettingsError

        server.stop(kill=True)
        said = " ".join(str(exc).split())
        raise SettingsError(f"the stopped run's Redis in {folder} did not start from its data (its log ends: "
                            f"...{said[-300:]})") from None
    (folder / COMMAND_MARK).write_text(str(os.getpid()))
    _started = server
    atexit.register(_stop)
    print(f"(the run in {settings.run_dir}/ has stopped: its Redis was started from {folder} for this command, "
          "and stops with it)", file=sys.stderr, flush=True)
    return server.url


COMMAND_MARK = "command"  # beside the address file: the pid of the command that started the server


def started_for_command() -> bool:
    """Whether this process started its folder's Redis for itself (a stopped run's)."""
    return _started is not None


def held_by_command(folder: Path) -> int | None:
    """The pid of another command holding ``folder``'s (a run folder's ``redis/``) Redis, started
    by :func:`folder_redis`, while that server runs; None otherwise."""
    from broker.embedded import EmbeddedRedis

    try:
        pid = int((folder / COMMAND_MARK).read_text())
    except (OSError, ValueError):
        return None
    return pid if EmbeddedRedis.running_url(folder) else None


def _stop() -> None:
    global _started
    if _started is not None:
        (_started.folder / COMMAND_MARK).unlink(missing_ok=True)
        _started.stop()
        _started = None


def settle_into_store(client, settings: Settings, *, rounds: int = 1000) -> int:
    """Write what the results stream holds into the run's results store, as the run's consumer
    would have (under its name, so that what it left pending is taken too); returns the records
    written. For a stopped run, whose consumer is gone."""
    from consumer.ingest import Ingestor
    from consumer.storage import open_store

    store = open_store(settings.results_store)
    try:
        ingest = Ingestor(client, settings, store, name="consumer")
        written = 0
        for _ in range(rounds):
            n = ingest.poll_once(block_ms=1)
            written += n
            if not n and not ingest.pending():
                break
        ingest.trim()
        return written
    finally:
        store.close()
