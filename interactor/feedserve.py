"""``interactor feed serve``: the online-RL feed over HTTP (interactor/feed.py does the work).

Routes (JSON bodies; docs/protocol.md, "The rollout feed"):

* ``POST /take`` ``{trainer, batch, timeout}`` -> ``{groups: [...]}``
* ``POST /ack`` ``{trainer, ids}`` -> ``{acked, already}``; 404 naming an unknown or foreign group
* ``GET /version`` / ``POST /version`` ``{version}``; 409 when it goes backwards
* ``GET /stats``
* the original buffer server's ``POST /get_rollout_data``, ``POST /start_rollout`` and ``GET /health``

Bound to 127.0.0.1 unless told otherwise; bound anywhere else it requires a token
(``INTERACTOR_FEED_TOKEN``, sent as ``Authorization: Bearer <token>``), checked on every route
but ``/health``. Given task files, it runs them as ``interactor run`` would (an embedded Redis
unless ``REDIS_URL``, local workers and consumer) as a continuous job, and produces as the
trainer takes; given ``--job``, it serves a job a fleet already runs.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from broker import feed
from broker.settings import Settings, SettingsError

log = logging.getLogger("interactor.feedserve")

MAX_BODY = 1 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class FeedApp:
    """What the routes call: a FeedService once a job is served. ``start`` (a server that runs
    its own fleet) makes one from ``/start_rollout``'s body; without it that route is refused."""

    def __init__(self, service=None, start: Callable[[dict], Any] | None = None):
        self.service = service
        self.start = start
        self.lock = threading.Lock()

    def need(self):
        if self.service is None:
            raise feed.FeedError("no rollout is running: POST /start_rollout first", 409)
        return self.service


