"""``interactor run``: the whole system on one machine, for one job.

Starts an embedded Redis unless ``REDIS_URL`` is set, enqueues the job, runs local worker
processes and a consumer, shows progress, and prints the summary. The children run in their
own sessions so that Ctrl-C reaches only us; we then stop them in order (workers hand back
what they run, the consumer commits what it holds) and say what was left. SIGTERM and SIGHUP
do the same as Ctrl-C; if we are killed outright, the children notice (interactor/children.py)
and a guard process stops them in the same order, the embedded Redis last.

A job cancelled meanwhile (``interactor cancel``, broker/cancel.py) ends the run as a finished
one does (exit 1: not every episode completed); ``run --resume`` of a cancelled job is refused.
A job its budget stopped (broker/job_budgets.py) says so and exits 4 (``EXIT_BUDGET``).

A job that pauses itself (broker/pause.py: its episodes kept failing alike) ends the run too,
with exit 3 (``EXIT_PAUSED``) and the command that resumes it: a CI or batch job then fails at
once instead of waiting for its wall-clock limit. ``--wait-when-paused`` waits instead, for an
``interactor resume`` from another terminal. ``run --resume JOB`` may correct the job's own
settings (``--model``, ``--max-tokens``, ...: interactor/job_corrections.py), saying what changed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

import redis

from broker.job_budgets import read_usage
from broker.cancel import JobCancel, JobCancelled
from broker.embedded import EmbeddedRedis
from broker.keys import Keys
from broker.ledger import Ledger
from broker.pause import JobPause, resume_job
from broker.redisconn import connect
from broker.settings import Settings, redact_url
from broker.states import LEDGER_FINAL, LedgerState, StoredStatus
from interactor.children import Guard, exit_code, interrupt_on_signals, spawn, spawn_role, terminate
from interactor.report import print_left, print_results, progress_line

EXIT_PAUSED = 3  # `interactor run` ended because its job paused itself
EXIT_BUDGET = 4  # its job reached --max-tokens-total or --budget-usd and was stopped


def default_workers(concurrency: int) -> int:
    """Local worker processes for ``concurrency`` episodes: one per core (the benchmark's best on
    two cores, docs/benchmarks.md), never more than there are episodes to run at once."""
    return max(1, min(os.cpu_count() or 1, concurrency))


# The order a guard stops a run's children in when `interactor run` died without doing it:
# as LocalFleet.stop does, workers first, then the consumer, and what they all need (the
# embedded Redis, the demo's servers) last.
STAGE_WORKERS, STAGE_CONSUMER, STAGE_LAST = 0, 1, 2


def start_guard(settings: Settings, log_dir: Path) -> Guard:
    return Guard({STAGE_WORKERS: settings.shutdown_grace_s + 10, STAGE_CONSUMER: 30, STAGE_LAST: 10},
                 log_path=log_dir / "guard.log")


class LocalFleet:
    """Worker and consumer child processes, restarted if one dies unexpectedly."""

    def __init__(self, settings: Settings, workers: int | None, log_dir: Path, guard: Guard | None = None,
                 queues: Iterable[str] = ()):
        # The workers serve every queue the job's episodes name (a task entry's `queue:`) besides
        # the configured ones: no episode of a local run waits for a worker that never comes.
        settings = settings.replace(queues=",".join(dict.fromkeys([*settings.served_queues, *sorted(queues)])))
        self.settings = settings
        self.guard = guard
        self.n_workers = max(1, workers or default_workers(settings.concurrency))
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        per_worker = max(1, -(-settings.concurrency // self.n_workers))
        self.env = {**os.environ, **settings.replace(concurrency=per_worker).as_environ(), "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = 0

    def _spawn(self, name: str) -> None:
        role = "consumer" if name == "consumer" else "worker"
        old = self.procs.get(name)
        self.procs[name] = spawn_role(role, name, env=self.env, log_path=self.log_dir / f"{name}.log")
        if self.guard is not None:
            if old is not None:
                self.guard.drop(old)
            self.guard.add(self.procs[name], STAGE_CONSUMER if role == "consumer" else STAGE_WORKERS)

    def start(self) -> None:
        self._spawn("consumer")
        for i in range(self.n_workers):
            self._spawn(f"worker{i + 1}")

    def supervise(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.restarts += 1
                print(f"\n{name} exited with {proc.returncode}; restarting (see {self.log_dir / (name + '.log')})")
                self._spawn(name)

    def stop(self, grace_s: float) -> None:
        # Workers first (they hand back or finish episodes), then the consumer drains.
        terminate([p for n, p in self.procs.items() if n != "consumer"], grace_s)
        terminate([p for n, p in self.procs.items() if n == "consumer"], 30)



def run_local(settings: Settings, tasks: list[str], *, workers: int | None = None, job_id: str | None = None,
              resume: str | None = None, ui: tuple[str, int] | None = None, guard: Guard | None = None,
              preflight: bool = True, wait_when_paused: bool = False, corrections: dict | None = None) -> int:
    """Run one job to its end on this machine. ``ui``: (host, port) of a results browser to
    serve meanwhile, and after the summary until Ctrl-C (with Redis still up, so that dead
    letters can be read; read-only, nothing is re-driven with the workers gone). ``guard``:
    the caller's (``demo``), else we start our own.

    Ctrl-C, SIGTERM and SIGHUP stop the run alike; the exit code is 128 + the signal's number
    (130, 143, 129). ``preflight``: ask the model endpoint and env servers before anything is
    enqueued (interactor/preflight.py), and refuse with exit 2 when one does not answer.
    ``wait_when_paused``: a job that pauses itself keeps the run waiting instead of ending it
    (exit 3). ``corrections``: job settings a resume replaces (interactor/job_corrections.py)."""
    with interrupt_on_signals():
        own_guard = guard is None
        if own_guard:
            guard = start_guard(settings, Path(settings.run_dir) / "logs")
        done = False
        try:
            code = _run_local(settings, tasks, workers, job_id, resume, ui, guard, preflight, wait_when_paused,
                              corrections or {})
            done = True
            return code
        finally:
            if own_guard:
                guard.close(done=done)


def _run_local(settings: Settings, tasks: list[str], workers: int | None, job_id: str | None, resume: str | None,
               ui: tuple[str, int] | None, guard: Guard, preflight: bool = True, wait_when_paused: bool = False,
               corrections: dict | None = None) -> int:
    from consumer.storage import open_store
    from producer.enqueue import new_job_id, plan, submit_plan

    run_dir = Path(settings.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job_id = resume or job_id or new_job_id()
    planned = None if resume else plan(settings, tasks, job_id)  # a bad file stops us before anything starts
    if planned is not None and preflight:
        from interactor.preflight import gate

        if not gate(settings, planned.episodes, summary_to=sys.stdout):
            return 2

    embedded = None
    fleet: LocalFleet | None = None
    browser = None
    interrupted: KeyboardInterrupt | None = None
    t0 = time.monotonic()
    try:
        if not settings.redis_url:
            embedded = _start_embedded_redis(run_dir, guard)
            if embedded is None:
                return 2
            settings = settings.replace(redis_url=embedded.url)
            print(f"embedded Redis on 127.0.0.1:{embedded.port} (data in {run_dir / 'redis'})")
        else:
            print(f"Redis at {redact_url(settings.redis_url)}")
        client = connect(settings)
        ledger = Ledger.for_settings(client, settings)
        job_queues = {e.queue for e in planned.episodes if e.queue} if planned is not None else ledger.job_queues(job_id)
        fleet = LocalFleet(settings, workers, run_dir / "logs", guard, queues=job_queues)
        store = open_store(settings.results_store)
        if ui is not None:  # first: a port in use stops us before anything is enqueued or started
            browser = _start_browser(settings, client, *ui)
            print(f"results browser on {browser.url}", flush=True)
        if planned is not None:
            sub = submit_plan(client, settings, planned)
            print(f"job {job_id}: {sub.job.episodes} episodes in {sub.job.groups} groups enqueued "
                  f"in {sub.enqueue_s:.2f}s")
            total = sub.job.episodes
        else:
            total = _resume_job(client, settings, ledger, job_id, corrections, preflight)
            if total is None:
                return 2
        fleet.start()
        paused = None
        try:
            paused = _wait(job_id, total, ledger, store, fleet, t0, wait_when_paused)
        except KeyboardInterrupt as exc:
            interrupted = exc
            _say(f"\n{_how(exc)}: stopping workers (up to {settings.shutdown_grace_s:.0f}s for running episodes; "
                 "Ctrl-C again to kill)")
        if paused is not None:
            _say(f"\njob {job_id} {paused.describe()}: stopping workers (--wait-when-paused waits instead)")
        try:
            fleet.stop(settings.shutdown_grace_s + 10)
        except KeyboardInterrupt:
            fleet.stop(0)
        results = store.results(job_id)
        results["scores"] = store.score_summary(job_id)
        store.close()
        if interrupted is not None:
            # A closed terminal (SIGHUP) leaves nowhere to print: the stop above has been done,
            # and the report is for whoever still reads.
            with contextlib.suppress(OSError):
                print()
                print_results(job_id, results, settings.results_store_shown)
                print_left(ledger.counts(job_id), job_id, run_dir)
            return exit_code(interrupted)
        if paused is not None:
            print()
            print_results(job_id, results, settings.results_store_shown)
            print_paused(job_id, run_dir, ledger.counts(job_id))
            return EXIT_PAUSED
        print()
        print_results(job_id, results, settings.results_store_shown)
        stopped = read_usage(client, Keys(settings.key_prefix), job_id).stop
        if stopped:
            print(f"stopped: {stopped}; what completed is kept, the rest was cancelled")
        if fleet.restarts:
            print(f"note: {fleet.restarts} local processes were restarted; see {run_dir / 'logs'}")
        if browser is not None:
            _keep_serving(browser)
        # 1: not every episode completed (some failed, or the job was cancelled meanwhile)
        unfinished = results["job"].get(StoredStatus.FAILED, 0) + results["job"].get(StoredStatus.CANCELLED, 0)
        return EXIT_BUDGET if stopped else 0 if unfinished == 0 else 1
    finally:
        if fleet is not None and fleet.procs:
            fleet.stop(5)
        if browser is not None:
            browser.stop()
        if embedded:
            embedded.stop()


def _start_embedded_redis(run_dir: Path, guard: Guard) -> EmbeddedRedis | None:
    """The run folder's own Redis, started (None, said why: another command holds it)."""
    from interactor.stopped_run import held_by_command

    holder = held_by_command(run_dir / "redis")
    if holder is not None:  # two servers on one folder's files would ruin them
        print(f"interactor: the Redis of {run_dir}/ is held by another command (pid {holder}) that started it "
              "to read a stopped run; run again once it ends", file=sys.stderr)
        return None
    embedded = EmbeddedRedis(run_dir / "redis", port=None, password=_persistent_password(run_dir))
    try:
        embedded.start()
        guard.add(embedded.proc, STAGE_LAST)
    except BaseException:  # not started, or interrupted while starting: not left running
        embedded.stop(kill=True)
        raise
    return embedded


