"""Our hand-built task messages against what Celery itself puts in Redis."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest
from kombu.serialization import prepare_accept_content

from broker.celery_app import EPISODE_TASK, make_app
from broker.queueing import decode_task_args, push_episodes, task_message


@pytest.fixture
def app(settings):
    app = make_app(settings)
    yield app
    app.close()


def celery_message(app, redis_client, queue: str, args, name: str = EPISODE_TASK, **opts) -> bytes:
    """Send one task with Celery and pop the raw message it LPUSH-ed."""
    before = redis_client.llen(queue)
    app.send_task(name, args=args, queue=queue, **opts)
    raw = redis_client.lrange(queue, 0, 0)
    assert redis_client.llen(queue) == before + 1
    return raw[0]


def test_celery_pushes_to_a_plain_list(app, redis_client, settings):
    raw = celery_message(app, redis_client, settings.queue, ["j", "e"])
    assert redis_client.type(settings.queue) == b"list"
    assert json.loads(raw)["headers"]["task"] == EPISODE_TASK


def test_envelope_top_level_keys_match_celery(app, redis_client, settings):
    q = settings.queue
    theirs = json.loads(celery_message(app, redis_client, q, ["job1", "job1.1.1.1.1"]))
    ours = json.loads(task_message("job1", "job1.1.1.1.1", q))
    assert set(ours) == set(theirs)
    for k in ("content-type", "content-encoding"):
        assert ours[k] == theirs[k]


def test_envelope_header_keys_match_celery(app, redis_client, settings):
    q = settings.queue
    theirs = json.loads(celery_message(app, redis_client, q, ["job1", "job1.1.1.1.1"]))
    ours = json.loads(task_message("job1", "job1.1.1.1.1", q))
    assert set(ours["headers"]) == set(theirs["headers"])
    for k in ("lang", "task", "shadow", "eta", "expires", "group", "group_index", "retries", "timelimit",
              "parent_id", "argsrepr", "kwargsrepr", "replaced_task_nesting", "stamped_headers", "stamps"):
        assert ours["headers"][k] == theirs["headers"][k], k
    assert ours["headers"]["root_id"] == ours["headers"]["id"]


def test_envelope_property_keys_match_celery(app, redis_client, settings):
    q = settings.queue
    theirs = json.loads(celery_message(app, redis_client, q, ["job1", "job1.1.1.1.1"]))
    ours = json.loads(task_message("job1", "job1.1.1.1.1", q))
    assert set(ours["properties"]) == set(theirs["properties"])
    assert set(ours["properties"]["delivery_info"]) == set(theirs["properties"]["delivery_info"])
    assert ours["properties"]["delivery_info"] == theirs["properties"]["delivery_info"] == {
        "exchange": "", "routing_key": q}
    for k in ("delivery_mode", "priority", "body_encoding"):
        assert ours["properties"][k] == theirs["properties"][k], k
    assert ours["properties"]["correlation_id"] == ours["headers"]["id"]


def test_body_decodes_like_celerys(app, redis_client, settings):
    q = settings.queue
    theirs = json.loads(celery_message(app, redis_client, q, ["job1", "job1.1.1.1.1"]))
    ours = json.loads(task_message("job1", "job1.1.1.1.1", q))
    t = msgpack.unpackb(base64.b64decode(theirs["body"]), raw=False)
    o = msgpack.unpackb(base64.b64decode(ours["body"]), raw=False)
    assert o == t
    assert o[0] == ["job1", "job1.1.1.1.1"] and o[1] == {}


def test_fresh_ids_per_message(settings):
    a = json.loads(task_message("j", "e", settings.queue))
    b = json.loads(task_message("j", "e", settings.queue))
    assert a["headers"]["id"] != b["headers"]["id"]
    assert a["properties"]["delivery_tag"] != b["properties"]["delivery_tag"]


def test_celery_worker_side_accepts_our_message(app, settings):
    """A Celery worker's Request built from our message runs the task with our args."""
    from celery.worker.request import Request

    got = []

    @app.task(name=EPISODE_TASK)
    def episode(job_id, episode_id):
        got.append((job_id, episode_id))

    with app.connection_for_read() as conn:
        ch = conn.default_channel
        msg = ch.Message(json.loads(task_message("job1", "job1.1.1.1.1", settings.queue)), channel=ch)
        msg.accept = prepare_accept_content(app.conf.accept_content)
        req = Request(msg, app=app, task=episode)
        assert req.task_name == EPISODE_TASK
        req.execute()
    assert got == [("job1", "job1.1.1.1.1")]


