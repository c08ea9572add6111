"""The commands that read Redis, as a new user meets them: without REDIS_URL, against a wrong
password, and beside a local run still going (found through --run-dir, no password to dig out).
Each says what is wrong in one line, never a traceback, and fails at once when waiting cannot
help."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from broker.embedded import EmbeddedRedis
from tests.conftest import ROOT, interruptible, wait_for

pytestmark = pytest.mark.integration


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}


def interactor(*args: str, cwd, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interactor.cli", *args], cwd=str(cwd), env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [["status"], ["dlq", "list"], ["metrics", "--once"], ["reconcile", "j1"],
                                     ["resume", "j1"], ["feed", "version", "j1"]])
def test_without_redis_url_a_command_says_so_in_one_line(tmp_path, command):
    out = interactor(*command, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "REDIS_URL" in out.stderr and "--run-dir" in out.stderr


@pytest.mark.parametrize("url, why", [
    ("redis://:pa#ss-word-9@127.0.0.1:6379/0", "percent-encode"),
    ("redis://:pass-word-9@127.0.0.1:6379/0?socket_timeout=5", "'socket_timeout' is not supported"),
])
def test_a_refused_redis_url_is_one_line_naming_the_problem_never_the_password(tmp_path, url, why):
    out = interactor("status", cwd=tmp_path, env=clean_env() | {"REDIS_URL": url})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert why in out.stderr and "word-9" not in out.stderr, out.stderr


def test_a_wrong_password_fails_at_once_and_says_so(tmp_path):
    """A refused login was retried like an outage (about 17 s) and then called 'unreachable'."""
    server = EmbeddedRedis(tmp_path / "redis", password="right-one").start()
    try:
        env = clean_env() | {"REDIS_URL": f"redis://:wrong-one@127.0.0.1:{server.port}/0"}
        t0 = time.monotonic()
        out = interactor("status", cwd=tmp_path, env=env)
        took = time.monotonic() - t0
        assert out.returncode == 2 and "refused the login" in out.stderr and "password" in out.stderr, out.stderr
        assert "wrong-one" not in out.stderr and "Traceback" not in out.stderr
        assert took < 10, took  # no dozen back-offs: python's start-up and one refusal
        missing = interactor("status", cwd=tmp_path, env=clean_env() | {"REDIS_URL": f"redis://127.0.0.1:{server.port}/0"})
        assert missing.returncode == 2 and "refused the login" in missing.stderr, missing.stderr
    finally:
        server.stop()


def test_a_local_runs_redis_is_found_through_its_run_dir(tmp_path, env_server):
    from examples.model_standin import start_in_thread

    _, env_url = env_server
    slow, slow_url = start_in_thread(latency_ms=400)
    run_dir = tmp_path / "runs"
    tasks = tmp_path / "long.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 100000, max_turns: 30}}\n    env_num: 3\n")
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", str(tasks), "--llm-base-url",
                             slow_url + "/v1", "--run-dir", str(run_dir), "--concurrency", "3", "--workers", "1",
                             "--shutdown-grace", "1"], env=clean_env(), cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    try:
        wait_for(lambda: EmbeddedRedis.running_url(run_dir / "redis"), 60, what="the run's embedded Redis")
        status = {}

        def shows_the_job():
            status["out"] = interactor("status", "--run-dir", str(run_dir), cwd=tmp_path)
            return status["out"].returncode == 0 and "running=" in status["out"].stdout and "jobs       none" not in \
                status["out"].stdout

        wait_for(shows_the_job, 60, interval=0.5, what="status through --run-dir")
        assert "***" in status["out"].stdout  # the password is found, and not shown
        assert interactor("dlq", "list", "--run-dir", str(run_dir), cwd=tmp_path).returncode == 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
        slow.shutdown()
    # Stopped: the address is gone with its server; a command starts it from the folder's data for
    # itself (interactor/stopped_run.py), says so, and stops it again.
    assert EmbeddedRedis.running_url(run_dir / "redis") is None
    after = interactor("status", "--run-dir", str(run_dir), cwd=tmp_path)
    assert after.returncode == 0 and "has stopped" in after.stderr and "running=" in after.stdout, after.stderr
    assert EmbeddedRedis.running_url(run_dir / "redis") is None
    # A folder no run used says where results are
    never = interactor("status", "--run-dir", str(tmp_path / "elsewhere"), cwd=tmp_path)
    assert never.returncode == 2 and "none ran in" in never.stderr and "results" in never.stderr, never.stderr
