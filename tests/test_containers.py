"""The compose fleet on a real Docker engine (``make test-containers``).

tests/dockerhost.py starts a dockerd of our own and makes the base images from Debian's
packages; here our image is built from the real ``Dockerfile`` and ``docker-compose.yml`` is
run by Debian's docker-compose 1.29, with tests/containers/compose.test.yml on top (a slower
model stand-in, 4 episodes per worker, short leases). The scenarios share one fleet and run in
order; each submits its own job from a container and counts outcomes in the PostgreSQL store:
every episode completed exactly once (one completed attempt, one trajectory, no step twice),
none dead-lettered.

Skipped unless INTERACTOR_TEST_CONTAINERS=1 (the Makefile target sets it): a cold run installs
packages, debootstraps Debian and builds images for several minutes.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import uuid

import pytest

from tests import dockerhost
from tests.dockerhost import COMPOSE, HERE, ROOT, Engine, Unavailable, log, run

pytestmark = [
    pytest.mark.containers,
    pytest.mark.skipif(os.environ.get("INTERACTOR_TEST_CONTAINERS") != "1",
                       reason="builds images and runs a Docker engine: make test-containers"),
]

EPISODES = 48  # tests/containers/tasks.yaml
# The services a scenario needs by name: naming them keeps flower (no image here) and the
# profiles' other services down.
FLEET = ["redis", "postgres", "env", "model", "consumer", "worker", "metrics"]


class Fleet:
    def __init__(self, engine: Engine, project: str):
        self.engine = engine
        self.project = project
        self.env = dict(engine.env,
                        COMPOSE_PROJECT_NAME=project,
                        REDIS_PASSWORD=secrets.token_hex(16),
                        POSTGRES_PASSWORD=secrets.token_hex(16),
                        REDIS_IMAGE=dockerhost.REDIS_IMAGE,
                        POSTGRES_IMAGE=dockerhost.POSTGRES_IMAGE,
                        INTERACTOR_IMAGE=dockerhost.IMAGE,
                        COMPOSE_PROFILES="demo")

    def compose(self, *args: str, check: bool = True, timeout: float = 600):
        return run([COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "compose.test.yml"),
                    *args], env=self.env, check=check, timeout=timeout, cwd=ROOT)

    def containers(self, service: str) -> list[str]:
        out = self.engine.docker("ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                                 "--filter", f"label=com.docker.compose.service={service}").stdout
        return out.split()

    def health(self, cid: str) -> str:
        return self.engine.docker("inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}",
                                  cid, check=False).stdout.strip()

    def wait_healthy(self, services: list[str], timeout: float = 180) -> None:
        """The compose file's own health checks decide when a service is ready."""
        deadline = time.monotonic() + timeout
        while True:
            states = {s: [self.health(c) for c in self.containers(s)] for s in services}
            if all(v and all(h == "healthy" for h in v) for v in states.values()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"not healthy after {timeout} s: {states}\n{self.logs()}")
            time.sleep(1)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", *services, check=False).stdout[-6000:]

    def up(self, *services: str, scale: dict | None = None) -> None:
        flags = [f"--scale={k}={v}" for k, v in (scale or {}).items()]
        self.compose("up", "-d", "--no-build", *flags, *services)

    def submit(self) -> str:
        """From the producer's container, the test's task file mounted where it reads tasks."""
        r = self.compose("run", "--rm", "-T", "-v", f"{HERE}:/tests:ro", "producer",
                         "interactor", "submit", "/tests/tasks.yaml")
        job = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
        assert job["episodes"] == EPISODES
        return job["job_id"]

    def psql(self, sql: str) -> list[list[str]]:
        out = self.compose("exec", "-T", "postgres", "psql", "-U", "interactor", "-d", "interactor",
                           "-AtF", "\t", "-c", sql).stdout
        return [line.split("\t") for line in out.splitlines() if line]

    def stored(self, job: str) -> dict[str, int]:
        try:
            return {s: int(n) for s, n in self.psql(
                f"SELECT status, COUNT(*) FROM episodes WHERE job_id = '{job}' GROUP BY status")}
        except RuntimeError:  # the consumers have not made the tables yet
            return {}

    def wait_stored(self, job: str, n: int, timeout: float = 300) -> dict[str, int]:
        """Until ``n`` episodes are finished in the store (an episode's row exists from its
        first step on, as 'running')."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.stored(job)
            if got.get("completed", 0) + got.get("failed", 0) >= n:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"job {job}: {got} after {timeout} s\n{self.logs('worker', 'consumer')}")
            time.sleep(1)

    def wait_until(self, what: str, predicate, timeout: float = 120, every: float = 0.5):
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not after {timeout} s\n{self.logs()}")
            time.sleep(every)

    def assert_exactly_once(self, job: str, *, extra_completed_attempts_ok: bool = False) -> list[str]:
        """Every episode completed once, in the store; returns the workers that completed them.

        ``extra_completed_attempts_ok``: an attempt that ran to its end while the episode was
        re-run elsewhere (Redis away past the lease) may be recorded as an attempt too; the
        episode still has one completed attempt and one trajectory, which is checked."""
        assert self.stored(job) == {"completed": EPISODES}
        # One completed attempt per episode, and it is the episode's: its own trajectory, or its
        # predecessor's that it continued (a resumed episode's steps stay under the trajectory
        # they began in, which is what completed_attempt_id names: attempt_resumes says whose).
        rows = self.psql(f"SELECT e.episode_id, COUNT(a.attempt_id), MIN(a.worker) FROM episodes e "
                         f"JOIN attempts a ON a.episode_id = e.episode_id AND a.status = 'completed' "
                         f"LEFT JOIN attempt_resumes r ON r.episode_id = a.episode_id AND r.attempt_id = a.attempt_id "
                         f"WHERE e.job_id = '{job}' AND (a.attempt_id = e.completed_attempt_id "
                         f"OR r.trajectory LIKE '%:' || e.completed_attempt_id) GROUP BY e.episode_id")
        assert len(rows) == EPISODES and all(r[1] == "1" for r in rows), rows
        completed_attempts = int(self.psql(f"SELECT COUNT(*) FROM attempts WHERE job_id = '{job}' AND status = 'completed'")[0][0])
        if extra_completed_attempts_ok:
            if completed_attempts != EPISODES:
                log(f"job {job}: {completed_attempts - EPISODES} attempts also ran to their end beside the stored one")
        else:
            assert completed_attempts == EPISODES
        # One trajectory per episode: only the completed attempt's steps, none twice.
        assert self.psql(f"SELECT COUNT(*) FROM session_steps s JOIN episodes e ON e.episode_id = s.session_id "
                         f"WHERE e.job_id = '{job}' AND s.attempt_id <> e.completed_attempt_id") == [["0"]]
        assert self.psql(f"SELECT COUNT(*) FROM (SELECT session_id, step_id FROM session_steps WHERE job_id = '{job}' "
                         f"GROUP BY session_id, step_id HAVING COUNT(*) > 1) d") == [["0"]]
        assert self.psql(f"SELECT SUM(steps) FROM episodes WHERE job_id = '{job}'") == \
            self.psql(f"SELECT COUNT(*) FROM session_steps WHERE job_id = '{job}'")
        # Nothing dead-lettered.
        dlq = self.interactor("dlq", "list", "--job", job, "--json")
        assert json.loads(dlq) in ([], {}) or not json.loads(dlq), dlq
        return [r[2] for r in rows]

    def interactor(self, *args: str, service: str = "metrics") -> str:
        return self.compose("exec", "-T", service, "interactor", *args).stdout

    def running(self, job: str) -> int:
        snap = json.loads(self.interactor("status", job, "--json"))
        return _find_int(snap, "running")


def _find_int(obj, key: str) -> int:
    """The first integer under ``key`` in a nested JSON snapshot."""
    if isinstance(obj, dict):
        if isinstance(obj.get(key), int):
            return obj[key]
        for v in obj.values():
            got = _find_int(v, key)
            if got >= 0:
                return got
    if isinstance(obj, list):
        for v in obj:
            got = _find_int(v, key)
            if got >= 0:
                return got
    return -1


def hosts(workers: list[str]) -> set[str]:
    """Worker names are HOSTNAME-PID; a container's hostname is its id."""
    return {w.rsplit("-", 1)[0] for w in workers}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    t0 = time.monotonic()
    try:
        dockerhost.ensure_packages()
    except Unavailable as exc:
        pytest.skip(str(exc))
    workdir = tmp_path_factory.mktemp("docker")
    eng = Engine(workdir)
    try:
        try:
            eng.start()
        except Unavailable as exc:
            pytest.skip(f"no Docker engine can be started here: {exc}")
        eng.base_images()
        t1 = time.monotonic()
        eng.build(dockerhost.IMAGE, ROOT / "Dockerfile", ROOT, "--build-arg",
                  f"BASE_IMAGE={dockerhost.PYTHON_IMAGE}", *dockerhost.pip_build_secrets(workdir))
        log(f"base images {t1 - t0:.0f} s, interactor image {time.monotonic() - t1:.0f} s")
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def fleet(engine):
    f = Fleet(engine, "ixt" + uuid.uuid4().hex[:8])
    try:
        yield f
    finally:
        f.compose("down", "-v", "--remove-orphans", "-t", "10", check=False)


