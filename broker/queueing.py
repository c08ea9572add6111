"""kombu's Redis transport, as far as interactor needs to know it: sending episode tasks
fast, and reading what is queued or in flight (sweeper, reconcile, metrics, status).

Layout (kombu.transport.redis; ``tests/test_metrics.py`` holds us to it):

* queue ``q`` is the list ``q``; priority ``p`` (3, 6, 9) of it is ``q\x06\x16p``
  (:func:`sub_queues`). Producers LPUSH, workers BRPOP: the oldest message is at index -1.
* no ``unacked`` hash: the transport runs without kombu's ack emulation (broker/kombu_redis.py),
  so a delivered message is gone from Redis; the ledger knows where its episode is.
* ``_kombu.binding.<exchange>`` sets name the queues a worker declared.

Sending: tens of thousands of tasks per second.

``app.send_task`` costs about 1 ms a message in Celery's own Python, which makes a 100k-episode
job take minutes to enqueue. The message is small and always the same shape (Celery task
protocol 2 in kombu's Redis envelope), so we build it from a template and LPUSH it in
pipelines. ``tests/test_queueing.py`` holds the template to what Celery itself produces, so a
Celery upgrade that changes the format fails a test instead of the workers.

The task carries only ``(job_id, episode_id)``: the episode spec lives once in the ledger,
which is what re-drive and reconcile read too.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import socket
import time
from typing import Iterable

import msgpack
import redis

from broker.celery_app import EPISODE_TASK

PRIORITY_SEP = "\x06\x16"  # kombu's Channel.sep
PRIORITY_STEPS = (0, 3, 6, 9)
BINDING_PREFIX = "_kombu.binding."

_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

# The body is msgpack [args, kwargs, embed]: a 3-array header, then the args, then two constant
# parts packed once.
_BODY_TAIL = msgpack.packb({}, use_bin_type=True) + msgpack.packb(_EMBED, use_bin_type=True)
_packb = msgpack.Packer(use_bin_type=True).pack
_dumps = json.JSONEncoder(ensure_ascii=True).encode


def _template() -> str:
    """The JSON envelope with ``%(name)s`` holes, produced by json itself (so the layout is
    exactly what ``json.dumps`` of the envelope gives) from sentinel values."""
    hole = {name: f"@@{name}@@" for name in ("body", "id", "argsrepr", "queue", "tag")}
    envelope = {
        "body": hole["body"],
        "content-encoding": "binary",
        "content-type": "application/x-msgpack",
        "headers": {
            "lang": "py", "task": EPISODE_TASK, "id": hole["id"], "shadow": None, "eta": None,
            "expires": None, "group": None, "group_index": None, "retries": 0,
            "timelimit": [None, None], "root_id": hole["id"], "parent_id": None,
            "argsrepr": hole["argsrepr"], "kwargsrepr": "{}", "origin": _ORIGIN,
            "ignore_result": True, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
        },
        "properties": {
            "correlation_id": hole["id"], "reply_to": "", "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": hole["queue"]},
            "priority": 0, "body_encoding": "base64", "delivery_tag": hole["tag"],
        },
    }
    text = json.dumps(envelope).replace("%", "%%")
    for name, value in hole.items():
        text = text.replace(json.dumps(value), f"%({name})s")
    return text


_TEMPLATE = _template()


def _uuid4(h: str) -> str:
    """A version-4 UUID string from 32 random hex digits (``str(uuid.uuid4())`` at a quarter
    of the cost)."""
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) & 3]}{h[17:20]}-{h[20:32]}"


def _message(job_id: str, episode_id: str, queue_json: str, rand_hex: str) -> bytes:
    args = [job_id, episode_id]
    body = binascii.b2a_base64(b"\x93" + _packb(args) + _BODY_TAIL, newline=False).decode("ascii")
    task_id = _uuid4(rand_hex[:32])
    return (_TEMPLATE % {
        "body": f'"{body}"', "id": f'"{task_id}"', "argsrepr": _dumps(repr(args)), "queue": queue_json,
        "tag": f'"{_uuid4(rand_hex[32:64])}"',
    }).encode()


def task_message(job_id: str, episode_id: str, queue: str) -> bytes:
    """One Celery task message (protocol 2, kombu's Redis envelope) for the episode task."""
    return _message(job_id, episode_id, _dumps(queue), os.urandom(32).hex())


def push_episodes(client: redis.Redis, items: Iterable[tuple[str, str, str]], chunk: int = 5000) -> int:
    """Enqueue ``(job_id, episode_id, queue)`` items, the one way every role sends episodes: per round trip, one LPUSH per queue
    carrying up to ``chunk`` messages (a reply per command instead of per message). Order is
    kept: Celery pops from the right, so within a queue the first item sent runs first.
    Returns how many were sent."""
    sent = 0
    by_queue: dict[str, list[bytes]] = {}
    quoted: dict[str, str] = {}
    rand = ""
    pos = 0

    def flush() -> None:
        if not by_queue:
            return
        pipe = client.pipeline(transaction=False)
        for queue, messages in by_queue.items():
            pipe.lpush(queue, *messages)
        pipe.execute()
        by_queue.clear()

    for job_id, episode_id, queue in items:
        if pos == len(rand):
            rand, pos = os.urandom(32 * 1024).hex(), 0
        q = quoted.get(queue)
        if q is None:
            q = quoted[queue] = _dumps(queue)
        msgs = by_queue.get(queue)
        if msgs is None:
            msgs = by_queue[queue] = []
        msgs.append(_message(job_id, episode_id, q, rand[pos : pos + 64]))
        pos += 64
        sent += 1
        if sent % chunk == 0:
            flush()
    flush()
    return sent


def decode_task_args(raw: bytes) -> tuple[str, str] | None:
    """``(job_id, episode_id)`` of an episode task message, or None for anything else."""
    try:
        return task_args(json.loads(raw))
    except ValueError:
        return None


def task_args(envelope) -> tuple[str, str] | None:
    """The same, for an envelope already parsed (kombu's unacked hash holds it in a list)."""
    try:
        headers = envelope.get("headers") if isinstance(envelope, dict) else None
        if not isinstance(headers, dict) or headers.get("task") != EPISODE_TASK:
            return None
        body = base64.b64decode(envelope["body"])
        if envelope.get("content-type") == "application/x-msgpack":
            args = msgpack.unpackb(body, raw=False)[0]
        elif envelope.get("content-type") == "application/json":
            args = json.loads(body)[0]
        else:
            return None
        return str(args[0]), str(args[1])
    except (ValueError, KeyError, IndexError, TypeError, msgpack.UnpackException):
        return None


# --- reading the transport ---------------------------------------------------------------
def sub_queues(queue: str) -> list[tuple[int, str]]:
    """``[(priority, list name)]`` of one Celery queue."""
    return [(p, queue if p == 0 else f"{queue}{PRIORITY_SEP}{p}") for p in PRIORITY_STEPS]


def declared_queues(client: redis.Redis) -> set[str]:
    """Queues some worker declared (kombu's binding sets), Celery's own control queues aside."""
    found = set()
    for key in client.scan_iter(match=BINDING_PREFIX + "*", count=1000):
        try:
            members = client.smembers(key)
        except redis.ResponseError:  # not a binding set
            continue
        for m in members:
            q = (m.decode(errors="replace") if isinstance(m, bytes) else m).split(PRIORITY_SEP)[-1]
            if q and not q.endswith(".pidbox") and not q.startswith("celery@") and "reply.celery" not in q:
                found.add(q)
    return found


def inflight_per_queue(client: redis.Redis, keys, queue_of) -> dict[str, int]:
    """Episodes delivered to a worker and not finished (reserved or running), per queue: the
    ledger's live leases and reservations, each episode once (a delivered message leaves no
    copy in Redis: broker/kombu_redis.py). ``queue_of(job_id, episode_ids)`` names the queue of
    each (the ledger's episode specs)."""
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.zrangebyscore(keys.running, now_ms, "+inf")
    pipe.zrangebyscore(keys.reserved, now_ms, "+inf")
    by_job: dict[str, set[str]] = {}
    for part in pipe.execute():
        for m in part:
            job_id, _, episode_id = (m.decode() if isinstance(m, bytes) else m).partition(" ")
            by_job.setdefault(job_id, set()).add(episode_id)
    out: dict[str, int] = {}
    for job_id, episodes in by_job.items():
        for q in queue_of(job_id, sorted(episodes)):
            out[q] = out.get(q, 0) + 1
    return out


def waiting_episodes(client: redis.Redis, queues: list[str]) -> set[tuple[str, str]]:
    """``(job_id, episode_id)`` of every task message waiting in these queues (every priority
    sub-queue). A message a worker took is not here: its episode is reserved, running, or
    found by reconcile."""
    found: set[tuple[str, str]] = set()
    names = set(queues)
    for q in queues:
        names.update(k.decode() for k in client.scan_iter(match=f"{q}{PRIORITY_SEP}*"))
    for q in names:
        for raw in client.lrange(q, 0, -1):
            args = decode_task_args(raw)
            if args:
                found.add(args)
    return found
