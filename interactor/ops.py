"""Operating the fleet: ``interactor metrics``, ``interactor status`` and ``interactor autoscale``.

Registered into the CLI through ``interactor.cli.EXTRA_COMMAND_MODULES``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from broker.states import LedgerState, Phase
from interactor.children import stop_event, wait_for_signal

log = logging.getLogger("interactor.ops")

DEFAULT_METRICS_PORT = 9400


def register(sub, add) -> None:
    sp = add("metrics", cmd_metrics, "serve the fleet's Prometheus metrics (queues, episodes, stream, steps, latency)")
    sp.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other hosts (a Prometheus scraper)")
    sp.add_argument("--port", type=int, default=DEFAULT_METRICS_PORT)
    sp.add_argument("--once", action="store_true", help="print the exposition once and exit")
    sp.add_argument("--extra-queues", default="", help="more queues to show (comma-separated)")

    sp = add("status", cmd_status, "queue, running, done, failed, dead, steps/s, lag and jobs at a glance")
    sp.add_argument("job", nargs="?")
    sp.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    sp.add_argument("--interval", type=float, default=2.0)
    sp.add_argument("--json", action="store_true")

    sp = add("resume", cmd_resume, "continue a paused job (its attempts kept failing alike): parked episodes go again")
    sp.add_argument("job")

    sp = add("autoscale", cmd_autoscale, "run local worker processes, as many as the queue needs")
    sp.add_argument("--min", dest="min_workers", type=int, default=0)
    sp.add_argument("--max", dest="max_workers", type=int, default=4)
    sp.add_argument("--target-per-worker", type=int, default=None,
                    help="queued + running episodes per worker (default: --concurrency)")
    sp.add_argument("--cooldown", type=float, default=60.0, help="scale-down stabilization window, seconds")
    sp.add_argument("--interval", type=float, default=5.0, help="seconds between decisions")
    sp.add_argument("--metrics-port", type=int, default=0, help="serve the autoscaler's own gauges here")
    sp.add_argument("--metrics-host", default="127.0.0.1", help="0.0.0.0 to serve other hosts")
    sp.add_argument("--log-dir", default=None, help="worker logs here (default: this process's output)")
    sp.add_argument("--name", default="as", help="worker name prefix")


# --- metrics --------------------------------------------------------------------------------
def cmd_metrics(args) -> int:
    from interactor.common import redis_for, settings_from_args
    from interactor.metrics import FleetReader, exposition, registry, serve

    settings = settings_from_args(args)
    reader = FleetReader(redis_for(settings), settings, extra_queues=args.extra_queues.split(","))
    if args.once:
        sys.stdout.write(exposition(reader))
        return 0
    server, _ = serve(registry(reader), args.host, args.port)
    log.info("metrics on http://%s:%d/metrics", args.host, server.server_port)
    print(f"serving metrics on http://{args.host}:{server.server_port}/metrics", flush=True)
    wait_for_signal()
    server.shutdown()
    return 0


# --- status ---------------------------------------------------------------------------------
def cmd_status(args) -> int:
    from interactor.common import redis_for, settings_from_args
    from interactor.metrics import FleetReader

    settings = settings_from_args(args)
    reader = FleetReader(redis_for(settings), settings)
    if not args.watch:
        snap = reader.snapshot(args.job)
        if args.json:
            print(json.dumps(snapshot_json(snap), indent=2))
        else:
            print(render_status(snap))
        return 0
    tty = sys.stdout.isatty()
    try:
        while True:
            text = render_status(reader.snapshot(args.job))
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.interval:g}s; Ctrl-C to quit)\n")
            else:
                sys.stdout.write(text + "\n\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


# --- resume ---------------------------------------------------------------------------------
def cmd_resume(args) -> int:
    from broker.pause import JobPause, resume_job
    from broker.keys import Keys
    from broker.ledger import Ledger
    from interactor.common import redis_for, settings_from_args

    settings = settings_from_args(args)
    client = redis_for(settings)
    if Ledger.for_settings(client, settings).job_spec(args.job) is None:
        print(f"interactor: no job {args.job!r} in Redis (prefix {settings.key_prefix})", file=sys.stderr)
        return 2
    state = JobPause(client, Keys(settings.key_prefix)).state(args.job)
    sent = resume_job(client, settings, args.job)
    if state is None:
        print(f"job {args.job} was not paused" + (f"; sent {len(sent)} parked episodes again" if sent else ""))
    else:
        print(f"resumed job {args.job} ({state.describe()}); sent {len(sent)} parked episodes again")
    return 0


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
                 f"done={ep[LedgerState.DONE]} failed={ep[LedgerState.FAILED]} dead={snap['dead_letters']}  "
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
        lines.append(f"cap        {cap['kind']} {cap['name']}: {cap['in_use']}/{cap['limit']} in use")
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
        rows = [("job", "total", "done", "failed", "running", "queued", "retrying", "progress")]
        for j in snap["jobs"]:
            c = j["counts"]
            rows.append((j["job_id"] + (" (paused)" if j.get("paused") else ""), str(j["total"]),
                         *(str(c[s]) for s in (LedgerState.DONE, LedgerState.FAILED, LedgerState.RUNNING,
                                               LedgerState.QUEUED, LedgerState.RETRYING)),
                         f"{100 * j['progress']:.1f}%"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("jobs")
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        for j in snap["jobs"]:
            f = j.get("feed")
            if f:
                lines.append(f"feed       {j['job_id']}: version={f['version']} ready={f['ready']} taken={f['taken']} "
                             f"acked={f['acked']} requeued={f['requeued']} dropped={f['dropped']} "
                             f"filtered={f['filtered']} failed={f['failed']} inflight={f['inflight']}")
    else:
        lines.append("jobs       none")
    return "\n".join(lines)


# --- autoscale ----------------------------------------------------------------------------------
def cmd_autoscale(args) -> int:
    from broker.settings import SettingsError
    from interactor.autoscale import LocalScaler, Policy, autoscaler_registry
    from interactor.common import redis_for, settings_from_args
    from interactor.metrics import serve

    settings = settings_from_args(args)
    if not settings.redis_url:
        raise SettingsError("the autoscaler needs REDIS_URL (or --redis-url)")
    try:
        policy = Policy(min_workers=args.min_workers, max_workers=args.max_workers,
                        target_per_worker=args.target_per_worker or settings.concurrency,
                        scale_down_cooldown_s=args.cooldown)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    scaler = LocalScaler(settings, policy, client=redis_for(settings), name=args.name, log_dir=args.log_dir)
    if args.metrics_port:
        server, _ = serve(autoscaler_registry(scaler), args.metrics_host, args.metrics_port)
        log.info("autoscaler metrics on http://%s:%d/metrics", args.metrics_host, server.server_port)
    scaler.run(stop_event(), args.interval)
    return 0
