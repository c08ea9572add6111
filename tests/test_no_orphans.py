"""No orphans: a command that starts child processes stops them when it is stopped by SIGTERM
or SIGHUP (as on Ctrl-C: same report, and ``--resume`` finishes the job), and its children stop
by themselves when it is killed outright (SIGKILL).

The processes of one run are found by a marker in their environment, which every child
inherits, or by their working directory in the run's folder (redis-server overwrites its
environment with its process title, but works in its data folder): never by name (other test
runs on the same machine have processes of the same names).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import psutil
import pytest

from tests.conftest import ROOT, wait_for
from tests.storecheck import assert_trajectories_sound, db_rows

pytestmark = pytest.mark.integration

MARK = "NO_ORPHANS_TEST_MARK"


def marked(mark: str, folder) -> list[psutil.Process]:
    """Live processes (zombies aside) whose environment carries ``mark`` or that work in
    ``folder``."""
    out = []
    folder = str(folder)
    me = os.getpid()
    for p in psutil.process_iter():
        try:
            if p.pid == me or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(MARK) == mark or p.cwd().startswith(folder):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _cwd(p: psutil.Process) -> str:
    try:
        return p.cwd()
    except psutil.Error:
        return ""


def describe(procs: list[psutil.Process]) -> str:
    shown = []
    for p in procs:
        try:
            shown.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            pass
    return "\n".join(shown)


def assert_none_left(mark: str, folder, timeout: float, what: str) -> None:
    try:
        wait_for(lambda: not marked(mark, folder), timeout, interval=0.5, what=what)
    except AssertionError:
        raise AssertionError(f"{what}: still running after {timeout}s:\n{describe(marked(mark, folder))}") from None


@pytest.fixture
def mark(tmp_path):
    """A marker for one test's processes; whatever carries it at the end is killed (a failed
    test must not leave its orphans to the tests after it)."""
    value = uuid.uuid4().hex
    yield value
    for p in marked(value, tmp_path):
        try:
            p.kill()
        except psutil.Error:
            pass


def clean_env(mark: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env[MARK] = mark
    env["PYTHONUNBUFFERED"] = "1"
    return env


def steps_recorded(run_dir) -> bool:
    db = run_dir / "results.sqlite"
    if not db.exists():
        return False
    try:
        return bool(db_rows(str(db), "SELECT COUNT(*) FROM session_steps")[0][0])
    except Exception:  # noqa: BLE001 - the file is being created
        return False


@pytest.fixture
def slow_model():
    from examples.model_standin import start_in_thread

    server, url = start_in_thread(latency_ms=500)
    yield url
    server.shutdown()


def _sighup_as_from_a_terminal() -> None:
    """preexec_fn: SIGHUP at its default, as a command typed in a terminal has it. A test
    runner started under ``nohup`` passes SIGHUP on ignored, and our commands rightly leave an
    ignored SIGHUP alone (the nohup test below): without this, the SIGHUP tests would test nohup."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_run_stopped_by_a_signal_leaves_no_process_and_resume_finishes(env_server, slow_model, tmp_path, mark,
                                                                       sig):
    _, env_url = env_server
    tasks = tmp_path / "long.yaml"
    tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n"
                     f"    env_params: {{low: 1, high: 100000, max_turns: 20}}\n    env_num: 6\n")
    env = clean_env(mark)
    run_dir = tmp_path / "runs"
    common = ["--llm-base-url", slow_model + "/v1", "--run-dir", str(run_dir), "--concurrency", "3",
              "--workers", "1", "--shutdown-grace", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "run", str(tasks), *common], env=env,
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sighup_as_from_a_terminal)
    try:
        wait_for(lambda: steps_recorded(run_dir), 90, what="steps recorded")
        # Ourselves, Redis, the consumer and the worker (and its Celery process, the guard).
        running = marked(mark, run_dir)
        assert len(running) >= 4, describe(running)
        assert any(_cwd(p).startswith(str(run_dir / "redis")) for p in running), describe(running)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        # Children see their parent die within about a second (the kernel's signal, or their
        # own watch); the workers' grace is 1 s. The bound is for a machine busy with others.
        assert_none_left(mark, run_dir, 60, "processes of a SIGKILLed run")
    else:
        assert proc.returncode == 128 + sig, out[-3000:]
        assert f"interrupted ({sig.name})" in out and "left unfinished:" in out and "--resume" in out, out[-3000:]
        # `run` waited for its children before reporting: none is left now, at once.
        assert_none_left(mark, run_dir, 5, f"processes of a run stopped by {sig.name}")
    job_id = out.split("job ", 1)[1].split(":", 1)[0]
    resumed = subprocess.run([sys.executable, "-m", "interactor.cli", "run", "--resume", job_id, *common,
                              "--concurrency", "6"], env=env, cwd=str(ROOT), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    db = str(run_dir / "results.sqlite")
    assert db_rows(db, "SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status",
                   (job_id,)) == [("completed", 6)]
    assert_trajectories_sound(db, job_id)
    assert_none_left(mark, run_dir, 5, "processes of the resumed run")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_demo_stopped_by_a_signal_leaves_no_process(tmp_path, mark, sig):
    """`demo` also starts the example env server and model stand-in, which stop with the rest."""
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "demo", "--run-dir", str(run_dir),
                             "--workers", "1", "--concurrency", "2", "--shutdown-grace", "1"], env=clean_env(mark),
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sighup_as_from_a_terminal)
    try:
        wait_for(lambda: steps_recorded(run_dir), 90, what="steps recorded")
        running = marked(mark, run_dir)
        servers = [p for p in running if "examples." in " ".join(p.cmdline())]
        assert len(servers) == 2, describe(running)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if sig == signal.SIGKILL:
        assert_none_left(mark, run_dir, 60, "processes of a SIGKILLed demo")
    else:
        assert proc.returncode == 128 + sig, out[-3000:]
        assert "left unfinished:" in out, out[-3000:]
        assert_none_left(mark, run_dir, 5, "processes of a demo stopped by SIGTERM")


