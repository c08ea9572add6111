"""What a feature costs per step, from two load runs of the same shape without and with it (the
caps, resume and replica waits parts of bench/run.py), and the commit points' own latency with a
replica, their waits off and on."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.benchlog import log
from bench.cluster import start_replica
from bench.measures import percentiles
from broker.embedded import EmbeddedRedis
from broker.ledger import Ledger
from broker.redisconn import client_for
from broker.settings import Settings
from broker.states import AttemptStatus, LedgerState


def redis_calls_per_step(r: dict) -> float:
    """Redis commands per step of a load run's window (``to_json`` form; NaN without steps)."""
    return sum((r.get("redis_calls") or {}).values()) / r["steps"] if r.get("steps") else float("nan")


def added_cost(without: dict, with_: dict, names: tuple[str, str]) -> dict[str, float]:
    """What a feature costs per step, from two load runs of the same shape without and with it
    (``to_json`` form): orchestration CPU per step both ways and their ratio, Redis commands per
    step both ways and their difference (the round trips it adds at most). ``names``: the two
    runs' names in the keys (``cpu_ms_per_step_<name>``, ``redis_per_step_<name>``)."""
    a, b = names
    cpu0, cpu1 = without["orch_cpu_ms_per_step"], with_["orch_cpu_ms_per_step"]
    r0, r1 = redis_calls_per_step(without), redis_calls_per_step(with_)
    return {f"cpu_ms_per_step_{a}": cpu0, f"cpu_ms_per_step_{b}": cpu1,
            "cpu_ratio": cpu1 / cpu0 if cpu0 else float("nan"),
            f"redis_per_step_{a}": r0, f"redis_per_step_{b}": r1, "redis_extra_per_step": r1 - r0}


def caps_cost(uncapped: dict, capped: dict) -> dict[str, float]:
    """What caps that never bind cost per step (issue 25: "the cost of the caps per step (Redis
    round trips)"), from two load runs of the same shape, without and with caps."""
    return added_cost(uncapped, capped, ("uncapped", "capped"))


def resume_cost(off: dict, on: dict) -> dict[str, float]:
    """What keeping progress snapshots for a successor costs per step (broker/resume.py: a
    snapshot after each prompt, one written and waited for before each step), from two load runs
    of the same shape with resume off and on."""
    return added_cost(off, on, ("off", "on"))


def waits_cost(off: dict, on: dict) -> dict[str, float]:
    """What waiting for a replica at the commit points costs per step (broker/replicas.py: a WAIT
    after each START and FINISH), from two load runs of the same shape with a replica, the
    waits off and on."""
    return added_cost(off, on, ("off", "on"))


@dataclass
class CommitWaitResult:
    """The commit points' own latency with a replica, its waits off and on (``run_commit_waits``)."""

    commits: int = 0  # START + FINISH pairs per mode
    ms_per_commit: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> p50, p90, p99, max
    added_ms_p50: float = 0.0  # what a wait adds to one commit point, median
    errors: list[str] = field(default_factory=list)


def run_commit_waits(work: Path, *, commits: int = 500, base: Settings | None = None) -> CommitWaitResult:
    """START and FINISH of ``commits`` one-step episodes, one after the other, against a primary
    with a replica on loopback: each commit point timed with the waits off, then on. What a
    wait adds is one acknowledgement from the replica; on a network, add its round trip."""
    folder = Path(tempfile.mkdtemp(prefix="waits-", dir=work))
    res = CommitWaitResult(commits=commits)
    log(f"commit points with a replica: {commits} START+FINISH pairs, waits off and on")
    primary = EmbeddedRedis(folder / "redis").start()
    replica = None
    try:
        replica = start_replica(primary, folder / "replica")
        settings = (base or Settings.from_env({})).replace(redis_url=primary.url, run_dir=str(folder))
        client = client_for(primary.url)
        for mode in ("off", "on"):
            _time_commits(res, client, settings, mode, commits)
        res.added_ms_p50 = res.ms_per_commit["on"]["p50"] - res.ms_per_commit["off"]["p50"]
        client.close()
    except Exception as exc:
        res.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for server in (replica, primary):
            if server is not None:
                server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    log(f"  a commit point takes {res.ms_per_commit.get('off', {}).get('p50', float('nan')):.3f} ms without "
        f"waits, {res.ms_per_commit.get('on', {}).get('p50', float('nan')):.3f} ms with (median)"
        + (f"; problems: {res.errors}" if res.errors else ""))
    return res


def _time_commits(res: CommitWaitResult, client: redis.Redis, settings: Settings, mode: str, commits: int) -> None:
    """Each START and FINISH of a fresh job's episodes timed, with the waits ``mode`` (off, on)."""
    from broker.records import AttemptRecord, EpisodeSpec, JobSpec

    ledger = Ledger.for_settings(client, settings.replace(redis_wait=mode, key_prefix=f"w{mode}"))
    job = JobSpec(job_id="waits", llm_base_url="http://127.0.0.1:9/v1", model="m", episodes=commits, groups=1)
    eps = [EpisodeSpec(job_id="waits", episode_id=f"e{i}", group_id="g", group_size=commits, env_name="x",
                       base_url="http://127.0.0.1:9", env_params={}, seed=i, queue="q", source="bench")
           for i in range(commits + 1)]
    ledger.create_job(job, eps)
    times = []
    for i, ep in enumerate(eps):
        t0 = time.perf_counter()
        lease = ledger.start("waits", ep.episode_id, "bench").lease
        t1 = time.perf_counter()
        rec = AttemptRecord(job_id="waits", episode_id=ep.episode_id, attempt=1, status=AttemptStatus.COMPLETED,
                            group_id="g", group_size=commits, env_name="x", llm_model="m",
                            attempt_id=lease.attempt_id)
        ledger.finish(lease, rec, LedgerState.DONE)
        if i:  # the first loads the scripts
            times += [(t1 - t0) * 1000, (time.perf_counter() - t1) * 1000]
    if mode == "on" and (ledger.replicas.timeouts or not ledger.replicas.waits):
        res.errors.append(f"{ledger.replicas.waits} waits, {ledger.replicas.timeouts} timed out")
    res.ms_per_commit[mode] = percentiles(times)
