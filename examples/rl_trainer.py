"""A small online-RL trainer loop against ``interactor feed serve`` (no GPU, no model: the
"training" is a stand-in, the loop is the real one).

Each step it takes a batch of complete GRPO groups, "trains" on their advantages, pushes new
weights to the model server (the stand-in's ``POST /weights``, which makes it a little more
skilled), acknowledges the groups and publishes the new version, so that steps sampled from now
on carry it and the feed can hold back groups sampled by weights too old (``--max-staleness``).

    python -m examples.rl_trainer --feed http://127.0.0.1:8700 --model http://127.0.0.1:8000 --steps 10

Uses only the stdlib client (interactor/feed_client.py), as a trainer's own environment would.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from interactor.feed_client import Feed


def push_weights(model_root: str, version: int) -> dict:
    """A trainer's weight sync, in miniature: the stand-in's POST /weights."""
    req = urllib.request.Request(model_root.rstrip("/") + "/weights", data=json.dumps({"version": version}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def train(feed_url: str, *, model_root: str = "", steps: int = 10, batch: int = 4, trainer: str = "demo-trainer",
          timeout_s: float = 60.0, say=print) -> dict:
    """Run ``steps`` training steps; returns the mean reward per step and what the feed says."""
    feed = Feed(feed_url, trainer=trainer)
    version = feed.version() or 0
    if model_root:
        push_weights(model_root, version)
    feed.set_version(version)
    rewards: list[float] = []
    waited = 0.0
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        groups = feed.take(batch, timeout=timeout_s)
        waited += time.monotonic() - t0
        if not groups:
            say(f"step {step}: no group within {timeout_s:.0f}s (is the job through its epochs?)")
            break
        samples = [s for g in groups for s in g["samples"]]
        # The "gradient step": a real trainer turns (messages, response, advantage) into a loss.
        batch_reward = sum(s["reward"] or 0.0 for s in samples) / len(samples)
        behind = [g["versions_behind"] for g in groups if g["versions_behind"] is not None]
        version += 1
        skill = push_weights(model_root, version).get("skill") if model_root else None
        feed.ack([g["group_id"] for g in groups])  # trained on: never delivered again
        feed.set_version(version)  # steps sampled from now on carry it
        rewards.append(batch_reward)
        say(f"step {step}: {len(groups)} groups, {len(samples)} samples, mean reward {batch_reward:.3f}, "
            f"versions behind {max(behind) if behind else 'n/a'} -> version {version}"
            + (f" (stand-in skill {skill:.2f})" if skill is not None else ""))
    st = feed.stats()
    return {"rewards": rewards, "version": version, "waited_s": waited, "stats": st}


def summary_lines(out: dict) -> list[str]:
    r, st = out["rewards"], out["stats"]
    half = max(1, len(r) // 2)
    lines = [f"{len(r)} steps, version {out['version']}: mean reward "
             f"{sum(r[:half]) / half:.3f} over the first {half} steps, "
             f"{sum(r[-half:]) / half:.3f} over the last {half}" if r else "no step trained"]
    lines.append(f"feed: {st['acked']} groups acknowledged, {st['stale_requeued']} re-queued as stale, "
                 f"{st['stale_dropped']} dropped, {sum(st['filtered'].values())} filtered, {st['failed']} failed, "
                 f"{st['redelivered']} delivered again; trainer waited {out['waited_s']:.1f}s")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.rl_trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--feed", default="http://127.0.0.1:8700", help="the feed server's URL")
    p.add_argument("--model", default="", help="the model stand-in's root URL, to push weights to (optional)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="groups per step")
    p.add_argument("--trainer", default="demo-trainer")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a batch")
    args = p.parse_args(argv)
    out = train(args.feed, model_root=args.model, steps=args.steps, batch=args.batch, trainer=args.trainer,
                timeout_s=args.timeout)
    for line in summary_lines(out):
        print(line)
    return 0 if out["rewards"] else 1


if __name__ == "__main__":
    sys.exit(main())