def _resume_job(client, settings: Settings, ledger: Ledger, job_id: str, corrections: dict | None,
                preflight: bool) -> int | None:
    """``run --resume JOB``: the job's corrections applied, its lost episodes sent again and, if
    it paused itself, its parked ones; returns how many episodes it has (None, said why: no such
    job, a cancelled one, or a corrected model that is still wrong)."""
    spec = ledger.job_spec(job_id)
    if spec is None:
        print(f"no job {job_id!r} in this Redis", file=sys.stderr)
        return None
    if JobCancel(client, settings).is_cancelled(job_id):
        print(f"interactor: {JobCancelled(job_id, 'it is not resumed')}", file=sys.stderr)
        return None
    if corrections:
        from interactor.job_corrections import apply_corrections, model_problems

        problems = model_problems(settings, spec, corrections) if preflight else []
        if problems:  # a corrected model that is still wrong: the job is left as it was
            print(f"interactor: run --resume {job_id}: the job's settings were left as they were: "
                  + "; ".join(problems) + " (--no-preflight skips this check)", file=sys.stderr)
            return None
        for line in apply_corrections(client, settings, spec, corrections):
            print(line)
    from broker.recovery import reconcile

    print(f"resuming job {job_id}: re-enqueued {len(reconcile(client, settings, job_id))} lost episodes")
    if JobPause(client, Keys(settings.key_prefix)).is_paused(job_id):  # it paused itself: go on
        print(f"job {job_id} was paused; {len(resume_job(client, settings, job_id))} parked episodes sent again")
    return spec.episodes