# --- the image ------------------------------------------------------------------------------
def test_image_runs_non_root_without_a_compiler(engine):
    t0 = time.monotonic()
    out = engine.docker("run", "--rm", dockerhost.IMAGE, "interactor", "--help").stdout
    start_s = time.monotonic() - t0
    assert "worker" in out and "submit" in out
    assert engine.docker("run", "--rm", dockerhost.IMAGE, "id", "-u", stderr_apart=True).stdout.strip() == "10001"
    found = engine.docker("run", "--rm", dockerhost.IMAGE, "sh", "-c",
                          "command -v gcc cc g++ c++ make || true", stderr_apart=True).stdout.strip()
    assert found == "", f"a compiler in the final stage: {found}"
    size = int(engine.docker("image", "inspect", "-f", "{{.Size}}", dockerhost.IMAGE).stdout)
    log(f"image {dockerhost.IMAGE}: {size / 1e6:.0f} MB; `interactor --help` in a new container: {start_s:.1f} s")


# --- 1. up, submit from a container, scale 1 -> 4 mid-run ------------------------------------
def test_1_scale_up_mid_run(fleet):
    fleet.up(*FLEET, scale={"worker": 1})
    fleet.wait_healthy(["redis", "postgres", "env", "model"])
    assert len(fleet.containers("consumer")) == 2, "the compose file's two consumers"
    job = fleet.submit()
    fleet.wait_until("episodes running on the first worker", lambda: fleet.running(job) > 0)
    fleet.up("worker", scale={"worker": 4})
    assert len(fleet.containers("worker")) == 4
    fleet.wait_stored(job, EPISODES)
    workers = fleet.assert_exactly_once(job)
    spread = hosts(workers)
    log(f"scenario 1: {EPISODES} episodes completed once, by {len(spread)} worker containers")
    assert len(spread) >= 2, f"all episodes ran in {spread}"


