"""push_episodes: the producer's bulk path (one LPUSH per queue per round trip)."""

from __future__ import annotations

import json

from broker.queueing import decode_task_args, push_episodes, task_message


class CountingClient:
    def __init__(self, client):
        self.client = client
        self.executes: list[list] = []

    def pipeline(self, *a, **kw):
        pipe = self.client.pipeline(*a, **kw)
        real = pipe.execute
        outer = self

        def execute(*ea, **ekw):
            outer.executes.append([len(args) - 2 for args, _ in pipe.command_stack])  # messages per LPUSH
            return real(*ea, **ekw)

        pipe.execute = execute
        return pipe


def test_push_episodes_queues_order_and_chunks(redis_client, settings):
    qa, qb = settings.queue, settings.queue + "-b"
    items = [("job1", f"job1.1.1.1.{i}", qa if i % 3 else qb) for i in range(1, 12)]
    client = CountingClient(redis_client)
    assert push_episodes(client, iter(items), chunk=4) == 11
    assert sum(sum(x) for x in client.executes) == 11
    assert [sum(x) for x in client.executes] == [4, 4, 3]
    assert all(len(x) <= 2 for x in client.executes)  # one LPUSH per queue per round trip
    for q in (qa, qb):
        want = [(j, e) for j, e, qq in items if qq == q]
        got = []
        while (raw := redis_client.rpop(q)) is not None:  # as Celery pops: from the right
            assert json.loads(raw)["properties"]["delivery_info"]["routing_key"] == q
            got.append(decode_task_args(raw))
        assert got == want  # first sent, first run


def test_push_episodes_messages_are_the_same_as_task_message(redis_client, settings):
    push_episodes(redis_client, [("j", "e1", settings.queue), ("j", "e2", settings.queue)])
    a, b = (json.loads(m) for m in redis_client.lrange(settings.queue, 0, -1))
    ref = json.loads(task_message("j", "e1", settings.queue))
    for env in (a, b):
        assert set(env) == set(ref) and set(env["headers"]) == set(ref["headers"])
        assert set(env["properties"]) == set(ref["properties"])
    assert a["headers"]["id"] != b["headers"]["id"]
    assert a["properties"]["delivery_tag"] != b["properties"]["delivery_tag"]
    assert len({a["headers"]["id"], a["properties"]["delivery_tag"], b["headers"]["id"],
                b["properties"]["delivery_tag"]}) == 4


def test_push_episodes_empty(redis_client, settings):
    assert push_episodes(redis_client, []) == 0
    assert redis_client.llen(settings.queue) == 0