def _how(exc: KeyboardInterrupt) -> str:
    signum = getattr(exc, "signum", None)
    return "interrupted" if signum is None else f"interrupted ({signal.Signals(signum).name})"


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        print(text, flush=True)


def print_paused(job_id: str, run_dir: Path, counts: dict) -> None:
    """How to go on with a job that paused itself, once its run stopped."""
    left = ", ".join(f"{v} {k}" for k, v in counts.items() if k not in LEDGER_FINAL and v) or "nothing"
    print(f"job {job_id} paused; left unfinished: {left}. Fix the cause, then:\n"
          f"  interactor run --resume {job_id} --run-dir {run_dir}\n"
          f"with the job's settings corrected there if they were the cause (--model M, --max-tokens N, "
          f"--llm-base-url URL, ...: said what changed); a mistake in the task file is a new job: run the corrected "
          f"file, and end this one with  interactor cancel {job_id} --run-dir {run_dir}")


def _wait(job_id: str, total: int, ledger: Ledger, store, fleet: LocalFleet, t0: float,
          wait_when_paused: bool = False):
    """Until the job ends (None), or pauses itself (its ``PauseState``, unless ``wait_when_paused``)."""
    from interactor.fleet_reader import FleetReader

    breakers = BreakerNotes(FleetReader(ledger.r, fleet.settings))
    pauses = PauseNotes(JobPause(ledger.r, Keys(fleet.settings.key_prefix)), job_id, waits=wait_when_paused)
    failures = FailureNotes(store, job_id)
    attempts = RunningAttempts(ledger.r, fleet.settings)
    rate = StepRate()
    tty = sys.stdout.isatty()
    last_print = 0.0
    away_since: float | None = None  # Redis unreachable (restarting, failing over) since: the workers wait it out too
    while True:
        time.sleep(0.5)
        fleet.supervise()
        try:
            counts = ledger.counts(job_id)
            running, stalled = attempts.count(job_id) if counts[LedgerState.RUNNING] else (0, 0)
        except (redis.RedisError, OSError) as exc:
            if away_since is None:
                away_since = time.monotonic()
                _say(("\n" if tty else "") + f"Redis unreachable ({type(exc).__name__}); waiting for it")
            continue
        if away_since is not None:
            _say(("\n" if tty else "") + f"Redis back after {time.monotonic() - away_since:.0f}s")
            away_since = None
        res = store.results(job_id)["job"]
        now = time.monotonic()
        line = progress_line({**counts, LedgerState.RUNNING: running}, res, total,
                             rate.update(int(res.get("steps", 0)), now), now - t0, stalled)
        said = breakers.news(now) + pauses.news(now) + failures.news(res)
        if said:  # on lines of their own: a stalled bar says why it is stalled
            print(("\n" if tty else "") + "\n".join(said), flush=True)
        if tty:
            print("\r" + line, end="", flush=True)
        elif now - last_print >= 5:
            print(line, flush=True)
            last_print = now
        # Ended, in the ledger and in the store: completed, failed, or cancelled (broker/cancel.py).
        stored_final = sum(int(res.get(s, 0)) for s in (StoredStatus.COMPLETED, StoredStatus.FAILED,
                                                        StoredStatus.CANCELLED))
        if (sum(counts[s] for s in LEDGER_FINAL) >= total and stored_final >= total
                and not res.get("short_trajectories", 0)):
            print("\r" + line if tty else line)
            return None
        if pauses.paused is not None and not wait_when_paused:
            print("\r" + line if tty else line)
            return pauses.paused


