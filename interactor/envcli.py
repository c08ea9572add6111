"""``interactor serve-env``: host environment adapters (and your own env classes) over HTTP.

  interactor serve-env --port 8001                       every adapter whose library is installed
  interactor serve-env --envs reasoning_gym,textarena    just these
  interactor serve-env --env myenv=mypkg.envs:MyEnv      your own class (repeatable)
  interactor serve-env --list                            what is available here

The server prints ``listening on http://HOST:PORT`` once bound and stops on SIGTERM/SIGINT.
The fault-injecting stand-in for tests and demos remains ``python -m examples.envserver``.
"""

from __future__ import annotations

import argparse
import sys


def cmd_serve_env(args) -> int:
    from envs.http import serve_until_signal
    from envs import ADAPTERS, install_hint, installed
    from envs.base import valid_object_path
    from envs.serve_env import AdapterEnvServer, default_registry

    if args.list:
        for name, path in ADAPTERS.items():
            state = "available" if installed(name) else f"not installed ({install_hint(name)})"
            print(f"{name:14s} {path:55s} {state}")
        return 0
    only = [n.strip() for n in (args.envs or "").split(",") if n.strip()] or None
    try:
        registry = default_registry(only)
    except ValueError as exc:
        print(f"interactor serve-env: {exc}", file=sys.stderr)
        return 2
    if only:
        missing = [n for n in only if n not in registry]
        if missing:
            print(f"interactor serve-env: not installed here: {', '.join(missing)} "
                  f"({'; '.join(install_hint(n) for n in missing)})", file=sys.stderr)
            return 2
    for item in args.env or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not valid_object_path(path):
            print(f"interactor serve-env: --env expects NAME=module:Class, got {item!r}", file=sys.stderr)
            return 2
        registry[name] = path
    server = AdapterEnvServer(args.host, args.port, registry=registry, latency_ms=args.latency_ms,
                              error_rate=args.error_rate, fault_seed=args.fault_seed, verbose=args.verbose)
    print(f"serving envs: {', '.join(server.env_names())}", flush=True)
    return serve_until_signal(server)


def register(sub, add) -> None:  # noqa: ARG001 - serve-env needs no settings flags
    sp = sub.add_parser("serve-env", help="host environment adapters (reasoning-gym, textarena, ...) over HTTP",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on; 0.0.0.0: every interface (default: %(default)s)")
    sp.add_argument("--port", type=int, default=0, help="0 picks a free port (default: %(default)s)")
    sp.add_argument("--envs", help="comma-separated adapter names (default: every installed one)")
    sp.add_argument("--env", action="append", metavar="NAME=module:Class", help="also serve your own env class")
    sp.add_argument("--list", action="store_true", help="list the adapters and whether they are installed")
    sp.add_argument("--latency-ms", type=float, default=0.0, help="sleep per env call, testing (default: 0)")
    sp.add_argument("--error-rate", type=float, default=0.0,
                    help="fraction of env calls answered 500, testing (default: 0)")
    sp.add_argument("--fault-seed", type=int, default=0,
                    help="seed of the injected faults' random choices (default: %(default)s)")
    sp.add_argument("--verbose", action="store_true", help="log every request and traceback to stderr")
    sp.set_defaults(fn=cmd_serve_env)
