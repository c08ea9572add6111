"""A local run whose job pauses ends (exit 3, the resume command printed) unless
--wait-when-paused; its stopped job stays manageable from its folder: `status`, `dlq list`,
`cancel`, `jobs` (issue 48 findings 5 and 6), and `run --resume JOB` with the setting that was
wrong corrected finishes it. Real local runs (embedded Redis, worker and consumer processes)
against the example env server and the model stand-in on loopback, driven by the commands a user
types."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, interruptible, wait_for
from tests.recording_model import RecordingModel
from tests.storecheck import db_rows
from tests.taskfiles import write_arith_tasks

pytestmark = pytest.mark.integration

EPISODES = 8
PAUSE_AFTER = 3


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}


def interactor(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], env=clean_env(), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def model():
    server = RecordingModel("smollm2")
    yield server
    server.stop()


def paused_run(tasks: str, model_url: str, run_dir, job: str, *extra: str) -> list[str]:
    """`interactor run` of ``tasks`` with a misspelt --model, which the server answers 404: every
    episode fails alike, and the job pauses after PAUSE_AFTER of them."""
    return ["run", tasks, "--llm-base-url", model_url, "--model", "smolm2", "--no-preflight", "--run-dir", str(run_dir),
            "--max-attempts", "1", "--pause-after-failures", str(PAUSE_AFTER), "--concurrency", "1",
            "--workers", "1", "--shutdown-grace", "1", "--job-id", job, *extra]


def test_a_paused_run_exits_and_its_stopped_job_is_inspected_cancelled_and_resumed(tmp_path, env_server, model):
    _, env_url = env_server
    model_url = model.url
    tasks = write_arith_tasks(tmp_path, env_url, rows=EPISODES, env_num=1)
    run_dir = tmp_path / "runs" / "eval"

    first = interactor(*paused_run(tasks, model_url, run_dir, "typo-1"))
    out = first.stdout + first.stderr
    assert first.returncode == 3, out[-3000:]
    assert f"job typo-1 paused: {PAUSE_AFTER} episodes in a row failed" in out, out[-3000:]
    assert f"interactor run --resume typo-1 --run-dir {run_dir}" in out
    assert f"interactor cancel typo-1 --run-dir {run_dir}" in out

    # The run has stopped: its job is inspected from the folder (before: "no Redis")
    status = interactor("status", "typo-1", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "paused" in status.stdout and "has stopped" in status.stderr, status.stdout + status.stderr
    letters = interactor("dlq", "list", "--job", "typo-1", "--run-dir", str(run_dir))
    assert letters.returncode == 0, letters.stderr
    failed = int(letters.stdout.strip().splitlines()[-1].split()[0])
    assert failed >= PAUSE_AFTER and "does not exist" in letters.stdout, letters.stdout
    listed = interactor("jobs", "--run-dir", str(tmp_path / "runs"))
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("typo-1"))
    assert row.split()[-1] == "stopped", listed.stdout
    assert f"interactor run --resume typo-1 --run-dir {run_dir}" in listed.stdout

    # ... and cancelled: the store has it, so jobs shows it cancelled (before: "other N" for ever)
    cancel = interactor("cancel", "typo-1", "--run-dir", str(run_dir))
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert "job typo-1 cancelled" in cancel.stdout
    listed = interactor("jobs", "--run-dir", str(run_dir), "--json")
    import json

    (job,) = [j for j in json.loads(listed.stdout) if j["job_id"] == "typo-1"]
    assert job["state"] == "cancelled" and job["other"] == 0, job
    assert job["failed"] == failed and job["cancelled"] == EPISODES - failed, job
    from broker.embedded import EmbeddedRedis

    assert EmbeddedRedis.running_url(run_dir / "redis") is None  # the command's Redis stopped with it

    # The same mistake again, then resumed with the setting corrected: the rest completes
    second = interactor(*paused_run(tasks, model_url, run_dir, "typo-2"))
    assert second.returncode == 3, (second.stdout + second.stderr)[-3000:]
    # a correction that is still wrong is refused by preflight, and changes nothing
    still = interactor("run", "--resume", "typo-2", "--run-dir", str(run_dir), "--model", "smollm3")
    assert still.returncode == 2, (still.stdout + still.stderr)[-3000:]
    assert "the job's settings were left as they were" in still.stderr and "smollm2" in still.stderr, still.stderr
    assert "corrected" not in still.stdout
    resumed = interactor("run", "--resume", "typo-2", "--run-dir", str(run_dir), "--model", "smollm2")
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 1, out[-3000:]  # 1: the episodes that failed before stay failed
    assert "job typo-2's settings corrected" in out and "model: 'smolm2' -> 'smollm2'" in out, out[:3000]
    db = str(run_dir / "results.sqlite")
    counts = dict(db_rows(db, "SELECT status, COUNT(*) FROM episodes WHERE job_id = 'typo-2' GROUP BY status"))
    assert counts["failed"] >= PAUSE_AFTER and counts["completed"] == EPISODES - counts["failed"], counts
    assert db_rows(db, "SELECT model FROM jobs WHERE job_id = 'typo-2'") == [("smollm2",)]


def test_wait_when_paused_keeps_the_run_until_the_job_is_cancelled(tmp_path, env_server, model):
    _, env_url = env_server
    model_url = model.url
    tasks = write_arith_tasks(tmp_path, env_url, rows=EPISODES, env_num=1)
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli",
                             *paused_run(tasks, model_url, run_dir, "waits", "--wait-when-paused")],
                            env=clean_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=interruptible)
    lines: list[str] = []
    try:
        import threading

        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        wait_for(lambda: any("job waits paused" in line for line in lines), 180, what="the pause said")
        assert proc.poll() is None, "".join(lines)[-3000:]  # still waiting, as asked
        cancel = interactor("cancel", "waits", "--run-dir", str(run_dir))
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        proc.wait(timeout=120)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, "".join(lines)[-3000:]
    assert "interactor run --resume waits" in "".join(lines)


def test_a_stopped_runs_redis_that_cannot_start_is_one_line(tmp_path):
    """A run folder whose Redis data is unreadable (a truncated disk, a hand-edited file):
    `status` says so in one line, exit 2, and leaves no server running."""
    from broker.embedded import EmbeddedRedis

    folder = tmp_path / "runs" / "redis"
    folder.mkdir(parents=True)
    (folder / "password").write_text("pw")
    (folder / "appendonly.aof").write_text("not an append-only file\n")
    out = interactor("status", "--run-dir", str(tmp_path / "runs"), timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "the stopped run's Redis in" in out.stderr and "did not start from its data" in out.stderr
    assert "Traceback" not in out.stderr and EmbeddedRedis.running_url(folder) is None