class StepRate:
    """Steps taken per second, over windows of a second or more, from the job's stored steps.
    That count falls when a lost attempt's steps are set aside (they leave the trajectory, the
    episode runs again); a fall is no steps undone, so it is not counted: the rate is never
    negative, and the steps run again count as they are taken."""

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self.taken = 0  # steps taken since the first look
        self.rate = 0.0
        self._stored: int | None = None
        self._mark = (0.0, 0)  # (when, taken) at the start of the current window

    def update(self, stored: int, now: float) -> float:
        if self._stored is None:  # a resumed job's earlier steps were not taken in this run
            self._stored, self._mark = stored, (now, 0)
            return self.rate
        self.taken += max(0, stored - self._stored)
        self._stored = stored
        since, taken = self._mark
        if now - since >= self.window_s:
            self.rate = (self.taken - taken) / (now - since)
            self._mark = (now, self.taken)
        return self.rate


class RunningAttempts:
    """The job's attempts in the ledger's running set, told apart: those alive, and those
    stalled, whose worker is gone or has stopped renewing. A killed worker's attempts stay
    running in the ledger until their leases expire (lease_ttl_s, then the sweeper re-queues
    them), while the worker's replacement already runs others: counted as running they would
    show more attempts than the run's concurrency. Stalled: no lease left, a lease held by a
    process of this machine that is gone (worker names are ``<host>-<pid>``, workers/runner.py),
    or one not renewed for two rounds (``Settings.renewal_interval_s``)."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.keys = Keys(settings.key_prefix)
        self.ttl_ms = int(settings.lease_ttl_s * 1000)
        self.late_ms = int(2 * settings.renewal_interval_s * 1000)
        self.host = socket.gethostname()

    def count(self, job_id: str) -> tuple[int, int]:
        """(running, stalled) of ``job_id``'s attempts."""
        prefix = f"{job_id} ".encode()
        members = self.r.zrange(self.keys.running, 0, -1, withscores=True)  # the fleet's: a run's concurrency
        held = [(m[len(prefix):].decode(), expiry) for m, expiry in members if m.startswith(prefix)]
        if not held:
            return 0, 0
        tokens = self.r.mget([self.keys.lease(episode) for episode, _ in held])
        seconds, micros = self.r.time()
        renewed_after = seconds * 1000 + micros // 1000 + self.ttl_ms - self.late_ms
        stalled = sum(1 for (_, expiry), token in zip(held, tokens)
                      if token is None or expiry < renewed_after or self._holder_gone(token.decode()))
        return len(held) - stalled, stalled

    def _holder_gone(self, token: str) -> bool:
        """Whether the lease's worker (``<worker>:<attempt_id>:<attempt>``) is a process of this
        machine that no longer runs."""
        host, _, pid = token.rsplit(":", 2)[0].rpartition("-")
        return host == self.host and pid.isdigit() and not process_alive(int(pid))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: os.kill found it


