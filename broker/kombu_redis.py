"""kombu's Redis transports with one client object per channel instead of one per command,
both connecting by the address our URL parser read.

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

kombu would read where Redis is from its own broker URL, with a parser that disagrees with ours
(it reads a unix socket's path as a database number, and passes a query's options to the
connection as keyword arguments). Ours read it instead, from the one parse of ``REDIS_URL``
(broker/redisurl.py) that broker/redisconn.py puts in the transport options:

* one server (``redis://``, ``rediss://``, ``unix://``): the ``server_address`` option. The
  channel's connections are made from :func:`broker.redisconn.server_options`, as our own pools
  are: a unix socket's connection class, path and no TCP-only options; TLS with certificates
  verified against ``redis_tls_ca``. The broker URL Celery is given is the address without its
  password (``ServerAddress.shown``), and kombu does not read it (``can_parse_url``): it is
  only what Celery logs.
* ``redis+sentinel://``: kombu's Sentinel transport, whose pool asks the Sentinels for the
  primary (and again after a failover), with the Sentinels, service, database and passwords of
  the ``sentinel_address`` option. The broker URL Celery is given only names the first
  Sentinel, for its logs.
"""

from __future__ import annotations

import redis
from kombu.transport import redis as kombu_redis
from redis import sentinel

from broker.redisconn import parser_options, server_options, without_tcp_options


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
    from_transport_options = kombu_redis.Channel.from_transport_options + ("server_address", "redis_tls_ca")
    server_address = None  # broker.redisurl.ServerAddress
    redis_tls_ca = ""

    def _server_options(self) -> dict:
        if self.server_address is None:
            raise ValueError("broker_transport_options names no server_address: make the Celery app with "
                             "broker.celery_app.make_app")
        return server_options(self.server_address, self.redis_tls_ca)

    @property
    def connection_class(self):
        """The address's (TCP, TLS or unix socket): kombu wraps it for its event loop."""
        return self._server_options()["connection_class"]

    def _connparams(self, asynchronous=False):
        params = super()._connparams(asynchronous=asynchronous)  # pool size, timeouts, kombu's connection class
        for where in ("host", "port", "path"):  # kombu's reading of the broker URL, replaced by ours
            params.pop(where, None)
        ours = self._server_options()
        del ours["connection_class"]  # kombu's subclass of it (connection_class above) stays
        return without_tcp_options(self.server_address, params | ours)


class Transport(kombu_redis.Transport):
    Channel = Channel
    can_parse_url = True  # kombu leaves the broker URL alone: the channel connects by server_address

    def as_uri(self, uri: str, include_password=False, mask="**") -> str:
        return uri  # the address without its password (celery_app.make_app), as Celery shows it


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
