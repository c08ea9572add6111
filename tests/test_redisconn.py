"""The quick clean-connection check our Redis pools and kombu's channel use
(broker/redisconn.py QuickReadyParser), against a real Redis: it is the parser our pools and
kombu's channel use, and a pooled connection the server closed is replaced, not used."""

from __future__ import annotations

import redis

from broker.celery_app import make_app
from broker.redisconn import QuickReadyParser, connect


def _one_connection(settings):
    return connect(settings, max_connections=1)


def _parser_of(client: redis.Redis):
    assert client.ping()
    conn = client.connection_pool.get_connection()
    try:
        return conn._parser
    finally:
        client.connection_pool.release(conn)


def test_our_pools_and_kombus_channel_use_the_quick_check(settings):
    assert isinstance(_parser_of(_one_connection(settings)), QuickReadyParser)
    app = make_app(settings)
    with app.connection_for_write() as c:
        kclient = c.default_channel._create_client()
        assert kclient is c.default_channel._create_client()  # one client per channel
        assert isinstance(_parser_of(kclient), QuickReadyParser)


def test_a_connection_the_server_closed_is_replaced_not_used(settings, redis_client):
    client = _one_connection(settings)
    client.client_setname("quick-check-victim")
    my_id = client.client_id()
    killed = redis_client.client_kill_filter(_id=my_id)
    assert killed == 1
    # The pool's only connection is closed at the server; the next command must reconnect.
    assert client.set(f"{settings.key_prefix}:k", "v") is True
    assert client.get(f"{settings.key_prefix}:k") == b"v"
    assert client.client_id() != my_id


def test_without_hiredis_extras_the_options_are_plain(settings):
    # The options are only ever the parser class; a client built with them talks to Redis.
    r = redis.Redis.from_url(settings.redis_url, parser_class=QuickReadyParser)
    assert r.ping()
