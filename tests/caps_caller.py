"""A worker process's stand-in for the caps' process tests (tests/test_caps_processes.py): one
FleetGate (workers/fleetcaps.py) whose callers each borrow a slot of one cap and, holding it,
make one call to the test's probe server, which counts the calls in flight across every
process. Calls follow each other back to back until SIGTERM; then the gate gives its slots
back and the process exits. It prints "ready" once its gate exists.

    python -m tests.caps_caller REDIS_URL PREFIX NAME PROBE_URL --limit N --ttl S --callers C --hold S
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import urllib.request

from broker.caps import CAP_ENV_INSTANCES, Cap, FleetSlots
from broker.keys import Keys
from broker.redisconn import connect
from broker.settings import Settings
from workers.fleetcaps import FleetGate


class Stopped(Exception):
    """Raised by a waiting caller's check once the process is told to stop."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("redis_url")
    p.add_argument("prefix")
    p.add_argument("name")
    p.add_argument("probe_url")
    p.add_argument("--limit", type=int, required=True, help="the cap's slots")
    p.add_argument("--ttl", type=float, required=True, help="the slots' lease TTL (s)")
    p.add_argument("--callers", type=int, required=True)
    p.add_argument("--hold", type=float, required=True, help="how long each call lasts (s)")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    keys = Keys(args.prefix)
    client = connect(Settings.from_env({}, redis_url=args.redis_url, key_prefix=args.prefix))
    gate = FleetGate(FleetSlots(client, keys, int(args.ttl * 1000)), args.name, args.ttl)
    caps = [Cap.of(keys, CAP_ENV_INSTANCES, args.probe_url, args.limit)]
    url = f"{args.probe_url}/call?who={args.name}&hold={args.hold}"

    def check() -> None:
        if stop.is_set():
            raise Stopped()

    def caller() -> None:
        while not stop.is_set():
            try:
                token = gate.acquire(caps, check, None)
            except Stopped:
                return
            try:
                urllib.request.urlopen(url, timeout=120).read()
            except OSError as exc:  # the test reads stderr when something went wrong
                print(f"{args.name}: call failed: {exc!r}", file=sys.stderr, flush=True)
            finally:
                gate.release(caps, token)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(args.callers)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    stop.wait(600)
    stop.set()
    for t in threads:
        t.join(120)
    gate.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
