"""The Celery app every role shares, configured for hour-long episode tasks on Redis.

Why each setting (see the README's delivery guarantee):
* late ack + reject on worker lost: a task is acknowledged only after its episode finished, so
  a warm shutdown or a pool process that dies gives the message back (kombu's in-memory QoS).
* prefetch 1: a worker holds no more episodes than it runs; the rest stay in Redis for others.
* no ack emulation in the transport (broker/kombu_redis.py says why): a message is gone from
  Redis once a worker takes it; what a dead worker held comes back through the ledger (its
  reservation or lease lapses, or reconcile finds the episode queued with no message).
* msgpack/json only: no pickle, a pickled message is rejected and logged by kombu.
* no result backend: outcomes travel in the results stream, not in Celery results.
* cancel_long_running_tasks_on_connection_loss stays False: a Redis restart must not abort
  episodes that are halfway; their leases and records survive in Redis.
* worker_consumer: Celery's consumer with capped broker waits, so that under the gevent pool a
  slot freed by a finished episode takes the next one at once (workers/celery_consumer.py).
  The worker names it (workers/tasks.py passes it to ``make_app``): broker/ names nothing above it.
* broker_transport: kombu's Redis transport, keeping one client per channel
  (broker/kombu_redis.py), or its Sentinel transport for a ``redis+sentinel://`` URL. Both
  connect by the address broker/redisurl.py read (``broker_transport_options``), never by a
  URL of kombu's reading: the broker URL Celery is given is that address without its password
  (a one server's), or names the first Sentinel, for Celery's logs.
* remote control off unless ``worker_remote_control`` (broker/settings.py says why).
* per-task log lines ("received", "succeeded") are off (workers/tasks.py): at a thousand
  episodes a minute they cost more CPU than the bookkeeping they report.
"""

from __future__ import annotations

from celery import Celery

from broker.kombu_redis import SENTINEL_TRANSPORT, TRANSPORT
from broker.redisconn import broker_transport_options, redis_address
from broker.redisurl import SentinelAddress
from broker.settings import Settings

EPISODE_TASK = "interactor.run_episode"


def make_app(settings: Settings, *, main: str = "interactor", worker_consumer: str | None = None) -> Celery:
    """The Celery app. ``worker_consumer``: the consumer class a worker runs (``module:Class``),
    named by the worker that runs it (workers/tasks.py); Celery's own when None."""
    address = redis_address(settings)
    broker, transport = address.shown(), TRANSPORT  # what Celery logs; the transport connects by the address
    if isinstance(address, SentinelAddress):
        host, port = address.sentinels[0]
        broker, transport = f"sentinel://{f'[{host}]' if ':' in host else host}:{port}/{address.db}", SENTINEL_TRANSPORT
    app = Celery(main, broker=broker, set_as_current=False)
    app.conf.update(
        task_serializer="msgpack",
        accept_content=["msgpack", "json"],
        result_accept_content=["msgpack", "json"],
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.concurrency,
        # The pool is chosen by the worker's -P (interactor/cli.py): Celery warns that gevent
        # must not be chosen by this setting, and it would take it from here too late anyway.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_send_task_events=False,
        worker_enable_remote_control=settings.worker_remote_control,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport=transport,
        broker_transport_options=broker_transport_options(settings),
        broker_heartbeat=0,
        task_default_queue=settings.queue,
        task_create_missing_queues=True,
        task_routes={EPISODE_TASK: {"queue": settings.queue}},
        # Time limits do nothing in the threads pool; the step loop enforces the budget itself.
        task_time_limit=None,
        task_soft_time_limit=None,
    )
    if worker_consumer is not None:
        app.conf.worker_consumer = worker_consumer
    return app
