"""A trainer process for the feed's fault tests: takes groups over HTTP with the stdlib client
and says what it got, one line per group (flushed), so that a test can SIGKILL it at a known
point. ``--hold`` keeps what it took unacknowledged and waits to be killed.

    python -m tests.feed_trainer URL NAME --groups N [--hold] [--batch B]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from interactor.feed_client import Feed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("trainer")
    p.add_argument("--groups", type=int, required=True, help="stop after this many groups")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hold", action="store_true", help="never acknowledge; sleep once N are taken")
    p.add_argument("--deadline", type=float, default=300.0)
    args = p.parse_args(argv)
    feed = Feed(args.url, trainer=args.trainer)
    got = 0
    end = time.monotonic() + args.deadline
    while got < args.groups and time.monotonic() < end:
        groups = feed.take(args.batch, timeout=1.0)
        for g in groups:
            print(json.dumps({"took": g["group_id"], "redelivered": g["redelivered"]}), flush=True)
        if groups and not args.hold:
            print(json.dumps({"acked": feed.ack([g["group_id"] for g in groups])["acked"]}), flush=True)
        got += len(groups)
    if args.hold:
        print(json.dumps({"holding": got}), flush=True)
        while True:
            time.sleep(60)
    return 0 if got >= args.groups else 1


if __name__ == "__main__":
    sys.exit(main())
