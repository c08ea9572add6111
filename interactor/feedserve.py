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
    """What the routes call: a FeedService once a job is served (``start`` makes one when the
    server was started without a job, for ``/start_rollout``)."""

    def __init__(self, service=None, start: Callable[[list[str]], Any] | None = None):
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
            return {"success": True, "message": f"rollout already running: job {app.service.job_id}",
                    "job_id": app.service.job_id}
        if app.start is None:
            raise feed.FeedError("this feed server serves one job and cannot start another", 409)
        files = body.get("task_files") or body.get("config")
        files = [files] if isinstance(files, str) else files
        if not files or not all(isinstance(f, str) for f in files):
            raise feed.FeedError("start_rollout needs 'task_files' (a list of task file paths) or 'config'")
        app.service = app.start(files)
        return {"success": True, "message": f"rollout started: job {app.service.job_id}",
                "job_id": app.service.job_id}


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
    sp.add_argument("tasks", nargs="*", help="task files to run as a continuous job (else --job)")
    sp.add_argument("--job", help="serve the feed of a job already in Redis")
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
    # A filter off the allow-list (or not importable) stops us before anything starts.
    from interactor.feed import load_filter

    try:
        load_filter(settings.feed_filter, settings.feed_filters)
    except feed.FeedError as exc:
        raise SettingsError(str(exc)) from None
    return serve(settings, tasks=args.tasks, job_id=args.job, epochs=args.epochs, seed=args.seed,
                 workers=args.workers, fleet=not args.no_fleet)


def serve(settings: Settings, *, tasks: list[str] | None = None, job_id: str | None = None, epochs: int = 0,
          seed: int = 0, workers: int | None = None, fleet: bool = True,
          ready: Callable[[str], None] | None = None) -> int:
    """Run the feed server until SIGINT/SIGTERM."""
    import signal

    from broker.embedded import EmbeddedRedis
    from broker.keys import Keys
    from broker.redisconn import connect
    from consumer.storage import open_store
    from interactor.feed import FeedService
    from producer.continuous import ContinuousProducer, create_continuous_job

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run_dir = Path(settings.run_dir)
    embedded = local = None
    threads: list[threading.Thread] = []
    try:
        if tasks and not settings.redis_url:
            embedded = EmbeddedRedis(run_dir / "redis", port=None)
            embedded.start()
            settings = settings.replace(redis_url=embedded.url)
        client = connect(settings)
        store = open_store(settings.results_store)
        if tasks:
            job = create_continuous_job(client, settings, tasks, epochs=epochs, seed=seed)
            job_id = job.job_id
            if fleet:
                from interactor.localrun import LocalFleet

                local = LocalFleet(settings, workers, run_dir / "logs")
                local.start()
        if job_id is None:
            raise SettingsError("no job to serve")
        service = FeedService(client, settings, job_id, store)
        service.backfill()
        cfg = service.cfg
        if cfg.continuous:
            producer = ContinuousProducer(client, settings, job_id)
            threads.append(threading.Thread(target=producer.run, args=(stop,), daemon=True, name="producer"))
        server = make_server(FeedApp(service), settings.feed_host, settings.feed_port, settings.feed_token.reveal())
        threads.append(threading.Thread(target=server.serve_forever, daemon=True, name="feed-http"))
        for t in threads:
            t.start()
        url = f"http://{settings.feed_host}:{server.server_address[1]}"
        print(f"feed of job {job_id} at {url}", flush=True)
        if ready is not None:
            ready(url)
        last_backfill = 0.0
        import time

        while not stop.wait(1.0):
            if local is not None:
                local.supervise()
            if time.monotonic() - last_backfill > 30:
                last_backfill = time.monotonic()
                service.backfill()  # what the consumer could not announce (a failure outside a batch)
        server.shutdown()
        return 0
    finally:
        stop.set()
        if local is not None:
            local.stop(settings.shutdown_grace_s + 10)
        if embedded is not None:
            embedded.stop()
