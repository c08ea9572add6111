"""kombu's Redis transports with one client object per channel instead of one per command, and
the Sentinel one connecting by the address our URL parser read.

kombu's channel builds a new ``redis.Redis`` around its connection pool for every command it
sends outside the BRPOP loop: the unacked-hash write when a task arrives, the ack when it is
done (``Channel.conn_or_acquire``). ``redis.Redis.__init__`` copies its table of about two
hundred response callbacks each time, which made it about a twentieth of a worker's CPU with
single-turn episodes (py-spy, docs/benchmarks.md). A client holds no state of its own beyond
the pool (connections are taken from the pool per command, so one client serves every thread),
so the channel keeps one per pool and builds a new one only when kombu replaces the pool
after a connection loss. Its connections also get the quick clean-connection check of our own
pools (``broker.redisconn.QuickReadyParser``).

No ack emulation: kombu's Redis transport keeps every delivered message in an ``unacked`` hash
and index until it is acknowledged (a MULTI/EXEC when it arrives and another when it is acked:
two round trips and about seven commands per episode, and the message's JSON written again),
so that a dead worker's messages come back after the visibility timeout. The ledger does that
already, and sooner: an episode received and not started holds a reservation that expires
within the lease TTL (the sweeper sends it again), one that started holds a lease (the sweeper
re-runs it), and one whose message vanished before either is found by reconcile (queued in the
ledger, no message, no reservation) and sent again. A warm shutdown still gives back the
messages a worker holds and has not run (kombu's in-memory QoS restores them to the queue).

With a ``redis+sentinel://`` URL the broker is kombu's Sentinel transport, whose pool asks the
Sentinels for the primary (and again after a failover). kombu would read the Sentinels from
its own broker URL; ours reads them, the service, database and passwords from the
``sentinel_address`` transport option, which broker/redisconn.py fills from the one parse of
``REDIS_URL`` (broker/redisurl.py). The broker URL Celery is given only names the first
Sentinel, for its logs.
"""

from __future__ import annotations

import redis
from kombu.transport import redis as kombu_redis
from redis import sentinel

from broker.redisconn import parser_options


class _OneClientPerPool:
    ack_emulation = False  # the ledger's reservations, leases and reconcile bring lost messages back
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


class Channel(_OneClientPerPool, kombu_redis.Channel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(_OneClientPerPool, kombu_redis.SentinelChannel):
    from_transport_options = kombu_redis.SentinelChannel.from_transport_options + ("sentinel_address",)
    sentinel_address = None  # broker.redisurl.SentinelAddress

    def _connparams(self, asynchronous=False):
        params = super()._connparams(asynchronous=asynchronous)
        a = self.sentinel_address
        params.update(db=a.db, username=a.username or None, password=a.password or None)
        return params

    def _sentinel_managed_pool(self, asynchronous=False):
        """kombu's own, with the Sentinels taken from our address instead of the broker URL."""
        params = self._connparams(asynchronous)
        params.pop("host", None)
        params.pop("port", None)
        manager = sentinel.Sentinel(list(self.sentinel_address.sentinels), min_other_sentinels=0,
                                    sentinel_kwargs=self.sentinel_kwargs, **params)
        if asynchronous:  # kept so that kombu closes the Sentinels' connections with the channel
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        return manager.master_for(self.sentinel_address.service, redis.Redis, username=params.get("username"),
                                  password=params.get("password")).connection_pool


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"  # the name Celery's broker_transport setting takes
SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