class FailureNotes:
    """A job whose episodes all fail, and for one reason (a class off the allow-list, a wrong
    model name, a server refusing every request), said once, early, under the progress bar:
    with the reason and an example, instead of a count of failures that only grows."""

    def __init__(self, store, job_id: str, *, after: int = 3):
        self.store, self.job_id, self.after = store, job_id, after
        self.told = False

    def news(self, job: dict) -> list[str]:
        failed, completed = int(job.get("failed", 0)), int(job.get("completed", 0))
        if self.told or completed or failed < self.after:
            return []
        reasons = self.store.failure_reasons(self.job_id)
        if len(reasons) != 1:
            return []
        self.told = True
        f = reasons[0]
        error = " ".join(str(f["error"] or "").split())[:300]
        return [f"every episode so far failed, all for one reason: {f['reason']} ({f['count']}), e.g. "
                f"{f['episode_id']}: {error}; the others will likely fail alike (Ctrl-C stops the run)"]


class PauseNotes:
    """A job that paused itself (broker/pause.py): ``paused`` holds its state once read. A run
    that waits (``waits``) says so under the progress bar when it pauses and every ``repeat_s``
    after, with how to go on; one that does not stops and says it then (``print_paused``)."""

    def __init__(self, pause, job_id: str, *, every_s: float = 2.0, repeat_s: float = 60.0, waits: bool = True):
        self.pause, self.job_id = pause, job_id
        self.every_s, self.repeat_s = every_s, repeat_s
        self.waits = waits
        self.paused = None
        self._read_at = -1e9
        self._told_at: float | None = None

    def news(self, now: float) -> list[str]:
        if now - self._read_at < self.every_s:
            return []
        self._read_at = now
        try:
            state = self.pause.state(self.job_id)
        except Exception:  # noqa: BLE001 - Redis away: said by the breakers' notes and the workers
            return []
        self.paused = state
        if state is None:
            self._told_at = None
            return []
        if not self.waits or (self._told_at is not None and now - self._told_at < self.repeat_s):
            return []
        self._told_at = now
        return [f"job {self.job_id} {state.describe()}: no new episode starts. Fix the cause, then Ctrl-C and "
                f"`interactor run --resume {self.job_id}` (same --run-dir), or `interactor resume {self.job_id}`"]