def test_a_child_started_from_another_thread_outlives_that_thread_and_stops_with_its_parent(settings, tmp_path,
                                                                                         mark):
    """The kernel's parent-death signal follows the thread that forked, so a child started from
    any other thread does without it (it would stop when that thread ends) and relies on its own
    watch of its parent, the portable half of the mechanism."""
    script = textwrap.dedent("""\
        import threading, time
        from interactor.children import role_command, spawn
        box = []
        t = threading.Thread(target=lambda: box.append(spawn(role_command("consumer", "c-thread"))))
        t.start()
        t.join()
        print(box[0].pid, flush=True)
        time.sleep(600)
        """)
    env = {**clean_env(mark), **settings.as_environ()}
    log_path = tmp_path / "parent.log"
    with open(log_path, "ab") as log:
        parent = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=str(tmp_path),
                                  stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        wait_for(lambda: "reading" in log_path.read_text(errors="replace"), 60, what="the consumer started")
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE  # the thread ended long ago
        parent.kill()
        parent.wait(10)
        # The watch looks once a second; the consumer then drains and stops.
        wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 30,
                 what="the consumer stopped after its parent was killed")
        assert "consumer c-thread stopped" in log_path.read_text(errors="replace")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_worker_supervisor_stops_on_sighup_with_a_warm_shutdown(settings, tmp_path, mark):
    """SIGHUP (a closed terminal) stops `interactor worker` like SIGTERM: one SIGTERM to its
    Celery process (whose own SIGHUP would restart it), a warm shutdown, exit 0."""
    log_path = tmp_path / "worker.log"
    env = {**clean_env(mark), **settings.as_environ()}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "worker", "--name", "w-hup@%h"], env=env,
                                cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_sighup_as_from_a_terminal)
    try:
        wait_for(lambda: "ready." in log_path.read_text(errors="replace"), 90, what="the worker ready")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text(errors="replace")
    assert "Warm shutdown" in text and "Restarting" not in text, text[-3000:]
    assert_none_left(mark, tmp_path, 5, "processes of a worker stopped by SIGHUP")


