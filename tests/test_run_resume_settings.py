"""`interactor run --resume JOB` finishes a stopped job as the run that started it would have: with
that run's worker flags (--concurrency, --workers, ...), said in one line; a flag of the job's
own settings (model, sampling, step loop) corrects the stored job, said in one line, and one a
resume cannot apply (--env-base-url) is refused. A real local run
(embedded Redis, worker and consumer processes) against the stand-in servers on loopback,
stopped by Ctrl-C and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, interruptible, wait_for
from tests.storecheck import db_rows

pytestmark = pytest.mark.integration

RUN_CONCURRENCY = 2
EPISODES = 6


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans (start, end) open at one moment."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    now = top = 0
    for _, d in events:
        now += d
        top = max(top, now)
    return top


def test_resume_runs_at_the_runs_own_concurrency_and_takes_corrected_job_settings(env_server, tmp_path):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=300)
    try:
        tasks = tmp_path / "long.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                         f"    env_params: {{low: 1, high: 4000, max_turns: 20}}\n    env_num: {EPISODES}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
        run_dir = tmp_path / "runs"
        proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url",
                                 slow_url + "/v1", "--run-dir", str(run_dir), "--concurrency", str(RUN_CONCURRENCY),
                                 "--workers", "1", "--shutdown-grace", "1"], env=env, cwd=str(ROOT),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
        db = str(run_dir / "results.sqlite")
        wait_for(lambda: os.path.exists(db) and _steps(db) > 0, 120, what="steps recorded")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-3000:]
        job_id = out.split("job ", 1)[1].split(":", 1)[0]

        def resume(*flags):
            return subprocess.run([sys.executable, "-m", "interactor.cli", "run", "--resume", job_id, "--run-dir",
                                   str(run_dir), *flags], env=env, cwd=str(ROOT), capture_output=True, text=True,
                                  timeout=300)

        refused = resume("--env-base-url", env_url)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert ("cannot change --env-base-url (each episode keeps the env server it was planned with)"
                in refused.stderr and "new job" in refused.stderr), refused.stderr
        assert "max_tokens" not in slow.stats()["request_params"]  # the run sent none

        resumed_at = time.time()
        resumed = resume("--max-tokens", "64", "--temperature", "0")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
        assert (f"job {job_id}'s settings corrected" in resumed.stdout and "temperature: 0.3 -> 0.0" in resumed.stdout
                and 'llm_params: {} -> {"max_tokens": 64}' in resumed.stdout), resumed.stdout[:2000]
        assert slow.stats()["request_params"]["max_tokens"] == ["64"]
        spec = json.loads(db_rows(db, "SELECT spec FROM jobs WHERE job_id = ?", (job_id,))[0][0])
        assert spec["llm_params"] == {"max_tokens": 64} and spec["temperature"] == 0.0
        assert (f"resuming job {job_id} with the run's own worker settings: " in resumed.stdout
                and f"--concurrency {RUN_CONCURRENCY}" in resumed.stdout and "--workers 1" in resumed.stdout), \
            resumed.stdout[:2000]
        assert db_rows(db, "SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status",
                       (job_id,)) == [("completed", EPISODES)]
        spans = db_rows(db, "SELECT started_at, finished_at FROM attempts WHERE job_id = ? AND started_at >= ?",
                        (job_id, resumed_at))
        assert spans, "no attempt ran after the resume"
        assert most_at_once(spans) <= RUN_CONCURRENCY, spans
    finally:
        slow.shutdown()


def _steps(db: str) -> int:
    try:
        return db_rows(db, "SELECT COUNT(*) FROM session_steps")[0][0]
    except Exception:  # noqa: BLE001 - the file is being created
        return 0
