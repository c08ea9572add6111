"""``interactor``: one command line for every role.

  interactor run TASKS...        everything on this machine (embedded Redis unless REDIS_URL)
  interactor demo                run the bundled example batch against the stand-ins
  interactor submit TASKS...     producer only: validate, record, enqueue; prints the job id
  interactor worker              a Celery worker process
  interactor consumer            the results consumer (and recovery sweeper)
  interactor jobs                the jobs a results store holds, newest first (--json for scripts)
  interactor results JOB         per env, group and job aggregates (--json for scripts)
  interactor compare A B         two jobs side by side: per-env reward, difference, noise, rows
  interactor export JOB          training rows as JSONL or Parquet
  interactor dlq ...             list, show, redrive, purge dead-lettered episodes
  interactor reconcile JOB       re-enqueue episodes that nothing will run again
  interactor resume JOB          continue a job that paused itself (its attempts kept failing alike)
  interactor cancel JOB          stop a job: queued episodes cancelled, running ones stopped, completed kept
  interactor job JOB set|rerun|log   a running job's limits changed, episodes run again, who changed what
  interactor status [JOB]        queue, ledger and stream at a glance
  interactor cache stats|clear   the response cache of jobs run with --cache
  interactor metrics             the fleet's Prometheus metrics
  interactor autoscale           local worker processes, as many as the queue needs
  interactor feed serve          hand each complete group to RL trainers over HTTP
  interactor gateway             route agents that run elsewhere to the workers' model gateways
  interactor ui                  browse results in a web page (jobs, groups, episodes, dead letters)
  interactor serve-env           environment adapters (reasoning-gym, textarena, ...) over HTTP
  interactor serve-model         the bundled model stand-in
  interactor bench               the benchmark harness (from a checkout)

Each command offers the flags it uses (`interactor COMMAND --help`). A setting's flag overrides
its INTERACTOR_* variable; both are listed with its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading

from broker.settings import JOB, REDIS, STORE, WORKER, Settings, SettingsError, redact_url
from interactor.children import catch, exec_program, exit_code, spawn, stop_event, watch_parent
from interactor.common import (LOCAL, LOCAL_HELPS, ArgumentParser, add_command, add_workers_flag,
                               redis_for, settings_from_args, with_local_redis)

log = logging.getLogger("interactor")



# --- roles --------------------------------------------------------------------------------
def cmd_worker(args) -> int:
    settings = settings_from_args(args)
    if not settings.redis_url:
        raise SettingsError("the worker needs REDIS_URL (or --redis-url)")
    os.environ.update(settings.as_environ())  # workers.tasks reads its settings at import
    if os.environ.get(_WORKER_CHILD) != "1":
        return _supervise_worker(sys.argv[1:] if args.argv is None else args.argv, gevent=settings.pool == "gevent")
    _raise_open_files_limit()
    if settings.pool == "gevent":
        # What `celery -P gevent` does first thing; app.worker_main does not, and an unpatched
        # gevent pool blocks its hub on the first socket read: no episode ever starts. The
        # supervisor has the child patch at its very first import (interactor/__init__.py),
        # before ssl is loaded; this covers a worker started as a child by other means.
        from gevent import monkey

        if not monkey.is_module_patched("socket"):
            monkey.patch_all()
    # After gevent's patching, so that the watch is one of its greenlets (see main()).
    watch_parent()
    from workers.tasks import app

    argv = ["worker", "-P", settings.pool, "-c", str(settings.concurrency), "-Q", ",".join(settings.served_queues),
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", args.loglevel]
    if args.name:
        argv += ["-n", args.name]
    app.worker_main(argv)
    return 0


_WORKER_CHILD = "INTERACTOR_WORKER_CHILD"
GEVENT_EARLY = "INTERACTOR_GEVENT_EARLY"  # read by interactor/__init__.py, in the worker child


def _supervise_worker(argv: list[str], *, gevent: bool = False) -> int:
    """Run the Celery worker as a child and restart it if it dies on its own.

    Celery gives up on some broker reconnects with an "Unrecoverable error" (kombu's Redis
    channel can lose its connection object mid-reconnect: celery/kombu #582, #970), and the
    worker process exits. Episodes are safe (leases, reservations), but a fleet must not shrink
    by itself: the child is restarted. SIGTERM/SIGINT/SIGHUP are passed on and end the
    supervisor: SIGINT as it is (Celery reads a second one as a cold shutdown), SIGTERM and SIGHUP
    as one SIGTERM (Celery restarts on SIGHUP, and every SIGTERM would restart the grace period
    of its running episodes).
    """
    import subprocess
    import time

    stopping = threading.Event()
    child: list[subprocess.Popen] = []

    termed: set[int] = set()  # children already sent SIGTERM

    def forward(signum, _frame):
        stopping.set()
        p = child[0] if child else None
        if p is None or p.poll() is not None:
            return
        if signum == signal.SIGINT:
            p.send_signal(signal.SIGINT)
        elif p.pid not in termed:
            termed.add(p.pid)
            p.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        catch(sig, forward)
    env = {**os.environ, _WORKER_CHILD: "1", **({GEVENT_EARLY: "1"} if gevent else {})}
    restarts = 0
    while not stopping.is_set():
        # Own session: a terminal's Ctrl-C reaches only us, and we pass it on once (Celery reads
        # a second SIGINT as "cold shutdown"). If we die without a word, the child gets SIGTERM
        # (children.spawn) and hands back its episodes.
        child[:] = [spawn([sys.executable, "-m", "interactor.cli", *argv], env=env)]
        if stopping.is_set():  # a signal came while it was starting: it must have it too
            forward(signal.SIGTERM, None)
        code = child[0].wait()
        if stopping.is_set():
            return code
        restarts += 1
        log.error("worker process exited with %s without being asked to; restarting (%d)", code, restarts)
        time.sleep(min(10.0, 0.5 * restarts))
    return 0


def _raise_open_files_limit() -> None:
    """A worker holds a connection per running episode to its env server and to the model (and
    Redis): at a thousand episodes per process that is past the common soft limit of 1024 open
    files. Raise the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def cmd_consumer(args) -> int:
    from consumer.ingest import Ingestor
    from consumer.storage import open_store

    settings = settings_from_args(args)
    stop = stop_event()
    store = open_store(settings.results_store)
    client = redis_for(settings)
    from consumer.budget_watch import BudgetWatch
    from consumer.stats import StatsRecorder

    if args.metrics_port:
        from interactor.fleet_reader import FleetReader
        from interactor.metrics import registry, serve

        serve(registry(FleetReader(client, settings)), args.metrics_host, args.metrics_port)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    try:
        observers = [StatsRecorder(client, settings), BudgetWatch(client, settings)]
        Ingestor(client, settings, store, name=args.name, observers=observers, sweep=True).run(stop)
    finally:
        store.close()
    return 0


def cmd_submit(args) -> int:
    from producer.enqueue import plan, submit_plan

    settings = settings_from_args(args)
    planned = plan(settings, args.tasks, args.job_id)
    if not args.no_preflight:
        from interactor.preflight import gate

        if not gate(settings, planned.episodes, summary_to=sys.stderr):  # stdout is the job's JSON
            return 2
    sub = submit_plan(redis_for(settings), settings, planned)
    print(json.dumps({"job_id": sub.job.job_id, "episodes": sub.job.episodes, "groups": sub.job.groups,
                      "enqueue_s": round(sub.enqueue_s, 3)}))
    return 0


def cmd_run(args) -> int:
    from interactor.localrun import run_local
    from producer.enqueue import new_job_id

    if not args.tasks and not args.resume:
        raise SettingsError("name task files to run, or --resume JOB")
    corrections = None
    if args.resume:
        corrections = _resumed_with_the_runs_settings(args)
        job_id = args.resume
    else:
        job_id = args.job_id or new_job_id()
        _keep_run_settings(args, job_id)
    return run_local(settings_from_args(args), args.tasks, workers=args.workers, job_id=job_id, resume=args.resume,
                     ui=_ui_address(args), preflight=not args.no_preflight, wait_when_paused=args.wait_when_paused,
                     corrections=corrections)


# What `run --resume JOB` takes again from the run that started the job: the flags of the parts
# it starts anew (its workers: concurrency, timeouts, ...; --workers). The job's own settings
# (model, sampling, step loop: read_by JOB) are stored with the job; a flag of one given to the
# resume corrects the stored value (interactor/job_corrections.py).
RUN_SETTINGS_DIR = "run-settings"  # under --run-dir: JOB.json


def _fleet_fields() -> dict[str, str]:
    """flag -> field of the setting flags a resumed run may apply: those its workers read."""
    return {flag: f.name for f in dataclasses.fields(Settings) if (flag := f.metadata["flag"])
            and WORKER in f.metadata["read_by"]}


def _job_flags() -> dict[str, dataclasses.Field]:
    """flag -> field of the settings copied into a job when it is created (read_by JOB)."""
    return {flag: f for f in dataclasses.fields(Settings) if (flag := f.metadata["flag"]) and JOB in f.metadata["read_by"]}


def _run_settings_path(args, job_id: str) -> str:
    return os.path.join(settings_from_args(args).run_dir, RUN_SETTINGS_DIR, f"{job_id}.json")


def _keep_run_settings(args, job_id: str) -> None:
    """The flags of this run's workers, for `run --resume` to start them alike."""
    kept = {field: getattr(args, field) for field in _fleet_fields().values() if getattr(args, field, None) is not None}
    if args.workers is not None:
        kept["workers"] = args.workers
    path = _run_settings_path(args, job_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(kept, f)


def _resumed_with_the_runs_settings(args) -> dict:
    """``args`` as the run that started the job had them, where this command line gives no other
    value: said in one line. Returns the job settings this command line gives, which correct the
    job's stored ones (interactor/job_corrections.py; one a resume cannot change is refused)."""
    from interactor.job_corrections import correction_flags

    job = args.resume
    if args.tasks:
        raise SettingsError(f"run --resume {job} takes no task files: the job's episodes are stored with it")
    path = _run_settings_path(args, job)
    try:
        with open(path) as f:
            kept = json.load(f)
    except FileNotFoundError:
        kept = None
    # Read before the run's kept worker flags fill in args: only what this command line gives.
    corrections = correction_flags(args, _job_flags())
    if kept is None:
        print(f"resuming job {job} with this command's worker settings (no run of it in "
              f"{os.path.dirname(os.path.dirname(path)) or '.'} kept its own)")
        return corrections
    by_field = {field: flag for flag, field in _fleet_fields().items()} | {"workers": "--workers"}
    taken, overridden = [], []
    for field, value in kept.items():
        if field not in by_field:
            continue  # a setting this version no longer has
        if getattr(args, field, None) is None:
            setattr(args, field, value)
            taken.append(f"{by_field[field]} {value}")
        elif getattr(args, field) != value:
            overridden.append(f"{by_field[field]} {getattr(args, field)} (the run's: {value})")
    print(f"resuming job {job} with the run's own worker settings: {', '.join(taken) or 'the defaults'}"
          + (f"; given here instead: {', '.join(overridden)}" if overridden else ""))
    return corrections


def cmd_demo(args) -> int:
    from interactor.localrun import run_demo

    return run_demo(settings_from_args(args), workers=args.workers, ui=_ui_address(args))


def _ui_address(args) -> tuple[str, int] | None:
    return (args.ui_host, args.ui_port) if args.ui else None


def _add_preflight_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-preflight", action="store_true",
                   help="enqueue without first asking the model endpoint and env servers whether they answer "
                        "(for servers that start later)")


def _add_ui_flags(p: argparse.ArgumentParser) -> None:
    from interactor.ui import DEFAULT_PORT

    p.add_argument("--ui", action="store_true",
                   help="serve the results browser while the job runs, and after it until Ctrl-C (read-only)")
    p.add_argument("--ui-host", default="127.0.0.1",
                   help="address the results browser listens on (default: %(default)s)")
    p.add_argument("--ui-port", type=int, default=DEFAULT_PORT,
                   help="port of the results browser; 0 picks a free one (default: %(default)s)")


# --- reading results ----------------------------------------------------------------------
def cmd_results(args) -> int:
    from consumer.storage import open_store
    from interactor.jobs import require_store
    from interactor.report import print_groups, print_results, print_task_rows

    settings = settings_from_args(args)
    require_store(settings)  # missing: the error names the run folders that have one
    store = open_store(settings.results_store, readonly=True)
    try:
        if args.job not in store.job_ids():
            print(f"no job {args.job!r} in {settings.results_store_shown}", file=sys.stderr)
            return 2
        res = store.results(args.job)
        res["scores"] = store.score_summary(args.job, args.pass_threshold)
        if args.groups:
            res["group_rows"] = store.groups(args.job)
        if args.rows:
            res["task_rows"] = store.task_table(args.job, args.pass_threshold)
    finally:
        store.close()
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print_results(args.job, res, settings.results_store_shown)
        if args.groups:
            print_groups(res["group_rows"])
        if args.rows:
            print_task_rows(res["task_rows"])
    return 0


def cmd_export(args) -> int:
    from consumer.export import export_training
    from consumer.storage.group_stats import ADVANTAGE_EPS
    from interactor.jobs import require_store

    settings = settings_from_args(args)
    require_store(settings)  # missing: the error names the run folders that have one
    eps = ADVANTAGE_EPS if args.eps is None else args.eps
    # Token streams go beside the plain export, not over it: both are wanted for one job.
    out = args.out or os.path.join(settings.run_dir, f"{args.job}{'.streams' if args.streams else ''}.{args.format}")
    env_names = [n.strip() for item in (args.env_name or []) for n in item.split(",") if n.strip()]
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SettingsError("--max-staleness must be >= 0")
    if args.streams:
        # one row per episode token stream (segment), not per step: consumer/streams.py
        from consumer.export import export_streams

        res = export_streams(settings.results_store, args.job, out, fmt=args.format,
                             complete_groups_only=args.complete_groups, env_names=env_names or None,
                             max_staleness=args.max_staleness, current_version=args.current_version, eps=eps)
        print(f"wrote {res.rows} token-stream rows ({res.episodes} episodes, {res.groups} groups) to {out}")
        if not res.rows and res.episodes:
            print(f"note: no step of job {args.job} has token ids: streams come from a job run with --tokens "
                  "(or `tokens: true` in its task file)")
        return 0
    res = export_training(settings.results_store, args.job, out, fmt=args.format, trainable_only=not args.all_steps,
                          complete_groups_only=args.complete_groups, env_names=env_names or None,
                          max_staleness=args.max_staleness, current_version=args.current_version, eps=eps)
    print(f"wrote {res.rows} rows ({res.episodes} episodes, {res.groups} groups) to {out}")
    if res.groups_rewards_equal:
        print(f"{res.groups_rewards_equal} of {res.groups} groups have all rewards equal (advantage 0)")
    if args.max_staleness is not None:
        print(f"staleness: current version {res.current_version}, dropped {res.dropped_stale} stale and "
              f"{res.dropped_unversioned} unversioned episodes" +
              (f", {res.dropped_groups} groups left incomplete" if args.complete_groups else ""))
    return 0


def cmd_reconcile(args) -> int:
    from broker.recovery import reconcile

    settings = settings_from_args(args)
    lost = reconcile(redis_for(settings), settings, args.job, dry_run=args.dry_run)
    verb = "would re-enqueue" if args.dry_run else "re-enqueued"
    print(f"{verb} {len(lost)} episodes" + (": " + " ".join(lost[:20]) if lost else ""))
    return 0


def cmd_serve(module: str, prog: str):
    def run(args) -> int:
        # examples/ sits above interactor: its program is run, not imported.
        exec_program(module, args.rest, prog=prog)
        return 0  # pragma: no cover - exec_program does not return

    return run


# --- parser -------------------------------------------------------------------------------
EXTRA_COMMAND_MODULES = ["interactor.ops", "interactor.dlqcli", "interactor.jobs", "interactor.benchcli", "interactor.envcli",
                         "interactor.ui.command", "interactor.feedcmd", "interactor.gatewaycmd",
                         "interactor.cachecli", "interactor.comparecli", "interactor.jobcmd"]


def build_parser(commands=()) -> argparse.ArgumentParser:
    """The command's parser; ``commands``: ``register(sub, add)`` functions of commands that a
    program above this package adds (``python -m bench``: bench/bench_command.py)."""
    p = ArgumentParser(prog="interactor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name, fn, help_, reads=LOCAL, helps=None):
        return add_command(sub, name, fn, help_, reads, helps)

    sp = add("run", cmd_run, "run task files end to end on this machine", helps=LOCAL_HELPS)
    sp.add_argument("tasks", nargs="*", help="task files (YAML or JSON) to run as one job")
    sp.add_argument("--resume", metavar="JOB",
                    help="finish a job already in Redis (same --run-dir), with the worker flags of the run that "
                         "started it (--concurrency, --workers, ...) and its own model, sampling and step settings; "
                         "a flag of either given here replaces its value (--model M corrects the job's), said so")
    sp.add_argument("--wait-when-paused", action="store_true",
                    help="when the job pauses itself (its episodes keep failing alike), wait for `interactor resume` "
                         "instead of stopping with exit 3 and the command that resumes it")
    add_workers_flag(sp)
    sp.add_argument("--job-id", help="the new job's id (default: the time and a random suffix)")
    _add_preflight_flag(sp)
    _add_ui_flags(sp)
    sp = add("demo", cmd_demo, "run the bundled example batch against the stand-in servers", helps=LOCAL_HELPS)
    add_workers_flag(sp)
    _add_ui_flags(sp)
    sp = add("submit", cmd_submit, "validate and enqueue task files; prints the job id (JSON)", reads=(JOB, REDIS))
    sp.add_argument("tasks", nargs="+", help="task files (YAML or JSON), enqueued as one job")
    sp.add_argument("--job-id", help="the new job's id (default: the time and a random suffix)")
    _add_preflight_flag(sp)
    sp = add("worker", cmd_worker, "run a worker process: these flags are its own; a job's model, sampling and step "
                                   "loop come with the job (submit's flags)",
             reads=(WORKER, REDIS))
    sp.set_defaults(argv=None)
    sp.add_argument("--name", default=None,
                    help="the worker's Celery node name, NAME@%%h (default: Celery's, celery@HOST)")
    sp.add_argument("--loglevel", default="INFO", help="Celery's log level (default: %(default)s)")
    sp = add("consumer", cmd_consumer, "run the results consumer (and the recovery sweeper)", reads=(REDIS, STORE))
    sp.add_argument("--name", default=None, help="the consumer's name in the results stream's consumer group "
                                                 "(default: consumer@HOST)")
    sp.add_argument("--metrics-port", type=int, default=0,
                    help="also serve Prometheus metrics on this port (default: 0, none)")
    sp.add_argument("--metrics-host", default="127.0.0.1",
                    help="address the metrics listen on; 0.0.0.0 for other hosts (default: %(default)s)")
    sp = add("results", cmd_results, "print a job's results from the results store", reads=(STORE,))
    sp.add_argument("job", help="the job's id (printed by run and submit; interactor jobs lists them)")
    sp.add_argument("--json", action="store_true", help="print them as JSON")
    sp.add_argument("--groups", action="store_true", help="one row per group: size, mean, std, complete")
    sp.add_argument("--rows", action="store_true",
                    help="one row per task (dataset row): samples, solved, mean reward, and whether the model solves "
                         "it always, sometimes or never")
    sp.add_argument("--pass-threshold", type=float, default=None, metavar="X",
                    help="a sample solves its task when its reward is at least X, for pass@1, pass@k and --rows "
                         "(default: 1)")
    _add_export(add("export", cmd_export, "export a job's training rows from the results store", reads=(STORE,)))
    sp = add("reconcile", cmd_reconcile, "re-enqueue episodes lost by the broker", reads=(REDIS,))
    sp.add_argument("job", help="the job's id")
    sp.add_argument("--dry-run", action="store_true", help="only say which episodes would be re-enqueued")
    # `status` (with --watch), `metrics` and `autoscale` live in interactor/ops.py.

    # Commands that live with their feature (metrics, autoscale, bench, serve-env adapters...):
    # each module has register(sub, add), where add(name, fn, help, reads) makes a parser with
    # the settings flags of the parts it reads.
    import importlib

    for register in commands:
        register(sub, add)
    for module in EXTRA_COMMAND_MODULES:
        importlib.import_module(module).register(sub, add)

    for name, module in (("serve-model", "examples.model_standin"),):
        # prefix_chars: every flag goes to the stand-in's own parser (REMAINDER alone drops them).
        sp = sub.add_parser(name, help=f"the bundled {module} stand-in", add_help=False, prefix_chars="\0")
        sp.add_argument("rest", nargs=argparse.REMAINDER, help=f"the stand-in's own flags (interactor {name} --help)")
        sp.set_defaults(fn=cmd_serve(module, f"interactor {name}"))
    return p


def _add_export(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job", help="the job's id (printed by run and submit; interactor jobs lists them)")
    sp.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="default: %(default)s")
    sp.add_argument("--out", help="the file to write (default: RUN_DIR/JOB.FORMAT; with --streams RUN_DIR/JOB.streams.FORMAT)")
    sp.add_argument("--complete-groups", action="store_true", help="only groups whose every episode completed")
    sp.add_argument("--all-steps", action="store_true", help="not only trainable steps")
    sp.add_argument("--streams", action="store_true",
                    help="token streams with loss masks, one row per episode (segment), from a job run with --tokens")
    sp.add_argument("--env-name", action="append", metavar="NAMES", help="only these env names (repeatable, or a,b)")
    sp.add_argument("--max-staleness", type=float, metavar="N",
                    help="only episodes at most N weight versions older than --current-version (default: all)")
    sp.add_argument("--current-version", help="the trainer's current weight version (default: newest in the job)")
    # no default here: the export's own (ADVANTAGE_EPS, consumer/storage/group_stats.py), not a copy
    sp.add_argument("--eps", type=float, help="advantage = (reward - mean) / (std + eps) (default 1e-6)")


def main(argv: list[str] | None = None, *, commands=()) -> int:
    args = build_parser(commands).parse_args(argv)
    if getattr(args, "argv", "") is None:  # the worker supervisor re-runs the same command line
        args.argv = list(argv) if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from broker.cancel import JobCancelled
    from broker.ledger import JobExists
    from consumer.storage import StoreError
    from producer.enqueue import SubmitLost
    from producer.taskfile import TaskFileError

    if os.environ.get(_WORKER_CHILD) != "1":
        # Started by another interactor command: stop (as on SIGTERM) if it dies without
        # stopping us. A Celery worker process starts its watch itself, after gevent's patching.
        watch_parent()
    try:
        return args.fn(args)
    except BrokenPipeError:  # `interactor results JOB | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except (SettingsError, TaskFileError, StoreError, JobExists, JobCancelled, SubmitLost) as exc:
        print(f"interactor: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP in run/demo, before any report
        return exit_code(exc)
    except Exception as exc:
        import redis  # (not at the top: a gevent worker patches the socket modules before redis loads)

        if not isinstance(exc, redis.RedisError):
            raise
        # a command that needs Redis says so in one line, not a traceback
        if isinstance(exc, redis.AuthenticationError):
            print(f"interactor: Redis at {_redis_shown(args)} refused the login ({exc}): the URL's password is "
                  "wrong or missing", file=sys.stderr)
        else:
            print(f"interactor: Redis at {_redis_shown(args)} is unreachable: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr)
        return 2


def _redis_shown(args) -> str:
    try:
        return redact_url(with_local_redis(settings_from_args(args)).redis_url) or "(no REDIS_URL)"
    except Exception:  # noqa: BLE001 - only for the message
        return "(the configured URL)"


if __name__ == "__main__":
    sys.exit(main())
