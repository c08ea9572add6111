"""``interactor status``'s text: one fleet snapshot (interactor/fleet_reader.py) as a few lines
for a terminal, or as JSON with the counters summed the same way."""

from __future__ import annotations

import time

from broker.audit import describe
from broker.states import LedgerState, Phase


def snapshot_json(snap: dict) -> dict:
    out = {k: v for k, v in snap.items() if k != "stats"}
    st = snap["stats"]
    out["failures_by_reason"] = _failures(st)
    out["finished"] = {f"{env}/{status}" if env else status: int(n)
                       for (env, status), n in st.counters.get("episodes_finished", {}).items()}
    return out


def _failures(st) -> dict[str, int]:
    agg: dict[str, int] = {}
    for (reason, _outcome), n in st.counters.get("attempt_failures", {}).items():
        agg[reason] = agg.get(reason, 0) + int(n)
    return dict(sorted(agg.items(), key=lambda kv: -kv[1]))


def _latency_line(st) -> str:
    from consumer.stats import Histogram

    parts = []
    for part in ("env", "model"):
        merged = None
        for (p, _env), h in st.histograms.get("step_latency_seconds", {}).items():
            if p != part:
                continue
            if merged is None:
                merged = Histogram(h.buckets, list(h.counts), h.sum)
            else:
                merged.counts = [a + b for a, b in zip(merged.counts, h.counts)]
                merged.sum += h.sum
        if merged and merged.count:
            p95 = merged.quantile(0.95)
            parts.append(f"{part} mean {merged.sum / merged.count:.3f}s p95<={p95:g}s")
    return ", ".join(parts)


def _phases_line(st) -> str:
    """Mean seconds per attempt in each phase (records v5), over every env."""
    sums: dict[str, list[float]] = {}
    for (phase, _env), h in st.histograms.get("phase_seconds", {}).items():
        agg = sums.setdefault(phase, [0.0, 0])
        agg[0] += h.sum
        agg[1] += h.count
    return ", ".join(f"{p} {sums[p][0] / sums[p][1]:.3f}s" for p in Phase if p in sums and sums[p][1])