# --- 2. SIGKILL a worker container mid-episode ----------------------------------------------
def test_2_sigkill_worker_mid_episode(fleet):
    fleet.up("worker", scale={"worker": 2})
    job = fleet.submit()
    fleet.wait_until("episodes running", lambda: fleet.running(job) >= 4)
    victim = fleet.containers("worker")[0]
    fleet.engine.docker("kill", "--signal", "KILL", victim)
    fleet.wait_stored(job, EPISODES)
    fleet.assert_exactly_once(job)
    rerun = fleet.psql(f"SELECT COUNT(*) FROM episodes WHERE job_id = '{job}' AND attempts > 1")
    log(f"scenario 2: killed {victim[:12]}; episodes re-run: {rerun[0][0]}; all stored once")
    # restart: unless-stopped brings the container back; the job did not wait for it.


# --- 3. docker-compose stop worker: SIGTERM, warm shutdown ----------------------------------
def test_3_sigterm_workers_hand_back_or_finish(fleet):
    fleet.up("worker", scale={"worker": 2})
    job = fleet.submit()
    fleet.wait_until("episodes running", lambda: fleet.running(job) >= 4)
    fleet.compose("stop", "-t", "120", "worker", timeout=300)
    done_at_stop = sum(fleet.stored(job).values())
    assert not fleet.containers("worker")
    for cid in fleet.engine.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={fleet.project}",
                                   "--filter", "label=com.docker.compose.service=worker").stdout.split():
        code = fleet.engine.docker("inspect", "-f", "{{.State.ExitCode}}", cid).stdout.strip()
        assert code == "0", f"worker {cid[:12]} exited {code}: not a warm shutdown"
    # Nothing lost: new workers finish the rest, and nothing is stored twice or dead-lettered.
    fleet.up("worker", scale={"worker": 2})
    fleet.wait_stored(job, EPISODES)
    fleet.assert_exactly_once(job)
    log(f"scenario 3: {done_at_stop} stored when the workers had stopped, the rest after; all once")


