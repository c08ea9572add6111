"""docs/benchmarks.png, from one run's results (a JSON-able dict): efficiency and CPU per step of
the load levels, and the pools compared (or the record latency when no pools were)."""

from __future__ import annotations

from bench.benchmarks_page import TARGETS, orch_ms, role_ms


def plot(res: dict, path: str) -> None:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    load = res.get("load") or []
    pools = res.get("pools") or []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [str(r["spec"]["concurrency"]) for r in load]
    ax.bar(labels, [r["efficiency"] for r in load], color="#4c72b0")
    for i, r in enumerate(load):
        ax.text(i, r["efficiency"] + 0.01, f"{r['efficiency']:.3f}", ha="center", fontsize=9)
        t = {256: TARGETS["efficiency_256"], 1000: TARGETS["efficiency_1000"]}.get(r["spec"]["concurrency"])
        if t:
            ax.hlines(t, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
    ax.set_ylim(0, 1.1)
    ax.set_title("Efficiency (achieved / ideal steps/s)")
    ax.set_xlabel("concurrency")

    ax = axes[1]
    bottom = [0.0] * len(load)
    for role, color in (("workers", "#4c72b0"), ("consumer", "#55a868"), ("redis", "#c44e52"),
                        ("env", "#cccccc"), ("model", "#eeeeee")):
        vals = [role_ms(r, role) for r in load]
        ax.bar(labels, vals, bottom=bottom, label=role + (" (stand-in)" if role in ("env", "model") else ""),
               color=color, edgecolor="#999999" if role in ("env", "model") else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(TARGETS["cpu_ms_per_step"], color="red", linestyle="dashed", label="target (orchestration)")
    ax.set_title("CPU ms per step")
    ax.set_xlabel("concurrency")
    ax.legend(fontsize=8)

    ax = axes[2]
    if pools:
        pl = [r["spec"]["pool"] for r in pools]
        x = range(len(pools))
        ax.bar([i - 0.2 for i in x], [r["efficiency"] for r in pools], width=0.4, label="efficiency", color="#4c72b0")
        ax2 = ax.twinx()
        ax2.bar([i + 0.2 for i in x], [orch_ms(r) for r in pools], width=0.4, label="orch. CPU ms/step",
                color="#dd8452")
        ax.set_xticks(list(x), pl)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("efficiency")
        ax2.set_ylabel("CPU ms/step")
        ax.set_title(f"Pools at concurrency {pools[0]['spec']['concurrency']}")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    else:
        lat = [(r.get("latency_ms") or {}) for r in load]
        ax.plot(labels, [x.get("p50", 0) for x in lat], marker="o", label="p50")
        ax.plot(labels, [x.get("p99", 0) for x in lat], marker="o", label="p99")
        ax.axhline(TARGETS["latency_p99_ms_1000"], color="red", linestyle="dashed", label="p99 target (C=1000)")
        ax.set_title("Record latency (ms)")
        ax.legend(fontsize=8)
    fig.suptitle(f"interactor benchmarks ({res['finished']}, {res['machine']['cores']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
