"""Operating the fleet: ``interactor metrics``, ``interactor status``, ``interactor resume`` and
``interactor cancel`` (a job's pause and its end), and ``interactor autoscale``. What status
prints is interactor/status_text.py.

Registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from broker.settings import REDIS, WORKER
from broker.states import LedgerState
from interactor.children import stop_event, wait_for_signal

log = logging.getLogger("interactor.ops")

DEFAULT_METRICS_PORT = 9400


def register(sub, add) -> None:
    sp = add("metrics", cmd_metrics, "serve the fleet's Prometheus metrics (queues, episodes, stream, steps, latency)",
             reads=(REDIS,))
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on; 0.0.0.0 to serve other hosts, a Prometheus scraper "
                         "(default: %(default)s)")
    sp.add_argument("--port", type=int, default=DEFAULT_METRICS_PORT, help="0 picks a free one (default: %(default)s)")
    sp.add_argument("--once", action="store_true", help="print the exposition once and exit")
    sp.add_argument("--extra-queues", default="", help="more queues to show, comma-separated (default: none)")

    sp = add("status", cmd_status, "queue, running, done, failed, dead, steps/s, lag and jobs at a glance",
             reads=(REDIS,))
    sp.add_argument("job", nargs="?", help="only this job's episodes (default: every job in Redis)")
    sp.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    sp.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default: %(default)s)")
    sp.add_argument("--json", action="store_true", help="print it as JSON")

    sp = add("resume", cmd_resume, "continue a paused job (its attempts kept failing alike): parked episodes go again",
             reads=(REDIS,))
    sp.add_argument("job", help="the paused job's id")
    sp.add_argument("--as", dest="who", default=None, metavar="NAME",
                    help="who the job's audit log says resumed it (default: your user@host)")

    sp = add("cancel", cmd_cancel, "stop a job: its queued episodes are cancelled at once, its running ones stop "
                                   "at their next call; what completed stays", reads=(REDIS,))
    sp.add_argument("job", help="the job's id (printed by run and submit; interactor status lists those in Redis)")
    sp.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for its running episodes to stop, then print the counts; 0: do not "
                         "wait (default: %(default)s)")
    sp.add_argument("--as", dest="who", default=None, metavar="NAME",
                    help="who the job's audit log says cancelled it (default: your user@host)")

    # Its workers run with these settings: a worker's flags (--concurrency per worker process).
    sp = add("autoscale", cmd_autoscale, "run local worker processes, as many as the queue needs",
             reads=(WORKER, REDIS))
    sp.add_argument("--min", dest="min_workers", type=int, default=0,
                    help="worker processes at least (default: %(default)s)")
    sp.add_argument("--max", dest="max_workers", type=int, default=4,
                    help="worker processes at most (default: %(default)s)")
    sp.add_argument("--target-per-worker", type=int, default=None,
                    help="queued + running episodes per worker (default: --concurrency)")
    sp.add_argument("--cooldown", type=float, default=60.0,
                    help="scale-down stabilization window, seconds (default: %(default)s)")
    sp.add_argument("--interval", type=float, default=5.0, help="seconds between decisions (default: %(default)s)")
    sp.add_argument("--metrics-port", type=int, default=0,
                    help="serve the autoscaler's own gauges on this port (default: 0, none)")
    sp.add_argument("--metrics-host", default="127.0.0.1",
                    help="address those listen on; 0.0.0.0 to serve other hosts (default: %(default)s)")
    sp.add_argument("--log-dir", default=None, help="worker logs here (default: this process's output)")
    sp.add_argument("--name", default="as", help="worker name prefix (default: %(default)s)")


# --- metrics --------------------------------------------------------------------------------
def cmd_metrics(args) -> int:
    from interactor.common import redis_for, settings_from_args, with_local_redis
    from interactor.fleet_reader import FleetReader
    from interactor.metrics import exposition, registry, serve

    settings = with_local_redis(settings_from_args(args))
    reader = FleetReader(redis_for(settings), settings, extra_queues=args.extra_queues.split(","))
    if args.once:
        sys.stdout.write(exposition(reader))
        return 0
    server, _ = serve(registry(reader), args.host, args.port)
    log.info("metrics on http://%s:%d/metrics", args.host, server.server_port)
    print(f"serving metrics on http://{args.host}:{server.server_port}/metrics", flush=True)
    wait_for_signal()
    server.shutdown()
    return 0


# --- status ---------------------------------------------------------------------------------
def cmd_status(args) -> int:
    from interactor.common import redis_for, settings_from_args, with_local_redis
    from interactor.fleet_reader import FleetReader
    from interactor.status_text import render_status, snapshot_json

    settings = with_local_redis(settings_from_args(args))
    reader = FleetReader(redis_for(settings), settings)
    if not args.watch:
        snap = reader.snapshot(args.job)
        if args.json:
            print(json.dumps(snapshot_json(snap), indent=2))
        else:
            print(render_status(snap))
        return 0
    tty = sys.stdout.isatty()
    try:
        while True:
            text = render_status(reader.snapshot(args.job))
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.interval:g}s; Ctrl-C to quit)\n")
            else:
                sys.stdout.write(text + "\n\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


# --- resume ---------------------------------------------------------------------------------
def cmd_resume(args) -> int:
    from broker.cancel import JobCancel, JobCancelled
    from broker.pause import JobPause, resume_job
    from broker.keys import Keys
    from broker.ledger import Ledger
    from interactor.common import redis_for, settings_from_args

    settings = settings_from_args(args)
    client = redis_for(settings)
    if Ledger.for_settings(client, settings).job_spec(args.job) is None:
        print(f"interactor: no job {args.job!r} in Redis (prefix {settings.key_prefix})", file=sys.stderr)
        return 2
    if JobCancel(client, settings).is_cancelled(args.job):
        raise JobCancelled(args.job, "there is nothing to resume")
    state = JobPause(client, Keys(settings.key_prefix)).state(args.job)
    sent = resume_job(client, settings, args.job, who=args.who)
    if state is None:
        print(f"job {args.job} was not paused" + (f"; sent {len(sent)} parked episodes again" if sent else ""))
    else:
        print(f"resumed job {args.job} ({state.describe()}); sent {len(sent)} parked episodes again")
    from interactor.stopped_run import started_for_command

    if started_for_command():
        print(f"no worker runs for it: its run in {settings.run_dir}/ has stopped; finish it with  interactor run "
              f"--resume {args.job} --run-dir {settings.run_dir}")
    return 0


# --- cancel ---------------------------------------------------------------------------------
def cmd_cancel(args) -> int:
    """Cancel the job (broker/cancel.py), say what that did, and wait (up to ``--wait``) until
    none of its episodes runs; then its counts. Cancelling again is harmless: it says so, and
    cancels whatever was left waiting."""
    from broker.cancel import JobCancel
    from broker.ledger import Ledger
    from broker.recovery import Sweeper
    from interactor.common import redis_for, settings_from_args
    from interactor.stopped_run import settle_into_store, started_for_command

    settings = settings_from_args(args)
    client = redis_for(settings)
    cancels = JobCancel(client, settings)
    report = cancels.cancel(args.job, who=args.who)
    if report is None:
        print(f"interactor: no job {args.job!r} in Redis (prefix {settings.key_prefix})", file=sys.stderr)
        return 2
    if report.already:
        print(f"job {args.job} was cancelled already; {report.waiting} more waiting episodes cancelled, "
              f"{report.running} still running")
    else:
        print(f"job {args.job} cancelled: {report.waiting} queued or retrying episodes cancelled (removed), "
              f"{report.running} running told to stop (each at its next call, once its lease renewal tells it)")
    ledger = Ledger.for_settings(client, settings)
    deadline = time.monotonic() + max(0.0, args.wait)
    stopped = started_for_command()  # a stopped local run's: no worker or consumer of its own
    sweeper = Sweeper(client, settings) if stopped else None
    counts = ledger.counts(args.job)
    while counts[LedgerState.RUNNING] and time.monotonic() < deadline:
        if sweeper is not None:  # its killed workers' attempts end cancelled once their leases expired
            sweeper.tick()
        time.sleep(0.5)
        cancels.cancel_waiting(args.job)  # what an attempt left waiting in the cancel's very moment
        counts = ledger.counts(args.job)
    if stopped:
        settle_into_store(client, settings)
        print(f"the results store of {settings.run_dir}/ has the cancel: interactor jobs shows the job cancelled")
    print(f"job {args.job}: " + " ".join(f"{s}={n}" for s, n in counts.items()))
    if counts[LedgerState.RUNNING]:
        print(f"{counts[LedgerState.RUNNING]} still running after {args.wait:g}s: each stops at its next call "
              "(or, its worker gone, once its lease expires); `interactor status` shows when")
    return 0


# --- autoscale ----------------------------------------------------------------------------------
def cmd_autoscale(args) -> int:
    from broker.settings import SettingsError
    from interactor.autoscale import LocalScaler, Policy, autoscaler_registry
    from interactor.common import redis_for, settings_from_args
    from interactor.metrics import serve

    settings = settings_from_args(args)
    if not settings.redis_url:
        raise SettingsError("the autoscaler needs REDIS_URL (or --redis-url)")
    try:
        policy = Policy(min_workers=args.min_workers, max_workers=args.max_workers,
                        target_per_worker=args.target_per_worker or settings.concurrency,
                        scale_down_cooldown_s=args.cooldown)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    scaler = LocalScaler(settings, policy, client=redis_for(settings), name=args.name, log_dir=args.log_dir)
    if args.metrics_port:
        server, _ = serve(autoscaler_registry(scaler), args.metrics_host, args.metrics_port)
        log.info("autoscaler metrics on http://%s:%d/metrics", args.metrics_host, server.server_port)
    scaler.run(stop_event(), args.interval)
    return 0
