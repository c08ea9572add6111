"""The producer's enqueue rate: a large job planned from a task file and submitted (ledger and
queue), as ``interactor submit`` does, against an embedded Redis in this process."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.benchlog import log
from broker.embedded import EmbeddedRedis
from broker.redisconn import client_for
from broker.settings import Settings


@dataclass
class EnqueueResult:
    episodes: int = 0
    plan_s: float = 0.0
    enqueue_s: float = 0.0
    rate: float = 0.0  # episodes/s, plan + ledger + queue
    enqueue_rate: float = 0.0  # ledger + queue only
    errors: list[str] = field(default_factory=list)


def run_enqueue(n: int, work: Path, *, base: Settings | None = None) -> EnqueueResult:
    """A job of ``n`` episodes from a task file: plan (read + validate + expand) and submit
    (ledger + queue), as ``interactor submit`` does."""
    from producer.enqueue import plan, submit_plan

    folder = Path(tempfile.mkdtemp(prefix="enqueue-", dir=work))
    res = EnqueueResult(episodes=n)
    log(f"enqueue: a job of {n} episodes")
    with EmbeddedRedis(folder / "redis") as srv:
        settings = (base or Settings.from_env({})).replace(redis_url=srv.url, run_dir=str(folder),
                                                           env_base_url="http://127.0.0.1:9")
        client = client_for(srv.url)
        data = folder / "rows.jsonl"
        data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i, "steps": 20}) + "\n"
                                for i in range(max(1, n // 4))))
        tasks = folder / "tasks.yaml"
        tasks.write_text("environments:\n  - env_name: countdown\n    env_params: {system_bytes: 1500}\n"
                         f"    dataset: {data.name}\n    env_num: 4\n")
        t0 = time.perf_counter()
        planned = plan(settings, [str(tasks)], "bench-enqueue")
        res.plan_s = time.perf_counter() - t0
        sub = submit_plan(client, settings, planned)
        res.enqueue_s = sub.enqueue_s
        total = time.perf_counter() - t0
        queued = client.llen(settings.queue)
        if queued != len(planned.episodes):
            res.errors.append(f"{queued} tasks queued for {len(planned.episodes)} episodes")
        res.episodes = len(planned.episodes)
        res.rate = res.episodes / total
        res.enqueue_rate = res.episodes / res.enqueue_s
        client.close()
    shutil.rmtree(folder, ignore_errors=True)
    log(f"  {res.rate:.0f} episodes/s end to end (plan {res.plan_s:.2f}s, ledger+queue {res.enqueue_s:.2f}s)")
    return res