def render_status(snap: dict) -> str:
    st = snap["stats"]
    ep = snap["episodes"]
    lines = [f"interactor status  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}  "
             f"redis {snap['redis']}  prefix {snap['key_prefix']}"]
    qparts = []
    for q, d in snap["queues"].items():
        if not (d["depth"] or d["inflight"]):
            continue
        prio = " ".join(f"p{p}={n}" for p, n in d["by_priority"].items() if n and p)
        qparts.append(f"{q}={d['depth']}" + (f" ({prio})" if prio else "") + f" inflight={d['inflight']}")
    queued_total = sum(d["depth"] for d in snap["queues"].values())
    lines.append(f"queue      {queued_total} queued" + (": " + ", ".join(qparts) if qparts else ""))
    lines.append(f"episodes   running={ep[LedgerState.RUNNING]} queued={ep[LedgerState.QUEUED]} "
                 f"retrying={ep[LedgerState.RETRYING]} "
                 f"done={ep[LedgerState.DONE]} failed={ep[LedgerState.FAILED]} "
                 + (f"cancelled={ep[LedgerState.CANCELLED]} " if ep.get(LedgerState.CANCELLED) else "")
                 + f"dead={snap['dead_letters']}  "
                 f"leases live={snap['leases_live']} expired={snap['leases_expired']}  "
                 f"retry scheduled={snap['retry_scheduled']}")
    s = snap["stream"]
    lag = max((g["lag"] for g in s["groups"]), default=0)
    pending = sum(g["pending"] for g in s["groups"])
    consumers = sum(g["consumers"] for g in s["groups"])
    lines.append(f"results    {snap['steps_per_s']:.1f} steps/s  steps={snap['steps_total']}  stream={s['length']} "
                 f"pending={pending} lag={lag} consumers={consumers}" + (f" poison={s['poison']}" if s["poison"] else ""))
    for b in snap.get("breakers", []):
        down = f"{snap['time'] - b['since']:.0f}s" if b["since"] else "?"
        lines.append(f"BREAKER    {b['kind']} server {b['server']} down for {down} (seen by {b['workers']} worker "
                     f"process{'es' if b['workers'] != 1 else ''}; its episodes wait): {b['error'][:160]}")
    for cap in snap.get("caps", []):
        auto = f", auto {cap['auto']}" if cap.get("auto") else ""
        last = cap.get("changed")
        why = f"; last change {_ago(last['at'])}: {last['reason']}" if last else ""
        lines.append(f"cap        {cap['kind']} {cap['name']}: {cap['in_use']}/{cap['limit']} in use{auto}{why}"
                     + _server_reading(cap.get("server")))
    for rate in snap.get("rates", []):
        parts = []
        if rate["rpm"]:
            parts.append(f"{rate['requests_left']:.1f} requests in the bucket ({rate['rpm']}/min)")
        if rate["tpm"]:
            parts.append(f"{rate['tokens_left']:.0f} tokens ({rate['tpm']}/min)")
        if rate["hold_s"] > 0:
            parts.append(f"the server said wait: {rate['hold_s']:.1f}s more")
        lines.append(f"rate       model {rate['server']}: " + ", ".join(parts))
    for j in snap["jobs"]:
        if j.get("paused"):
            p = j["paused"]
            lines.append(f"PAUSED     job {j['job_id']}: {p['streak']} episodes in a row failed with {p['reason']}"
                         + (f" (last: {p['detail'][:160]})" if p["detail"] else "")
                         + f"; no new episode starts. Fix the cause, then: interactor resume {j['job_id']}")
    lat = _latency_line(st)
    if lat:
        lines.append(f"latency    per step: {lat}")
    phases = _phases_line(st)
    if phases:
        lines.append(f"phases     per attempt, mean: {phases}")
    fails = _failures(st)
    if fails:
        lines.append("failures   " + ", ".join(f"{r}={n}" for r, n in list(fails.items())[:8]))
    if snap["jobs"]:
        rows = [("job", "total", "done", "failed", "cancelled", "running", "queued", "retrying", "progress")]
        for j in snap["jobs"]:
            c = j["counts"]
            mark = (" (stopped: budget)" if (j.get("usage") or {}).get("stop") else " (cancelled)" if j.get("cancelled")
                    else " (paused)" if j.get("paused") else "")
            continuous = j.get("continuous")  # a feed job's producer has no total: neither 0 nor 100% of one
            rows.append((j["job_id"] + mark, "continuous" if continuous else str(j["total"]),
                         *(str(c[s]) for s in (LedgerState.DONE, LedgerState.FAILED, LedgerState.CANCELLED,
                                               LedgerState.RUNNING, LedgerState.QUEUED, LedgerState.RETRYING)),
                         "-" if continuous else f"{100 * j['progress']:.1f}%"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("jobs")
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        for j in snap["jobs"]:
            if j.get("usage"):  # counted by the consumer as it commits (broker/job_budgets.py)
                lines.append(f"usage      {j['job_id']}: {j['usage']['text']}")
            cache = j.get("cache")
            if cache:
                lines.append(f"cache      {j['job_id']}: {cache['hits']} model calls answered from the response "
                             f"cache, {cache['misses']} asked of the model (--cache={cache['mode']})")
            f = j.get("feed")
            if f:
                lines.append(f"feed       {j['job_id']}: version={f['version']} ready={f['ready']} taken={f['taken']} "
                             f"acked={f['acked']} requeued={f['stale_requeued']} dropped={f['stale_dropped']} "
                             f"filtered={sum(f['filtered'].values())} failed={f['failed']} "
                             f"refilled={f['refilled']} inflight={f['inflight']}")
                p = f.get("producer")
                if p:
                    lines.append(_producer_line(p))
        for j in snap["jobs"]:
            if j.get("audit"):  # `status JOB`: its newest changes (broker/audit.py), newest first
                lines.append(f"changes    {j['job_id']} (newest first; all: interactor job {j['job_id']} log)")
                lines.extend("  " + describe(e) for e in j["audit"])
    else:
        lines.append("jobs       none")
    return "\n".join(lines)


def _producer_line(p: dict) -> str:
    """The continuous producer's report (broker/feed.py producer_status), a line under its feed."""
    line = f"  producer {p['state']} (last seen {p['seen_s_ago']:.0f}s ago)"
    if p["errors"]:
        line += f", {p['errors']} failed rounds, last {p['last_error_s_ago']:.0f}s ago: {p['last_error'][:200]}"
    if p["redo_dropped"]:
        line += f", {p['redo_dropped']} groups to re-run dropped (their episode specs were gone)"
    return line


def _ago(at: float) -> str:
    """How long ago the unix time ``at`` was, in whole seconds (a fleet cap's last change)."""
    return f"{max(0, int(time.time() - float(at)))}s ago"


def _server_reading(m: dict | None) -> str:
    """The model server's last metrics reading (``--llm-metrics-url``), and its last failure if newer."""
    if not m:
        return ""
    out = ""
    if m["at"]:
        kv = f", KV {m['kv']:.2f}" if m["kv"] is not None else ""
        waiting = f"{m['waiting']:g}" if m["waiting"] is not None else "?"
        out = f"; server {m['engine']} {_ago(m['at'])}: {waiting} waiting{kv}"
    if m["error"] and m["error_at"] >= m["at"]:
        out += f"; server metrics unread {_ago(m['error_at'])}: {m['error'][:120]}"
    return out