def _ignore_sighup() -> None:
    """preexec_fn: what `nohup` does."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_worker_under_nohup_outlives_sighup_and_stops_on_sigterm(settings, tmp_path, mark):
    """A command started with SIGHUP ignored (`nohup`) is meant to outlive its terminal: the
    SIGHUP handling leaves it alone."""
    log_path = tmp_path / "worker.log"
    env = {**clean_env(mark), **settings.as_environ()}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "worker", "--name", "w-nohup@%h"],
                                env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_ignore_sighup)
    try:
        wait_for(lambda: "ready." in log_path.read_text(errors="replace"), 90, what="the worker ready")
        proc.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(3)
        assert "Warm shutdown" not in log_path.read_text(errors="replace")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert_none_left(mark, tmp_path, 5, "processes of a worker stopped by SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_worker_supervisor_killed_its_celery_process_shuts_down_warm(settings, tmp_path, mark):
    """SIGKILL to `interactor worker`: its Celery process gets SIGTERM, a warm shutdown (it hands
    its episodes back), not a SIGKILL of its own."""
    log_path = tmp_path / "worker.log"
    env = {**clean_env(mark), **settings.as_environ()}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "worker", "--name", "w-kill@%h"], env=env,
                                cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "ready." in log_path.read_text(errors="replace"), 90, what="the worker ready")
        proc.kill()
        proc.wait(10)
        assert_none_left(mark, tmp_path, 60, "the Celery process of a SIGKILLed worker supervisor")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "Warm shutdown" in log_path.read_text(errors="replace")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_autoscaler_stopped_by_a_signal_leaves_no_worker(settings, tmp_path, mark, sig):
    log_dir = tmp_path / "logs"
    env = {**clean_env(mark), **settings.as_environ()}
    proc = subprocess.Popen([sys.executable, "-m", "interactor.cli", "autoscale", "--min", "1", "--max", "1",
                             "--interval", "0.5", "--log-dir", str(log_dir), "--name", "as-kill"], env=env,
                            cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_sighup_as_from_a_terminal)
    try:
        wait_for(lambda: any("ready." in p.read_text(errors="replace") for p in log_dir.glob("*.log")), 90,
                 what="the autoscaler's worker ready")
        assert len(marked(mark, tmp_path)) >= 3  # the autoscaler, a worker's supervisor and its Celery process
        proc.send_signal(sig)
        code = proc.wait(60)
        if sig == signal.SIGHUP:  # it warm-stopped its workers and waited for them
            assert code == 0
            assert_none_left(mark, tmp_path, 5, "workers of an autoscaler stopped by SIGHUP")
        else:
            assert_none_left(mark, tmp_path, 60, "workers of a SIGKILLed autoscaler")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_worker_whose_redis_is_gone_still_ends_its_shutdown(settings, procs, env_server, tmp_path):
    """The run that started a worker was killed and its Redis with it, while episodes ran: the
    worker's Celery process gets SIGTERM from its dying supervisor, and handing its episodes back
    waits for Redis through the outage budget (15 minutes by default). It lived on as an orphan
    that long; now the kernel ends it at grace + INTERACTOR_SHUTDOWN_HARD_EXIT_S."""
    import redis

    from broker.embedded import EmbeddedRedis
    from broker.keys import Keys
    from examples.model_standin import start_in_thread
    from producer.enqueue import submit

    _, env_url = env_server
    model, model_url = start_in_thread(latency_ms=3000)
    own = EmbeddedRedis(tmp_path / "redis").start()
    try:
        s = settings.replace(redis_url=own.url, llm_base_url=model_url + "/v1", shutdown_grace_s=2,
                             shutdown_hard_exit_s=4, outage_budget_s=600)
        procs.settings = s
        sup = procs.worker("w1")
        wait_for(lambda: " ready." in procs.log("w1"), 120, what="the worker ready")
        (celery,) = psutil.Process(sup.pid).children()
        tasks = tmp_path / "t.yaml"
        tasks.write_text(f"environments:\n  - env_name: guess_number\n    base_url: {env_url}\n    env_num: 4\n")
        client = redis.Redis.from_url(own.url)
        submit(client, s, [str(tasks)])
        wait_for(lambda: client.zcard(Keys(s.key_prefix).running) >= 4, 60, what="4 episodes running")
        client.close()
        sup.kill()  # the supervisor dies without a word: its child gets SIGTERM ...
        sup.wait(10)
        own.stop()  # ... and the run's Redis is gone for good
        gone, alive = psutil.wait_procs([celery], timeout=60)
        for p in alive:  # not left running for whoever uses this machine next
            p.kill()
        assert gone, f"the worker's Celery process {celery.pid} outlived its Redis and its supervisor"
    finally:
        own.stop()
        model.shutdown()