# --- 4. restart Redis mid-run (append-only file on its volume) -------------------------------
def test_4_redis_restart_mid_run(fleet):
    fleet.up("worker", scale={"worker": 2})
    job = fleet.submit()
    fleet.wait_until("episodes running", lambda: fleet.running(job) >= 4)
    fleet.compose("restart", "-t", "30", "redis")
    fleet.wait_healthy(["redis"])
    fleet.wait_stored(job, EPISODES, timeout=600)
    fleet.assert_exactly_once(job, extra_completed_attempts_ok=True)
    log("scenario 4: Redis restarted mid-run; all stored once")


# --- 6. status and the metrics endpoint from their containers --------------------------------
def test_6_status_and_metrics_from_containers(fleet):
    out = fleet.interactor("status")
    assert "queue" in out and "episodes" in out, out
    # From another container of the project, over the project's network.
    text = fleet.compose("exec", "-T", "consumer", "python", "-c",
                         "import urllib.request; print(urllib.request.urlopen('http://metrics:9400/metrics', timeout=10).read().decode())"
                         ).stdout
    assert re.search(r"^interactor_redis_up 1\.0$", text, re.M), text[:2000]
    done = [float(v) for v in re.findall(r'^interactor_episodes\{state="done"\} (\S+)$', text, re.M)]
    assert done and done[0] >= EPISODES, text[:2000]
    # Every job is done: nothing in flight, though scenario 2's SIGKILLed worker left its
    # deliveries in kombu's unacked hash (they stay there until the visibility timeout).
    inflight = re.findall(r'^interactor_queue_inflight\{queue="[^"]*"\} (\S+)$', text, re.M)
    assert inflight and all(float(v) == 0 for v in inflight), inflight
    assert "inflight=" not in out or re.search(r"inflight=[1-9]", out) is None, out
    unacked = fleet.compose("exec", "-T", "redis", "sh", "-c",
                            'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli --no-auth-warning hlen unacked').stdout.strip()
    log(f"scenario 6: status and /metrics answer; inflight 0 with {unacked} stale deliveries in kombu's unacked hash")


# --- 5. the autoscale profile follows the queue up and back to the minimum -------------------
def test_5_autoscaler_follows_queue_depth(fleet):
    # The idle workers go first, with a bounded grace (the file's is 1920 s): one run saw
    # `up --scale worker=0` wait past 10 minutes; a worker that does not end its warm shutdown
    # in 120 s is killed and fails the check below instead of hanging the suite.
    # Only the workers running now: a container an earlier scenario SIGKILLed stays listed by
    # `ps -a` with its 137.
    running = fleet.containers("worker")
    assert running, "idle workers to stop"
    fleet.compose("stop", "-t", "120", "worker", timeout=300)
    for cid in running:
        code = fleet.engine.docker("inspect", "-f", "{{.State.ExitCode}}", cid).stdout.strip()
        if code != "0":
            tail = fleet.engine.docker("logs", "--tail", "60", cid, check=False)
            pytest.fail(f"idle worker {cid[:12]} exited {code}: its warm shutdown did not end in 120 s\n"
                        f"{(tail.stdout or '')[-4000:]}{(tail.stderr or '')[-4000:]}")
    fleet.up("worker", scale={"worker": 0})
    assert not fleet.containers("worker")
    fleet.up("autoscaler")

    def serving() -> int:
        text = fleet.compose("exec", "-T", "autoscaler", "python", "-c",
                             "import urllib.request; print(urllib.request.urlopen("
                             "'http://127.0.0.1:9401/metrics', timeout=5).read().decode())", check=False).stdout
        m = re.search(r'^interactor_autoscaler_workers\{state="serving"\} (\S+)$', text, re.M)
        return int(float(m.group(1))) if m else -1

    fleet.wait_until("the autoscaler at its minimum (0) before the job", lambda: serving() == 0, timeout=120, every=2)
    job = fleet.submit()
    peak = fleet.wait_until("the autoscaler at its maximum (3)", lambda: (n := serving()) >= 3 and n, timeout=120, every=1)
    fleet.wait_stored(job, EPISODES)
    fleet.assert_exactly_once(job)
    # Back to the minimum once the queue is empty and the cooldown (10 s) has passed, though an
    # earlier scenario's SIGKILLed worker left deliveries in kombu's unacked hash.
    fleet.wait_until("the autoscaler back at its minimum (0)", lambda: serving() == 0, timeout=180, every=2)
    log(f"scenario 5: autoscaler 0 -> {peak} -> 0 workers; all stored once")
    fleet.compose("stop", "-t", "60", "autoscaler", timeout=300)
