"""``interactor feed serve``: its flags, the checks that refuse a bad combination before
anything starts, and the run itself (Redis, the local fleet, the HTTP server, the stop order).

Given task files, it runs them as ``interactor run`` would (an embedded Redis unless
``REDIS_URL``, local workers and consumer) as a continuous job, and produces as the trainer
takes; given ``--job``, it serves a job a fleet already runs; given neither, it waits for the
first ``POST /start_rollout``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from broker import feed
from broker.settings import Settings, SettingsError
from interactor.feedserve import FeedApp, make_server
from interactor.rollout import Rollout, check_servable

# A feed's configuration flags (broker/feed.py FeedConfig): the flag, its argparse name and the
# setting it sets. Given, they set the new job's feed; with --job they are refused.
FEED_FLAGS = (
    ("--max-ahead", "max_ahead", "feed_max_ahead"),
    ("--max-staleness", "max_staleness", "feed_max_staleness"),
    ("--stale-policy", "stale_policy", "feed_stale_policy"),
    ("--failed-policy", "failed_policy", "feed_failed_policy"),
    ("--refill-max", "refill_max", "feed_refill_max"),
    ("--ack-timeout", "ack_timeout", "feed_ack_timeout_s"),
    ("--drop-uniform", "drop_uniform", "feed_drop_uniform"),
    ("--filter", "filter", "feed_filter"),
)


def register(sub, add) -> None:
    from interactor.common import SETTING_FLAGS, add_setting_flags

    fp = sub.add_parser("feed", help="the online-RL rollout feed (interactor feed serve)")
    fsub = fp.add_subparsers(dest="feed_cmd", required=True)
    sp = fsub.add_parser("serve", help="serve a job's complete groups to trainers over HTTP")
    add_setting_flags(sp, list(SETTING_FLAGS))  # the same flags as `interactor run`
    sp.set_defaults(fn=cmd_feed)
    sp.add_argument("tasks", nargs="*", help="task files to run as a continuous job (else --job J, or neither: "
                                             "the job comes from POST /start_rollout)")
    sp.add_argument("--job", help="serve the feed of a job already in Redis")
    sp.add_argument("--llm-session-routing", action="store_true",
                    help="model base URL becomes {llm-base-url}/{episode_id} (as for interactor run)")
    sp.add_argument("--epochs", type=int, default=0, help="continuous job: stop after N epochs (0: without end)")
    sp.add_argument("--seed", type=int, default=0, help="shuffles each epoch's tasks")
    sp.add_argument("--workers", type=int, default=None)
    sp.add_argument("--host", default=None, help="default 127.0.0.1 (INTERACTOR_FEED_HOST)")
    sp.add_argument("--port", type=int, default=None, help="default 8700 (INTERACTOR_FEED_PORT); 0 picks one")
    sp.add_argument("--max-ahead", type=int, default=None)
    sp.add_argument("--max-staleness", type=int, default=None)
    sp.add_argument("--stale-policy", choices=[feed.STALE_REQUEUE, feed.STALE_DROP], default=None)
    sp.add_argument("--failed-policy", choices=[feed.FAILED_REPORT, feed.FAILED_REFILL], default=None)
    sp.add_argument("--refill-max", type=int, default=None,
                    help="--failed-policy refill: re-runs of a group's tasks before it is reported failed (default 2)")
    sp.add_argument("--ack-timeout", type=float, default=None, help="seconds")
    sp.add_argument("--drop-uniform", action="store_true", default=None)
    sp.add_argument("--filter", default=None, help="module:function (allow-listed by INTERACTOR_FEED_FILTERS)")
    sp.add_argument("--no-fleet", action="store_true", help="with task files: start no local workers/consumer")
    sp.add_argument("--no-preflight", action="store_true",
                    help="create the job without first asking the model endpoint and env servers whether they answer")


def cmd_feed(args) -> int:
    from interactor.common import settings_from_args

    settings = settings_from_args(args)
    given = {flag: (setting, getattr(args, name)) for flag, name, setting in FEED_FLAGS
             if getattr(args, name) is not None}
    overrides = {k: v for k, v in (("feed_host", args.host), ("feed_port", args.port)) if v is not None}
    overrides.update(given.values())
    if overrides:
        settings = settings.replace(**overrides)
    if args.tasks and args.job:
        raise SettingsError("name task files to run, or --job J to serve a running job (not both)")
    if args.job and (args.epochs or args.seed):
        raise SettingsError("--epochs and --seed are for task files; --job serves a job as it was created")
    # A feed's settings are its job's, in Redis, read by every server of the job and by its
    # producer. Applied from here they could lose data (a staleness bound or drop policy that
    # settles groups already produced, a shorter ack timeout that hands a trainer's groups to
    # another, a filter the trainer never asked for): refused instead, and nothing is touched.
    if args.job and not settings.redis_url:
        raise SettingsError(f"--job {args.job} serves a job in a fleet's Redis: set REDIS_URL (or --redis-url)")
    if args.job and given:
        raise SettingsError(f"{', '.join(given)}: a feed's settings are fixed when its job is created (they live "
                            f"in Redis with the job); --job {args.job} serves the feed as it is. Leave them out, or "
                            "start a new job with them from task files")
    # A filter off the allow-list (or not importable) stops us before anything starts.
    from interactor.feed import load_filter

    try:
        load_filter(settings.feed_filter, settings.feed_filters)
    except feed.FeedError as exc:
        raise SettingsError(str(exc)) from None
    return serve(settings, tasks=args.tasks, job_id=args.job, epochs=args.epochs, seed=args.seed,
                 workers=args.workers, fleet=not args.no_fleet, preflight=not args.no_preflight)


def serve(settings: Settings, *, tasks: list[str] | None = None, job_id: str | None = None, epochs: int = 0,
          seed: int = 0, workers: int | None = None, fleet: bool = True, preflight: bool = True,
          ready: Callable[[str], None] | None = None) -> int:
    """Run the feed server until SIGINT/SIGTERM/SIGHUP, then stop in order: the producer, the
    HTTP server, the workers (they hand back what they run), the consumer, Redis.

    With ``job_id`` it serves that job of a fleet already running (``REDIS_URL``). Otherwise
    it is ``interactor run`` for a continuous job: an embedded Redis unless ``REDIS_URL``, local
    workers and consumer (unless ``fleet`` is False), and the job from ``tasks``, or from the
    first ``/start_rollout`` when none are named. A guard process stops the children should we
    be killed outright (interactor/children.py)."""
    import signal

    from broker.embedded import EmbeddedRedis
    from broker.redisconn import connect
    from consumer.storage import open_store
    from interactor.localrun import STAGE_LAST, LocalFleet, _persistent_password, start_guard

    own_fleet = job_id is None
    run_dir = Path(settings.run_dir)
    if tasks:  # a bad file stops us before anything starts (and again, with the servers, below)
        from producer.enqueue import plan

        plan(settings, tasks)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    guard = start_guard(settings, run_dir / "logs") if own_fleet else None
    embedded = local = server = store = None
    rollout = None
    done = False
    try:
        if own_fleet and not settings.redis_url:
            embedded = EmbeddedRedis(run_dir / "redis", port=None, password=_persistent_password(run_dir))
            try:
                embedded.start()
                guard.add(embedded.proc, STAGE_LAST)
            except BaseException:
                embedded.stop(kill=True)
                raise
            settings = settings.replace(redis_url=embedded.url)
            print(f"embedded Redis on 127.0.0.1:{embedded.port} (data in {run_dir / 'redis'})", flush=True)
        client = connect(settings)
        store = open_store(settings.results_store)
        rollout = Rollout(client, settings, store, stop, preflight)
        if job_id:
            check_servable(client, settings, job_id)
        try:
            service = rollout.new_job(tasks, epochs, seed) if tasks else (rollout.attach(job_id) if job_id else None)
        except feed.FeedError as exc:  # a job without a feed, a filter this server may not import
            raise SettingsError(str(exc)) from None
        if own_fleet and fleet:
            local = LocalFleet(settings, workers, run_dir / "logs", guard)
            local.start()
        app = FeedApp(service, start=rollout.from_request if own_fleet else None)
        server = make_server(app, settings.feed_host, settings.feed_port, settings.feed_token.reveal())
        threading.Thread(target=server.serve_forever, daemon=True, name="feed-http").start()
        url = f"http://{settings.feed_host}:{server.server_address[1]}"
        print(f"feed {'of job ' + service.job_id if service else 'waiting for POST /start_rollout'} at {url}",
              flush=True)
        if ready is not None:
            ready(url)
        last_backfill = time.monotonic()
        while not stop.wait(1.0):
            if local is not None:
                local.supervise()
            if app.service is not None and time.monotonic() - last_backfill > 30:
                last_backfill = time.monotonic()
                app.service.backfill()  # what the consumer could not announce (a failure outside a batch)
        print("stopping: the producer, then the workers (they hand back what they run), then the consumer",
              flush=True)
        done = True
        return 0
    finally:
        stop.set()
        if rollout is not None and rollout.thread is not None:
            rollout.thread.join(10)
        if server is not None:
            server.shutdown()
            server.server_close()
        if local is not None:
            local.stop(settings.shutdown_grace_s + 10)
        if store is not None:
            store.close()
        if embedded is not None:
            embedded.stop()
        if guard is not None:
            guard.close(done=done)