class BreakerNotes:
    """What the workers' circuit breakers know, told to whoever watches the progress bar: a
    server that is down (a wrong port, a server not started) otherwise shows only as
    ``0.0 steps/s``. Each open breaker is named when it opens, again every ``repeat_s`` while it
    stays open, and once when it closes."""

    def __init__(self, reader, *, every_s: float = 2.0, repeat_s: float = 30.0):
        self.reader = reader
        self.every_s = every_s
        self.repeat_s = repeat_s
        self._read_at = -1e9
        self._told: dict[tuple[str, str], float] = {}  # open breaker -> when last told

    def news(self, now: float) -> list[str]:
        if now - self._read_at < self.every_s:
            return []
        self._read_at = now
        try:
            open_now = {(b["kind"], b["server"]): b for b in self.reader.breakers()}
        except Exception:  # noqa: BLE001 - Redis away: the workers' own waiting covers it
            return []
        out = []
        budget = self.reader.settings.outage_budget_s
        for key, b in sorted(open_now.items()):
            if now - self._told.get(key, -1e9) >= self.repeat_s:
                self._told[key] = now
                down = time.time() - b["since"] if b.get("since") else 0.0
                out.append(f"{b['kind']} server {b['server']} down {down:.0f}s: {b['error'][:160]}; its episodes "
                           f"wait up to {budget / 60:.0f} min for it")
        for key in [k for k in self._told if k not in open_now]:
            del self._told[key]
            out.append(f"{key[0]} server {key[1]} answers again")
        return out


def _start_browser(settings: Settings, client, host: str, port: int):
    from interactor.ui.server import UIServer, open_source

    return UIServer(open_source(settings, redis_client=client), host, port).start()


def _keep_serving(browser) -> None:
    print(f"\nresults browser still on {browser.url}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print()


def _persistent_password(run_dir: Path) -> str:
    """The embedded Redis keeps its password across restarts of the same run folder."""
    import secrets

    path = run_dir / "redis" / "password"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(secrets.token_hex(16))
        path.chmod(0o600)
    return path.read_text().strip()


def run_demo(settings: Settings, *, workers: int | None = None, ui: tuple[str, int] | None = None) -> int:
    """Start the bundled env server and model stand-in, then run examples/tasks.yaml.

    ``examples`` sits above ``interactor`` (its programs use the command's pieces): the demo
    runs its servers as programs and reads its task file, and imports none of it."""
    folder = Path(__file__).resolve().parent.parent / "examples"
    servers = []
    with interrupt_on_signals():
        guard = start_guard(settings, Path(settings.run_dir) / "logs")
        done = False
        try:
            env_url = _start_server(servers, guard, "examples.envserver", [])
            model_url = _start_server(servers, guard, "examples.model_standin", ["--latency-ms", "50"])
            print(f"example env server at {env_url}, model stand-in at {model_url}/v1 (a stand-in, not a model)")
            settings = settings.replace(env_base_url=env_url, llm_base_url=model_url + "/v1", model="stand-in")
            code = run_local(settings, [str(folder / "tasks.yaml")], workers=workers, ui=ui, guard=guard)
            terminate(servers, 5)
            done = True
            return code
        except KeyboardInterrupt as exc:  # before the run started, or its own stopping cut short
            return exit_code(exc)
        finally:
            if not done:  # and the guard looks at what else may still run
                terminate(servers, 5)
            guard.close(done=done)


def _start_server(servers: list, guard: Guard, module: str, extra: list[str]) -> str:
    # Not stopped with us by the kernel but by the guard, last: the workers need them to end
    # their episodes' steps and close their env instances before they can stop.
    p = spawn([sys.executable, "-m", module, "--port", "0", *extra], stdout=subprocess.PIPE,
              stderr=subprocess.DEVNULL, text=True, with_parent=False)
    servers.append(p)
    guard.add(p, STAGE_LAST)
    line = p.stdout.readline()
    if "listening on" not in line:
        raise RuntimeError(f"{module} did not start: {line!r}")
    return line.split("listening on", 1)[1].strip()
