"""``interactor ui``: registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``.
Flask is imported only when the command runs."""

from __future__ import annotations

from broker.settings import REDIS, REDRIVE, STORE
from interactor.ui import DEFAULT_PORT


def register(sub, add) -> None:
    # The store, and Redis for live state (and re-drives) when a URL is set.
    sp = add("ui", cmd_ui, "browse results in a web page: jobs, groups, episodes and their transcripts, dead letters",
             reads=(STORE, REDIS, REDRIVE))
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on; 0.0.0.0: every interface (default: %(default)s)")
    sp.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port (default: %(default)s)")
    sp.add_argument("--allow-actions", action="store_true",
                    help="enable re-driving dead letters from the page; prints the token the page needs")
    sp.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                    help="another Host header to answer (the name people use to reach it: a container's "
                         "published port, a proxy); with --host 0.0.0.0 only these are answered")


def cmd_ui(args) -> int:
    from interactor.common import settings_from_args
    from interactor.ui.server import UIServer, open_source

    settings = settings_from_args(args)
    source = open_source(settings)
    server = UIServer(source, args.host, args.port, allow_actions=args.allow_actions,
                      allow_hosts=tuple(args.allow_host))
    redis = source.live.url_shown if source.live else "none (store only; --redis-url or REDIS_URL for live state)"
    print(f"results browser on {server.url}  (store {settings.results_store_shown}; Redis {redis}); Ctrl-C to stop",
          flush=True)
    if args.allow_actions:
        print(f"actions are on (re-drive): open {server.action_url}\n  or paste this token when the page asks: "
              f"{server.token}", flush=True)
    server.serve_until_signal()
    return 0
