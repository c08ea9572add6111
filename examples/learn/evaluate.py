"""Held-out evaluation: an ordinary ``interactor run`` job over the held-out split, against the
version the server holds (the trainer reloads nothing while it runs), and its mean reward as
``interactor results --json`` reports it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from examples.learn.task_files import SAMPLING


@dataclass(frozen=True)
class Evaluation:
    version: int
    reward: float
    episodes: int
    failed: int
    seconds: float

    def as_dict(self) -> dict:
        return {"version": self.version, "reward": self.reward, "episodes": self.episodes, "failed": self.failed,
                "seconds": round(self.seconds, 1)}


def evaluate(task_file: str | Path, llm_base_url: str, run_dir: str | Path, version: int, *, concurrency: int = 8,
             timeout_s: float = 900.0) -> Evaluation:
    run_dir = Path(run_dir)
    job = f"learn-eval-v{version}"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "interactor.cli", "run", str(task_file), "--llm-base-url", llm_base_url,
           "--model", "smollm2", *SAMPLING, "--run-dir", str(run_dir), "--job-id", job,
           "--concurrency", str(concurrency), "--workers", "1", "--max-attempts", "2"]
    log = run_dir / f"{job}.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the evaluation job {job} exited with {done.returncode} (log: {log}):\n"
                           + log.read_text(errors="replace")[-2000:])
    res = subprocess.run([sys.executable, "-m", "interactor.cli", "results", job, "--json", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=True)
    j = json.loads(res.stdout)["job"]
    return Evaluation(version, float(j["mean_reward"] or 0.0), int(j["completed"]), int(j["failed"]),
                      time.monotonic() - t0)
