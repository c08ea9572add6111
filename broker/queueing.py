"""Sending episode tasks: tens of thousands per second.

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
import json
import os
import socket
import uuid
from typing import Iterable

import msgpack
import redis

from broker.app import EPISODE_TASK

_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def task_message(job_id: str, episode_id: str, queue: str) -> bytes:
    task_id = str(uuid.uuid4())
    body = base64.b64encode(msgpack.packb([[job_id, episode_id], {}, _EMBED], use_bin_type=True)).decode()
    return json.dumps({
        "body": body,
        "content-encoding": "binary",
        "content-type": "application/x-msgpack",
        "headers": {
            "lang": "py", "task": EPISODE_TASK, "id": task_id, "shadow": None, "eta": None,
            "expires": None, "group": None, "group_index": None, "retries": 0,
            "timelimit": [None, None], "root_id": task_id, "parent_id": None,
            "argsrepr": repr([job_id, episode_id]), "kwargsrepr": "{}", "origin": _ORIGIN,
            "ignore_result": True, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
        },
        "properties": {
            "correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0, "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
        },
    }).encode()


def send_episodes(client: redis.Redis, items: Iterable[tuple[str, str, str]], chunk: int = 5000) -> int:
    """Enqueue ``(job_id, episode_id, queue)`` items; returns how many were sent."""
    sent = 0
    pipe = client.pipeline(transaction=False)
    for job_id, episode_id, queue in items:
        pipe.lpush(queue, task_message(job_id, episode_id, queue))
        sent += 1
        if sent % chunk == 0:
            pipe.execute()
    pipe.execute()
    return sent


def decode_task_args(raw: bytes) -> tuple[str, str] | None:
    """``(job_id, episode_id)`` of an episode task message, or None for anything else."""
    try:
        envelope = json.loads(raw)
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
