"""``interactor feed serve``: its flags, the checks that refuse a bad combination before
anything starts, and the run itself (Redis, the local fleet, the HTTP server, the stop order).

Given task files, it runs them as ``interactor run`` would (an embedded Redis unless
``REDIS_URL``, local workers and consumer) as a continuous job, and produces as the trainer
takes; given ``--job``, it serves a job a fleet already runs; given neither, it waits for the
first ``POST /start_rollout``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from broker import feed
from broker.settings import Settings, SettingsError
from interactor.feedserve import FeedApp, make_server
from interactor.rollout import Rollout, check_servable

# A feed's knobs (broker/feed.py KNOBS) are settings whose flags are made from their description
# in broker/settings.py, as every setting flag is. Given, they set the new job's feed; with --job
# they are refused.
FEED_SETTINGS = tuple("feed_" + knob for knob in feed.KNOBS)


def register(sub, add) -> None:
    from broker.settings import FEED, FEED_SERVER
    from interactor.common import LOCAL, LOCAL_HELPS, add_command, add_workers_flag

    fp = sub.add_parser("feed", help="the online-RL rollout feed (interactor feed serve)",
                        description="the online-RL rollout feed")
    fsub = fp.add_subparsers(dest="feed_cmd", required=True, metavar="ACTION")
    # Its own fleet takes the flags of `interactor run`; its feed, those of FEED and FEED_SERVER.
    sp = add_command(fsub, "serve", cmd_feed, "serve a job's complete groups to trainers over HTTP",
                     reads=(*LOCAL, FEED, FEED_SERVER), helps=LOCAL_HELPS)
    sp.add_argument("tasks", nargs="*", help="task files to run as a continuous job (else --job J, or neither: "
                                             "the job comes from POST /start_rollout)")
    sp.add_argument("--job", help="serve the feed of a job already in Redis (its fleet runs it)")
    sp.add_argument("--epochs", type=int, default=0, help="continuous job: stop after N epochs (default: 0, without "
                                                          "end)")
    sp.add_argument("--seed", type=int, default=0, help="shuffles each epoch's tasks (default: %(default)s)")
    add_workers_flag(sp)
    sp.add_argument("--no-fleet", action="store_true", help="with task files: start no local workers/consumer")
    sp.add_argument("--no-preflight", action="store_true",
                    help="create the job without first asking the model endpoint and env servers whether they answer")
    register_version(fsub)


def register_version(fsub) -> None:
    from broker.settings import REDIS
    from interactor.common import add_command

    vp = add_command(fsub, "version", cmd_version, "show a feed job's policy version, or reset it (an operator's "
                     "repair)", reads=(REDIS,))
    vp.add_argument("job", help="the job whose feed version to show or reset")
    vp.add_argument("--reset", metavar="N", default=None,
                    help="set the version to N whatever it is now (versions otherwise only go forward); logged")


def cmd_version(args) -> int:
    """``interactor feed version JOB [--reset N]``: a version a trainer (or anyone reaching the
    feed) pushed too far would make every real one behind it refused and every group stale;
    only an operator may move it back."""
    import logging

    from interactor.common import redis_for, settings_from_args
    from broker.keys import Keys

    settings = settings_from_args(args)
    client, keys = redis_for(settings), Keys(settings.key_prefix)
    if not feed.has_feed(client, keys, args.job):
        raise SettingsError(f"job {args.job} has no feed in this Redis (prefix {settings.key_prefix})")
    if args.reset is None:
        raw = client.get(keys.feed_version(args.job))
        print(f"job {args.job}: version {raw.decode('utf-8', 'replace') if raw is not None else 'none published'}")
        return 0
    try:
        before = feed.reset_version(client, keys, args.job, args.reset)
    except feed.FeedError as exc:
        raise SettingsError(f"--reset: {exc}") from None
    now = feed.current_version(client, keys, args.job)
    logging.getLogger("interactor.feed").warning("job %s: feed version reset from %s to %s by an operator",
                                                 args.job, before, now)
    print(f"job {args.job}: version reset from {before if before is not None else 'none'} to {now}")
    return 0


def cmd_feed(args) -> int:
    from interactor.common import SETTING_FLAGS, settings_from_args

    settings = settings_from_args(args)
    given = [flag for flag, name in SETTING_FLAGS.items() if name in FEED_SETTINGS and getattr(args, name) is not None]
    if args.tasks and args.job:
        raise SettingsError("name task files to run, or --job J to serve a running job (not both)")
    if args.job and (args.epochs or args.seed):
        raise SettingsError("--epochs and --seed are for task files; --job serves a job as it was created")
    if not args.tasks and not args.job and (args.epochs or args.seed):
        raise SettingsError("--epochs and --seed are for task files; a job started by POST /start_rollout takes "
                            "its own from the request's body ({\"epochs\": N, \"seed\": S})")
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
    from interactor.feed_service import load_filter

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
            job_queues = rollout.ledger.job_queues(service.job_id) if service is not None else ()
            local = LocalFleet(settings, workers, run_dir / "logs", guard, queues=job_queues)
            rollout.served = set(local.settings.served_queues)
            local.start()
        app = FeedApp(service, start=rollout.from_request if own_fleet else None)
        server = make_server(app, settings.feed_host, settings.feed_port, settings.feed_token.reveal(),
                             max_connections=settings.feed_max_connections,
                             request_timeout_s=settings.feed_request_timeout_s)
        threading.Thread(target=server.serve_forever, daemon=True, name="feed-http").start()
        url = f"http://{settings.feed_host}:{server.server_address[1]}"
        print(f"feed {'of job ' + service.job_id if service else 'waiting for POST /start_rollout'} at {url}",
              flush=True)
        if ready is not None:
            ready(url)
        while not stop.wait(1.0):
            if local is not None:
                local.supervise()
        print("stopping: the producer, then the workers (they hand back what they run), then the consumer",
              flush=True)
        done = True
        return 0
    finally:
        stop.set()
        if rollout is not None and rollout.backfill is not None:
            rollout.backfill.stop()
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
