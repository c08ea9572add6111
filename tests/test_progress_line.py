"""`interactor run`'s progress line (interactor/localrun.py, interactor/report.py) when a worker
dies mid-run: it never shows more attempts running than there are (the dead worker's are
`stalled` until their leases expire), and never a negative rate (the dead attempt's steps,
set aside, are not steps undone)."""

from __future__ import annotations

import os
import pty
import re
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest

from broker import errors
from broker.keys import Keys
from broker.ledger import Ledger
from broker.states import LedgerState, StoredStatus
from interactor.localrun import StepRate, process_alive
from interactor.report import progress_line
from tests.conftest import ROOT, wait_for

PROGRESS = re.compile(r"running=(\d+) (?:stalled=(\d+) )?waiting=\d+ \|\s*(-?[\d.]+) steps/s")


@pytest.mark.unit
def test_the_rate_counts_steps_taken_and_never_falls_below_zero():
    rate = StepRate()
    seen = [rate.update(stored, t) for t, stored in [(0.0, 40), (1.0, 44), (2.0, 38), (3.0, 41), (4.0, 47)]]
    # 40 at the first look (a resumed job's): none taken yet; 4 in the first second; 6 set aside
    # (a lost attempt's) and 0 taken in the next; then 3 and 6, the re-run's steps among them
    assert seen == [0.0, 4.0, 0.0, 3.0, 6.0] and rate.taken == 13


@pytest.mark.unit
def test_the_line_shows_stalled_attempts_apart():
    counts = {LedgerState.DONE: 3, LedgerState.RUNNING: 2, LedgerState.QUEUED: 4}
    line = progress_line(counts, {"mean_reward": 0.5}, 10, 1.5, 12, stalled=1)
    assert "running=2 stalled=1 waiting=4 " in line
    assert "stalled" not in progress_line(counts, {}, 10, 1.5, 12)


@pytest.mark.unit
def test_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 30,
             what="the child exited, not reaped")
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid) and process_alive(os.getpid())


def read_pty(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the run ended: its side of the terminal is closed
            return
        if not data:
            return
        into.append(data)


@pytest.mark.integration
def test_a_killed_worker_is_neither_counted_twice_nor_a_negative_rate(settings, env_server, redis_client, tmp_path):
    """Two workers, one episode each; the Celery process of the one whose episode has stored
    the most steps is SIGKILLed, its supervisor starts another, which takes a new episode while
    the dead attempt still holds its lease. Before: running=3 at concurrency 2 for as long as
    the lease lived, and, when the dead attempt's 6+ steps were set aside, a negative rate.
    Resume is off, so that they are set aside."""
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    model, model_url = start_in_thread(latency_ms=600)
    s = settings.replace(llm_base_url=model_url + "/v1", lease_ttl_s=15.0, sweep_interval_s=1.0, no_resume=True,
                         concurrency=2)
    tasks = tmp_path / "guess.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 1000000, max_turns: 30}}\n    env_num: 6\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(s.as_environ())
    env["PYTHONPATH"] = str(ROOT)
    master, slave = pty.openpty()
    run = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--workers", "2",
                            "--no-preflight"], cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL,
                           stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out: list[bytes] = []
    reader = threading.Thread(target=read_pty, args=(master, out), daemon=True)
    reader.start()
    text = lambda: b"".join(out).decode(errors="replace")  # noqa: E731
    try:
        job = wait_for(lambda: (m := re.search(r"job (\S+): 6 episodes", text())) and m.group(1), 60,
                       what="the job enqueued")
        keys = Keys(s.key_prefix)
        ledger = Ledger.for_settings(redis_client, s)

        def deep_episode():
            """A running episode with 6 steps stored, while both workers run one."""
            if ledger.counts(job)[LedgerState.RUNNING] != 2 or not os.path.exists(s.results_store):
                return None
            db = sqlite3.connect(s.results_store, timeout=5)
            try:
                rows = db.execute("SELECT episode_id FROM episodes WHERE job_id = ? AND status = ? AND steps >= 6",
                                  (job, StoredStatus.RUNNING)).fetchall()
            except sqlite3.OperationalError:
                return None
            finally:
                db.close()
            return rows[0][0] if rows else None

        episode = wait_for(deep_episode, 180, interval=0.3, what="an episode 6 steps in")
        worker = ledger.r.get(keys.lease(episode)).decode().rsplit(":", 2)[0]
        pid = int(worker.rsplit("-", 1)[1])
        killed_at = len(text())
        os.kill(pid, signal.SIGKILL)
        run.wait(timeout=400)
        reader.join(10)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
        os.close(master)
        model.shutdown()
    assert run.returncode == 0, text()[-3000:]
    lines = [PROGRESS.search(chunk) for chunk in re.split(r"[\r\n]", text())]
    shown = [(int(m.group(1)), int(m.group(2) or 0), float(m.group(3))) for m in lines if m]
    after = [(int(m.group(1)), int(m.group(2) or 0)) for m in (PROGRESS.search(c) for c in
                                                               re.split(r"[\r\n]", text()[killed_at:])) if m]
    print(f"\n{len(shown)} progress lines; running at most {max(r for r, _, _ in shown)}, "
          f"stalled at most {max(st for _, st, _ in shown)}, rates {min(x for _, _, x in shown)} to "
          f"{max(x for _, _, x in shown)}")
    assert all(r <= 2 for r, _, _ in shown), [x for x in shown if x[0] > 2]
    assert all(rate >= 0 for _, _, rate in shown), [x for x in shown if x[2] < 0]
    assert any(st == 1 for _, st in after)  # the dead attempt was shown, apart, until re-queued
    # and its reclaim named the killed worker (broker/recovery.py)
    db = sqlite3.connect(s.results_store)
    try:
        lost = db.execute("SELECT episode_id, worker FROM attempts WHERE job_id = ? AND reason = ?",
                          (job, errors.WORKER_LOST)).fetchall()
    finally:
        db.close()
    assert lost == [(episode, worker)]
