"""``interactor feed serve`` as a user runs it: a process of its own that starts an embedded
Redis, local workers and a consumer (as ``interactor run`` does), serves a continuous job's
groups over HTTP to a trainer using the stdlib client, and on SIGTERM stops everything it
started (found by a marker in the children's environment, as tests/test_no_orphans.py does).
And what a refused ``/start_rollout`` leaves behind: nothing, on disk either."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from interactor.feed_client import Feed, FeedHTTPError
from interactor.feedserve import FeedApp, make_server
from interactor.rollout import Rollout
from tests.conftest import ROOT, wait_for
from tests.test_feed import run_factory, take_and_ack_until, write_tasks  # noqa: F401 - run_factory: fixture
from tests.test_no_orphans import assert_none_left, clean_env, describe, mark, marked  # noqa: F401 - mark: fixture

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FeedServer:
    def __init__(self, tmp_path, mark, model_url, *args, env_url="", extra_env=None):
        self.run_dir = tmp_path / "runs"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = clean_env(mark)
        env["INTERACTOR_ENV_BASE_URL"] = env_url
        env.update(extra_env or {})
        self.log = tmp_path / "feed-serve.log"
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "interactor.cli", "feed", "serve", *args, "--port", str(self.port),
                 "--llm-base-url", model_url + "/v1", "--run-dir", str(self.run_dir), "--workers", "1",
                 "--concurrency", "4", "--shutdown-grace", "2", "--ack-timeout", "60"],
                env=env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self):
        def up():
            assert self.p.poll() is None, self.output()
            try:
                return Feed(self.url).health()
            except (OSError, FeedHTTPError):
                return None

        return wait_for(up, 120, what="the feed server up")

    def stop(self, sig=signal.SIGTERM) -> int:
        self.p.send_signal(sig)
        try:
            return self.p.wait(120)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait(10)


def take_and_ack_all(f: Feed, n: int) -> list[dict]:
    got = []

    def more():
        batch = f.take(2, timeout=1.0)
        got.extend(batch)
        if batch:
            assert f.ack([g["group_id"] for g in batch])["acked"] == [g["group_id"] for g in batch]
        return len(got) >= n

    wait_for(more, 240, interval=0.01, what=f"{n} groups taken and acknowledged")
    return got


def test_feed_serve_task_files_end_to_end_and_a_clean_stop(env_server, model_server, tmp_path, mark):
    _, env_url = env_server
    _, model_url = model_server
    tasks = write_tasks(tmp_path, env_url, rows=4)
    server = FeedServer(tmp_path, mark, model_url, tasks, "--epochs", "1", "--max-ahead", "4")
    try:
        job_id = server.health()["job_id"]
        assert job_id, server.output()
        f = Feed(server.url, trainer="grpo-0")
        got = take_and_ack_all(f, 4)
        ids = [g["group_id"] for g in got]
        assert len(set(ids)) == 4 and all(g["job_id"] == job_id and len(g["samples"]) == 2 for g in got)
        assert f.take(2, timeout=1.0) == []  # one epoch: nothing more, nothing twice
        st = f.stats()
        assert st["acked"] == 4 and st["produced"] == 4 and st["inflight"] == 0
        # One job per server: a second start is refused, naming the job that runs.
        with pytest.raises(FeedHTTPError) as err:
            f._call("POST", "/start_rollout", {"task_files": [tasks]})
        assert err.value.status == 409 and job_id in str(err.value)
        # Redis (working in the run folder), the worker, its Celery process, the consumer, the guard.
        running = marked(mark, server.run_dir)
        assert len(running) >= 5, describe(running)
        assert server.stop() == 0, server.output()[-3000:]
    finally:
        if server.p.poll() is None:
            server.p.kill()
    out = server.output()
    assert f"job {job_id}: continuous over" in out and "embedded Redis" in out
    assert_none_left(mark, server.run_dir, 30, "processes of a feed server stopped by SIGTERM")


def test_start_rollout_submits_a_job_from_the_originals_config(env_server, model_server, tmp_path, mark):
    """Started without task files, the server waits for ``/start_rollout``; bad bodies are
    refused naming the problem (and create nothing), paths outside the folders the operator
    allowed are refused however they are spelled and their content never shows, the original
    buffer server's ``{task_type, input_file, num_repeat_per_sample}`` starts a continuous job,
    and a second start is refused while it runs."""
    _, env_url = env_server
    _, model_url = model_server
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    data = allowed / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(3)))
    outside = tmp_path / "private.jsonl"  # readable by the server's process, outside its roots
    outside.write_text(json.dumps({"question": "SECRET-ROW-TEXT", "answer": 1}) + "\n")
    outside_tasks = tmp_path / "private.yaml"
    outside_tasks.write_text(json.dumps({"environments": [{"env_name": "arithmetic", "dataset": str(outside)}]}))
    (allowed / "link.jsonl").symlink_to(outside)
    (allowed / "tasks-link.yaml").symlink_to(outside_tasks)
    server = FeedServer(tmp_path, mark, model_url, "--max-ahead", "3", env_url=env_url,
                        extra_env={"INTERACTOR_FEED_TASK_ROOTS": str(allowed)})
    try:
        assert server.health()["job_id"] is None
        f = Feed(server.url, trainer="t")
        with pytest.raises(FeedHTTPError) as err:
            f.take(1, timeout=0)
        assert err.value.status == 409 and "start_rollout" in str(err.value)
        for body, says in [({}, "needs one of"),
                           ({"task_type": "arithmetic", "input_file": str(data)}, "num_repeat_per_sample"),
                           ({"task_files": [str(tmp_path / "missing.yaml")]}, "missing.yaml"),
                           ({"task_type": "arithmetic", "input_file": str(data), "num_repeat_per_sample": 2,
                             "epochs": -1}, "epochs must be")]:
            with pytest.raises(FeedHTTPError) as err:
                f._call("POST", "/start_rollout", body)
            assert err.value.status == 400 and says in str(err.value), (body, str(err.value))
        original = {"task_type": "arithmetic", "num_repeat_per_sample": 2}
        for body in [{**original, "input_file": "/etc/passwd"},
                     {**original, "input_file": str(outside)},
                     {**original, "input_file": str(allowed / ".." / outside.name)},
                     {**original, "input_file": str(allowed / "link.jsonl")},
                     {"task_files": [str(outside_tasks)]},
                     {"task_files": [str(allowed / "tasks-link.yaml")]},
                     {"config": str(allowed / ".." / ".." / outside_tasks.parent.name / outside_tasks.name)},
                     {"config": {"environments": [{"env_name": "arithmetic", "dataset": str(outside)}]}}]:
            with pytest.raises(FeedHTTPError) as err:
                f._call("POST", "/start_rollout", body)
            text = str(err.value)
            assert err.value.status == 400 and "outside the folders this server may read" in text, (body, text)
            assert str(allowed) in text and "SECRET-ROW-TEXT" not in text and "root:" not in text, (body, text)
        assert Feed(server.url).health()["job_id"] is None  # nothing was started by them
        answer = f._call("POST", "/start_rollout", {
            "task_type": "arithmetic", "input_file": str(data), "num_repeat_per_sample": 2, "epochs": 1,
            "remote_engine_url": "http://elsewhere:30000", "sampling_params": {"temperature": 1.0}})
        assert answer["success"] is True and answer["job_id"] and "Rollout started" in answer["message"]
        assert "remote_engine_url, sampling_params ignored" in answer["message"]
        with pytest.raises(FeedHTTPError) as err:
            f._call("POST", "/start_rollout", {"task_files": ["x.yaml"]})
        assert err.value.status == 409 and answer["job_id"] in str(err.value)
        got = take_and_ack_all(f, 3)
        questions = sorted(json.dumps(g["samples"][0]["steps"][0]["messages"]).split("What is ")[1][:1] for g in got)
        assert questions == ["0", "1", "2"] and all(len(g["samples"]) == 2 for g in got)
        assert f.take(1, timeout=1.0) == []
        assert server.stop() == 0, server.output()[-3000:]
    finally:
        if server.p.poll() is None:
            server.p.kill()
    assert_none_left(mark, server.run_dir, 30, "processes of a feed server stopped by SIGTERM")


@contextlib.contextmanager
def start_rollout_route(redis_client, settings):
    """POST /start_rollout served in this process (the server's own Rollout, no fleet, no
    preflight): a feed client on it, stopped at the end."""
    rollout = Rollout(redis_client, settings, None, threading.Event(), preflight=False)
    server = make_server(FeedApp(start=rollout.from_request), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Feed(f"http://127.0.0.1:{server.server_address[1]}", trainer="t")
    finally:
        server.shutdown()
        server.server_close()
        rollout.stop.set()
        if rollout.backfill is not None:
            rollout.backfill.stop()
        if rollout.thread is not None:
            rollout.thread.join(10)


def test_a_refused_start_rollout_leaves_no_file(settings, redis_client):
    """The review's repro: an inline ``config`` of 0.9 MB naming an environment the task file
    format refuses, posted five times. Each is a 400, and none leaves its body in
    ``<run-dir>/rollouts``, where any local process or trainer could otherwise fill the disk with
    them; nor does a request of the original's shape refused for its path. A task file a refused
    request named there stays (it is not the request's), and an accepted request's file stays
    for its job. The route runs in this process (:func:`start_rollout_route`)."""
    folder = Path(settings.run_dir) / "rollouts"
    with start_rollout_route(redis_client, settings) as f:
        refused = [{"config": {"environments": [{"env_name": "nope", "junk": "x" * 900_000}]}}] * 5 + [
            {"task_type": "arithmetic", "input_file": "/etc/passwd", "num_repeat_per_sample": 2}]
        for body in refused:
            with pytest.raises(FeedHTTPError) as err:
                f._call("POST", "/start_rollout", body)
            assert err.value.status == 400, str(err.value)
        named = folder / "mine.yaml"
        named.write_text("environments: not a list\n")
        with pytest.raises(FeedHTTPError) as err:
            f._call("POST", "/start_rollout", {"task_files": [str(named)]})
        assert err.value.status == 400, str(err.value)
        assert sorted(p.name for p in folder.iterdir()) == ["mine.yaml"]
        answer = f._call("POST", "/start_rollout", {"config": {"environments": [
            {"env_name": "guess_number", "base_url": "http://127.0.0.1:9", "env_num": 2}]}, "epochs": 1})
        assert answer["success"] is True, answer
        kept = [p for p in folder.iterdir() if p != named]
        assert len(kept) == 1 and json.loads(kept[0].read_text())["environments"][0]["env_name"] == "guess_number"


def test_demo_rl_runs_briefly_and_leaves_no_process(tmp_path, mark):
    """``make demo-rl`` (examples/demo_rl.py) for four steps: the trainer loop takes, pushes
    weights to the stand-in, acknowledges and publishes versions; every process it started
    stops with it."""
    run_dir = tmp_path / "demo-rl"
    out = subprocess.run([sys.executable, "-m", "examples.demo_rl", "--run-dir", str(run_dir), "--steps", "4",
                          "--batch", "2", "--workers", "1"], env=clean_env(mark), cwd=str(ROOT),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 4 and all(" 2 groups, " in line and "mean reward" in line for line in steps), out.stdout
    assert "version 4 (stand-in skill" in steps[-1]
    assert any(line.startswith("4 steps, version 4: mean reward") for line in lines), out.stdout
    assert any("8 groups acknowledged" in line for line in lines), out.stdout
    assert_none_left(mark, run_dir, 30, "processes of the RL demo")


def feed_serve_job(procs, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interactor.cli", "feed", "serve", "--port", "0", *args],
                          env=procs.env(), cwd=str(ROOT), capture_output=True, text=True, timeout=120)


def test_feed_serve_job_refuses_an_unknown_or_finished_job_and_feed_flags(run_factory, procs, tmp_path):
    """``--job J`` serves a job as it was created: feed flags with it are refused (exit 2, one
    line naming them) and the job's feed settings stay as they were, since applying them to a
    running feed could settle or hand away groups; an unknown job, or one whose feed is
    finished, is refused in one line too, before anything starts. A running job is served."""
    out = feed_serve_job(procs, "--job", "no-such-job")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert "--job no-such-job: no such job" in out.stderr and "Traceback" not in out.stderr

    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=1), feed_max_ahead=2, epochs=1)
    before = run.r.hgetall(run.keys.feed_config(run.job_id))
    out = feed_serve_job(procs, "--job", run.job_id, "--max-ahead", "50", "--stale-policy", "drop",
                         "--ack-timeout", "1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--max-ahead, --stale-policy, --ack-timeout: a feed's settings are fixed" in out.stderr
    assert run.r.hgetall(run.keys.feed_config(run.job_id)) == before  # nothing applied

    # Running (nothing produced yet, one epoch to go): served; its producer makes the one group.
    server = procs.start("feed", "feed", "serve", "--job", run.job_id, "--port", "0")
    wait_for(lambda: f"feed of job {run.job_id} at http" in procs.log("feed"), 60, what="the feed server up")
    got = take_and_ack_until(run, lambda st: st["acked"] >= 1, timeout=120)
    assert len(got) == 1 and run.service.stats()["inflight"] == 0
    server.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0, procs.log("feed")

    out = feed_serve_job(procs, "--job", run.job_id)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"--job {run.job_id}: the job is finished" in out.stderr and "Traceback" not in out.stderr


def test_an_inline_config_with_an_empty_dataset_is_a_job_without_one(settings, redis_client):
    """``dataset: ""`` is no dataset in a task file (the original's reader takes it so); inline
    in /start_rollout it was joined to the server's folder and refused as a folder."""
    with start_rollout_route(redis_client, settings) as f:
        answer = f._call("POST", "/start_rollout", {"config": {"environments": [
            {"env_name": "guess_number", "base_url": "http://127.0.0.1:9", "env_num": 2, "dataset": ""}]},
            "epochs": 1})
        assert answer["success"] is True, answer
