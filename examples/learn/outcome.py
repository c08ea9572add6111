"""What the demo leaves: ``summary.json`` (``before``, ``after``, ``versions``, ``steps``, and the
rest of what was measured) and a PNG of reward against version (train batches and held-out
evaluations), plus the curve as text lines."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from examples.learn.evaluate import Evaluation
from examples.learn.trainer import VersionRecord


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def timing(records: list[VersionRecord], wall_s: float) -> dict:
    trained = [r for r in records if r.trained_samples]
    wait = sum(r.wait_s for r in records)
    return {
        "versions": len(trained),
        "per_version_s": {k: _mean([getattr(r, k) for r in trained]) for k in
                          ("wait_s", "train_s", "write_s", "load_s", "check_s", "sync_s")},
        "trainer_idle_share": wait / wall_s if wall_s > 0 else None,
        "training_wall_s": wall_s,
    }


def summary(path: str | Path, *, seed: int, evaluations: list[Evaluation], records: list[VersionRecord],
            wall_s: float, start_check: dict, settings: dict, feed_stats: dict | None = None) -> dict:
    before = evaluations[0].reward if evaluations else None
    after = evaluations[-1].reward if evaluations else None
    on_policy = [r.on_policy for r in records if r.on_policy]
    syncs = [r.sync for r in records if r.sync]
    out = {
        "before": before,
        "after": after,
        "gain": (after - before) if before is not None and after is not None else None,
        "versions": max((r.version for r in records), default=0),
        "seed": seed,
        "evaluations": [e.as_dict() for e in evaluations],
        "steps": [{k: v for k, v in asdict(r).items()} | {"sync_s": r.sync_s} for r in records],
        "timing": timing(records, wall_s),
        "checks": {
            "version_0_server_vs_trainer": start_check,
            "on_policy_logprobs": {"versions": len(on_policy), "mean": _mean([a["mean"] for a in on_policy]),
                                   "max": max((a["max"] for a in on_policy), default=None),
                                   "tokens": sum(a["tokens"] for a in on_policy)},
            "after_sync": {"versions": len(syncs), "mean": _mean([a["mean"] for a in syncs]),
                           "max": max((a["max"] for a in syncs), default=None)},
            "groups_refused_as_stale": sum(len(r.refused) for r in records),
            "oldest_group_trained_on": max((b for r in records for b in r.behind), default=None),
        },
        "settings": settings,
        "feed": feed_stats,
    }
    Path(path).write_text(json.dumps(out, indent=2, default=str))
    return out


def curve_lines(evaluations: list[Evaluation], records: list[VersionRecord]) -> list[str]:
    lines = ["held-out reward by version (each # is 0.02):"]
    for e in evaluations:
        lines.append(f"  v{e.version:<3d} {e.reward:5.3f} {'#' * int(round(e.reward * 50))}")
    by_five: dict[int, list[float]] = {}
    for r in records:
        if not math.isnan(r.reward):
            by_five.setdefault((r.version - 1) // 5 if r.version else 0, []).append(r.reward)
    if by_five:
        lines.append("train batches' reward, mean per 5 versions: "
                     + "  ".join(f"v{5 * k + 1}-{5 * k + 5}: {sum(v) / len(v):.3f}" for k, v in sorted(by_five.items())))
    return lines


def plot(path: str | Path, evaluations: list[Evaluation], records: list[VersionRecord], title: str) -> Path | None:
    """The PNG (matplotlib, of the learn extra); None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    tr = [(r.version - 1 if r.trained_samples else r.version, r.reward) for r in records if not math.isnan(r.reward)]
    if tr:
        ax.plot([v for v, _ in tr], [x for _, x in tr], ".", color="tab:blue", alpha=0.45,
                label="train batch (sampled by the version it trained from)")
        k = 5
        if len(tr) >= k:
            smooth = [sum(x for _, x in tr[i - k + 1:i + 1]) / k for i in range(k - 1, len(tr))]
            ax.plot([v for v, _ in tr[k - 1:]], smooth, "-", color="tab:blue", label=f"train, mean of {k}")
    if evaluations:
        ax.plot([e.version for e in evaluations], [e.reward for e in evaluations], "o-", color="tab:red",
                label="held-out (interactor run)")
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