def make_server(app: FeedApp, host: str, port: int, token: str = "") -> ThreadingHTTPServer:
    if not is_loopback(host) and not token:
        raise SettingsError(f"the feed is bound to {host}, beyond this machine: set INTERACTOR_FEED_TOKEN")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # noqa: A002 - the base class's name
            log.debug("feed %s " + fmt, self.client_address[0], *args)

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise feed.FeedError(f"request body of {n} bytes is over {MAX_BODY}", 413)
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise feed.FeedError(f"request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise feed.FeedError("request body must be a JSON object")
            return body

        def _authorized(self) -> bool:
            if not token:
                return True
            got = self.headers.get("Authorization", "")
            return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), token.encode())

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/health" and method == "GET":
                    svc = app.service
                    return self._send(200, {"success": True, "status": "ok",
                                            "job_id": svc.job_id if svc else None})
                if not self._authorized():
                    return self._send(401, {"success": False, "error": "missing or wrong bearer token"})
                route = ROUTES.get((method, path))
                if route is None:
                    return self._send(404, {"success": False, "error": f"no route {method} {path}"})
                body = self._body() if method == "POST" else {}
                return self._send(200, route(app, body))
            except feed.FeedError as exc:
                return self._send(exc.status, {"success": False, "error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - answered, logged, server stays up
                log.exception("feed route %s %s failed", method, path)
                return self._send(500, {"success": False, "error": f"{type(exc).__name__}: {exc}"})

        def do_GET(self):  # noqa: N802
            self._handle("GET")

        def do_POST(self):  # noqa: N802
            self._handle("POST")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _num(body: dict, name: str, default):
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise feed.FeedError(f"{name} must be a number, got {v!r}")
    return v


def _take(app: FeedApp, body: dict) -> dict:
    return {"groups": app.need().take(body.get("trainer", "trainer"), body.get("batch", 1),
                                      _num(body, "timeout", 30.0))}


def _ack(app: FeedApp, body: dict) -> dict:
    return app.need().ack(body.get("trainer", "trainer"), body.get("ids"))


def _get_version(app: FeedApp, body: dict) -> dict:
    svc = app.need()
    return {"version": feed.current_version(svc.r, svc.keys, svc.job_id)}


def _set_version(app: FeedApp, body: dict) -> dict:
    if "version" not in body:
        raise feed.FeedError("body must carry 'version'")
    return {"version": app.need().set_version(body["version"])}


def _stats(app: FeedApp, body: dict) -> dict:
    return app.need().stats()


def _get_rollout_data(app: FeedApp, body: dict) -> dict:
    svc = app.need()
    batch = body.get("batch_size", body.get("num_groups", 1))
    return svc.rollout_data(batch, _num(body, "timeout", 30.0))


def _start_rollout(app: FeedApp, body: dict) -> dict:
    with app.lock:
        if app.service is not None:
            raise feed.FeedError(f"a rollout is running already: job {app.service.job_id} "
                                 "(one job per feed server; start another server for another job)", 409)
        if app.start is None:
            raise feed.FeedError("this feed server serves a job a fleet runs and cannot start one", 409)
        app.service, note = app.start(body)
        return {"success": True, "message": f"Rollout started: job {app.service.job_id}{note}",
                "job_id": app.service.job_id}


# The original buffer server's start_rollout keys that name its task (a dataset, an env, a group
# size). What else its body carries (remote_engine_url, sampling_params, ...) configured what it
# ran itself; our workers take that from their settings, and the answer names what was ignored.
ORIGINAL_TASK_KEYS = {"input_file": "dataset", "task_type": "env_name", "num_repeat_per_sample": "env_num"}
OUR_KEYS = ("task_files", "config", "epochs", "seed")


def rollout_request(body: dict, run_dir: Path, cwd: Path | None = None) -> tuple[list[str], int, int, list[str]]:
    """``/start_rollout``'s body as (task files, epochs, seed, keys ignored). One of:

    * ``task_files``: paths of task files (as ``interactor feed serve tasks.yaml`` takes);
    * ``config``: a path, or a task file's content inline (``{environments: [...]}``);
    * the original buffer server's ``{task_type, input_file, num_repeat_per_sample}``: one
      environment ``task_type`` over the rows of ``input_file``, groups of that many.

    Relative paths are the server's working directory's. Inline content is written under the
    run folder, so the job's task file stays readable after the request. Which files these may
    be is decided when they are read (``feed_task_roots``, producer/readroots.py)."""
    cwd = cwd or Path.cwd()
    epochs = body.get("epochs", 0)
    seed = body.get("seed", 0)
    for name, v in (("epochs", epochs), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise feed.FeedError(f"{name} must be an integer >= 0, got {v!r}")
    files = body.get("task_files")
    config = body.get("config")
    original = {k: body[k] for k in ORIGINAL_TASK_KEYS if k in body}
    given = [n for n, v in (("task_files", files), ("config", config), ("task_type/input_file", original)) if v]
    if len(given) != 1:
        raise feed.FeedError("start_rollout needs one of 'task_files' (task file paths), 'config' (a task file's "
                             "path or content) or the original's 'task_type' + 'input_file' + "
                             f"'num_repeat_per_sample'; got {', '.join(given) or 'none'}")
    if files is not None or isinstance(config, str):
        files = [config] if isinstance(config, str) else files
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise feed.FeedError(f"task_files must be a list of task file paths, got {files!r}")
        return [str(cwd / f) for f in files], epochs, seed, _ignored(body)
    if original:
        missing = [k for k in ORIGINAL_TASK_KEYS if k not in original]
        if missing:
            raise feed.FeedError(f"start_rollout: the original's shape needs {', '.join(missing)} too")
        if not isinstance(original["input_file"], str) or not isinstance(original["task_type"], str):
            raise feed.FeedError("input_file and task_type must be strings")
        env = {ORIGINAL_TASK_KEYS[k]: v for k, v in original.items()}
        env["dataset"] = str(cwd / env["dataset"])
        config = {"environments": [env]}
    if not isinstance(config, dict) or not isinstance(config.get("environments"), list):
        raise feed.FeedError("config must be a task file path or a task file's content: {environments: [...]}")
    for env in config["environments"]:
        if isinstance(env, dict) and isinstance(env.get("dataset"), str):
            env["dataset"] = str(cwd / env["dataset"])
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"start_rollout-{int(time.time() * 1000)}.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return [str(path)], epochs, seed, _ignored(body)


def _ignored(body: dict) -> list[str]:
    return sorted(k for k in body if k not in OUR_KEYS and k not in ORIGINAL_TASK_KEYS)


ROUTES: dict[tuple[str, str], Callable[[FeedApp, dict], dict]] = {
    ("POST", "/take"): _take,
    ("POST", "/ack"): _ack,
    ("GET", "/version"): _get_version,
    ("POST", "/version"): _set_version,
    ("GET", "/stats"): _stats,
    ("POST", "/get_rollout_data"): _get_rollout_data,
    ("POST", "/start_rollout"): _start_rollout,
}


# --- the command ---------------------------------------------------------------------------------
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


def feed_flags(args) -> list[tuple[str, Any]]:
    """The flags that set a feed's configuration (broker/feed.py FeedConfig), as given."""
    return [("--max-ahead", args.max_ahead), ("--max-staleness", args.max_staleness),
            ("--stale-policy", args.stale_policy), ("--failed-policy", args.failed_policy),
            ("--refill-max", args.refill_max), ("--ack-timeout", args.ack_timeout),
            ("--drop-uniform", args.drop_uniform), ("--filter", args.filter)]


def cmd_feed(args) -> int:
    from interactor.common import settings_from_args

    settings = settings_from_args(args)
    overrides = {k: v for k, v in dict(feed_host=args.host, feed_port=args.port, feed_max_ahead=args.max_ahead,
                                       feed_max_staleness=args.max_staleness, feed_stale_policy=args.stale_policy,
                                       feed_failed_policy=args.failed_policy,
                                       feed_refill_max=args.refill_max, feed_ack_timeout_s=args.ack_timeout,
                                       feed_drop_uniform=args.drop_uniform, feed_filter=args.filter).items()
                 if v is not None}
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
    given = [flag for flag, v in feed_flags(args) if v is not None]
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


class Rollout:
    """The job a feed server serves and its producer thread (continuous jobs); what
    ``/start_rollout`` starts when the server was started without one."""

    def __init__(self, client, settings: Settings, store, stop: threading.Event, preflight: bool = True):
        self.r = client
        self.settings = settings
        self.store = store
        self.stop = stop
        self.preflight = preflight
        self.thread: threading.Thread | None = None

    def new_job(self, paths: list[str], epochs: int, seed: int, roots=None):
        """Create a continuous job from task files (checked, and their servers asked, first);
        ``roots`` (a ReadRoots) bounds what a request's paths may read."""
        from producer.continuous import create_continuous_job
        from producer.enqueue import plan

        planned = plan(self.settings, paths, roots=roots)  # TaskFileError / SettingsError name the fault
        if self.preflight:
            from interactor.preflight import check, refusal

            problems = check(self.settings, planned.episodes)
            if problems:
                raise SettingsError(refusal(problems))
        job = create_continuous_job(self.r, self.settings, paths, epochs=epochs, seed=seed, planned=planned)
        print(f"job {job.job_id}: continuous over {', '.join(paths)}"
              + (f", {epochs} epochs" if epochs else ", without end"), flush=True)
        return self.attach(job.job_id)

    def attach(self, job_id: str):
        from interactor.feed import FeedService
        from producer.continuous import ContinuousProducer

        service = FeedService(self.r, self.settings, job_id, self.store)
        service.backfill()
        if service.cfg.continuous:
            producer = ContinuousProducer(self.r, self.settings, job_id)
            self.thread = threading.Thread(target=producer.run, args=(self.stop,), daemon=True, name="producer")
            self.thread.start()
        return service

    def from_request(self, body: dict):
        """``/start_rollout``: bad input is a 400 naming it, and nothing is created."""
        from producer.readroots import ReadRoots
        from producer.taskfile import TaskFileError

        inline = Path(self.settings.run_dir) / "rollouts"
        inline.mkdir(parents=True, exist_ok=True)  # a root must exist to be resolved
        roots = ReadRoots.from_setting(self.settings.feed_task_roots, default=Path.cwd(), also=[inline])
        paths, epochs, seed, ignored = rollout_request(body, inline)
        try:
            service = self.new_job(paths, epochs, seed, roots=roots)
        except (TaskFileError, SettingsError) as exc:
            raise feed.FeedError(f"start_rollout: {exc}") from None
        note = (f" ({', '.join(ignored)} ignored: the workers use their own settings)" if ignored else "")
        return service, note


def _check_servable(client, settings: Settings, job_id: str) -> None:
    """``--job J``: a job that is unknown, has no feed or is finished is refused in one line
    before anything is attached (a producer started for a finished job would do nothing; a
    trainer would wait on it for ever)."""
    from broker.keys import Keys
    from broker.ledger import Ledger
    from broker.settings import redact_url

    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(client, settings)
    if ledger.job_spec(job_id) is None:
        raise SettingsError(f"--job {job_id}: no such job in Redis at {redact_url(settings.redis_url)} "
                            "(a finished job is forgotten once its retention passes)")
    if not feed.has_feed(client, keys, job_id):
        raise SettingsError(f"--job {job_id}: the job has no feed (only continuous jobs have one: "
                            "`interactor feed serve tasks.yaml`)")
    if feed.finished(client, keys, job_id, ledger.counts(job_id), settings.job_retention_s):
        raise SettingsError(f"--job {job_id}: the job is finished: no episode to run, no group ready or taken, "
                            "nothing left to produce (or no trainer took anything for the job retention, "
                            f"{settings.job_retention_s:g} s); start a new job from its task files")


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
            _check_servable(client, settings, job_id)
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
