"""`interactor cache stats|clear`: the fleet's response cache (broker/cache.py) seen and emptied."""

from __future__ import annotations

import json

from broker.settings import REDIS


def register(sub, add) -> None:
    sp = add("cache", cmd_cache, "the response cache of jobs run with --cache: stats (answers kept, bytes, hits, "
                                 "misses, evicted) or clear (drop every answer)", reads=(REDIS,))
    sp.add_argument("action", choices=["stats", "clear"],
                    help="stats: what the cache holds and how often it answered; clear: drop every answer (a job "
                         "running with --cache asks the model again and stores anew)")
    sp.add_argument("--json", action="store_true", help="print it as JSON")


def cmd_cache(args) -> int:
    from broker.cache import ResponseCache
    from broker.keys import Keys
    from interactor.common import redis_for, settings_from_args

    settings = settings_from_args(args)
    cache = ResponseCache(redis_for(settings), Keys(settings.key_prefix), settings.cache_max_entries)
    if args.action == "clear":
        dropped = cache.clear()
        print(json.dumps({"cleared": dropped}) if args.json else f"response cache cleared: {dropped} answers dropped")
        return 0
    s = cache.stats()
    if args.json:
        print(json.dumps(s))
        return 0
    looked = s["hits"] + s["misses"]
    rate = f" ({100.0 * s['hits'] / looked:.1f}% hits)" if looked else ""
    print(f"response cache: {s['entries']} answers of at most {s['max_entries']}, {s['bytes']} bytes; "
          f"{s['hits']} hits, {s['misses']} misses{rate}; {s['evicted']} evicted")
    return 0
