"""kombu's Redis transport with one client object per channel instead of one per command.

kombu's channel builds a new ``redis.Redis`` around its connection pool for every command it
sends outside the BRPOP loop: the unacked-hash write when a task arrives, the ack when it is
done (``Channel.conn_or_acquire``). ``redis.Redis.__init__`` copies its table of about two
hundred response callbacks each time, which made it about a twentieth of a worker's CPU with
single-turn episodes (py-spy, docs/benchmarks.md). A client holds no state of its own beyond
the pool (connections are taken from the pool per command, so one client serves every thread),
so the channel keeps one per pool and builds a new one only when kombu replaces the pool
after a connection loss. Its connections also get the quick clean-connection check of our own
pools (``broker.redisconn.QuickReadyParser``). Nothing else differs from
``kombu.transport.redis``.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from broker.redisconn import parser_options


class Channel(kombu_redis.Channel):
    _kept_client = None  # (pool, client)

    def _create_client(self, asynchronous=False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        kept = self._kept_client
        if kept is None or kept[0] is not pool:
            kept = self._kept_client = (pool, super()._create_client(asynchronous=False))
        return kept[1]


    def _connparams(self, asynchronous=False):
        params = super()._connparams(asynchronous=asynchronous)
        params.update(parser_options())  # the same quick clean-connection check as our own pools
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"  # the name Celery's broker_transport setting takes