# --- decode_task_args --------------------------------------------------------------------


def test_decode_round_trips_ours(settings):
    assert decode_task_args(task_message("job1", "job1.2.3.4.5", settings.queue)) == ("job1", "job1.2.3.4.5")


def test_decode_round_trips_celerys(app, redis_client, settings):
    raw = celery_message(app, redis_client, settings.queue, ["job9", "job9.1.1.1.2"])
    assert decode_task_args(raw) == ("job9", "job9.1.1.1.2")


def test_decode_celerys_json_serialized(app, redis_client, settings):
    raw = celery_message(app, redis_client, settings.queue, ["job9", "job9.1.1.1.3"], serializer="json")
    assert json.loads(raw)["content-type"] == "application/json"
    assert decode_task_args(raw) == ("job9", "job9.1.1.1.3")


def test_decode_other_task_name_is_none(app, redis_client, settings):
    raw = celery_message(app, redis_client, settings.queue, ["job1", "e1"], name="something.else")
    assert decode_task_args(raw) is None
    env = json.loads(task_message("job1", "e1", settings.queue))
    env["headers"]["task"] = "interactor.other"
    assert decode_task_args(json.dumps(env).encode()) is None


def _with(**changes) -> bytes:
    env = json.loads(task_message("job1", "e1", "q"))
    for k, v in changes.items():
        if v is _DROP:
            env.pop(k.replace("_", "-"), None)
        else:
            env[k.replace("_", "-")] = v
    return json.dumps(env).encode()


_DROP = object()


@pytest.mark.parametrize("raw", [
    b"",
    b"not json",
    b"\xff\xfe\x00",
    b"{}",
    b'{"headers": {}}',
    b'{"headers": {"task": "interactor.run_episode"}}',
    _with(body=_DROP),
    _with(body="!!!not base64!!!"),
    _with(body=base64.b64encode(b"\xc1\xc1\xc1").decode()),  # not msgpack
    _with(body=base64.b64encode(msgpack.packb([["only-one"], {}, {}])).decode()),
    _with(body=base64.b64encode(msgpack.packb([], use_bin_type=True)).decode()),
    _with(body=base64.b64encode(msgpack.packb(7)).decode()),
    _with(content_type="application/x-python-serialize"),  # pickle: never decoded
    _with(content_type=_DROP),
], ids=lambda r: repr(r[:40]))
@pytest.mark.unit
def test_decode_garbage_is_none(raw):
    assert decode_task_args(raw) is None


@pytest.mark.parametrize("raw", [
    b"[1, 2]",
    b'"a string"',
    b"42",
    b"null",
    b'{"headers": "not a map"}',
    b'{"headers": null}',
], ids=repr)
@pytest.mark.unit
def test_decode_valid_json_but_not_an_envelope_is_none(raw):
    # BUG (broker/queueing.py, decode_task_args): envelope.get / headers.get raise AttributeError
    # for JSON that is not an object, and AttributeError is not in the caught tuple.
    assert decode_task_args(raw) is None


# --- no pickle ---------------------------------------------------------------------------


def test_no_pickle_anywhere(app, redis_client, settings):
    celery_message(app, redis_client, settings.queue, ["j", "e1"])
    push_episodes(redis_client, [("j", "e2", settings.queue)])
    for raw in redis_client.lrange(settings.queue, 0, -1):
        env = json.loads(raw)
        assert "pickle" not in env["content-type"] and "python-serialize" not in env["content-type"]
        assert env["content-type"] == "application/x-msgpack"
    assert "pickle" not in app.conf.accept_content
    assert "pickle" not in app.conf.result_accept_content
    assert app.conf.task_serializer == "msgpack"
    assert "pickle" not in task_message("j", "e", "q").decode()
