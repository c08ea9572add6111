"""What the harness reads off the machine and the processes of a run: CPU seconds and memory
(psutil, children included), Redis's command counts, a stand-in's counters, percentiles, and
the machine's description for the report."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import redis


def procs(p: subprocess.Popen | None) -> list[psutil.Process]:
    """A running process and all its children (none once it has exited)."""
    if p is None or p.poll() is not None:
        return []
    try:
        root = psutil.Process(p.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_snapshot(processes: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for pr in processes:
        try:
            t = pr.cpu_times()
            out[pr.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_delta(a: dict[int, float], b: dict[int, float]) -> float:
    return sum(v - a.get(pid, 0.0) for pid, v in b.items())


def pss_mb(processes: list[psutil.Process]) -> float:
    total = 0
    for pr in processes:
        try:
            total += pr.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            try:
                total += pr.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return total / 2**20


def command_calls(client: redis.Redis, field: str = "calls") -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``); ``field="usec"``: the
    server's microseconds in each. Commands a Lua script runs count under their own names, and
    the script itself under ``evalsha`` (its microseconds include theirs)."""
    out = {}
    for key, stats in client.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        out[name] = int(stats.get(field, 0)) if isinstance(stats, dict) else 0
    return out


def http_json(url: str, timeout: float = 5.0) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    out = {f"p{p}": v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))] for p in ps}
    out["max"] = v[-1]
    return out


def machine() -> dict:
    info = {
        "cpu": platform.processor() or "",
        "cores": psutil.cpu_count(logical=True),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "host": socket.gethostname(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from broker.embedded import redis_server_binary

        out = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
        info["redis"] = out.split("v=", 1)[1].split()[0] if "v=" in out else out.strip()
    except Exception:
        info["redis"] = "?"
    import celery

    info["celery"] = celery.__version__
    return info


def to_json(obj) -> Any:
    """A result as results.json holds it: its fields and the figures its properties compute."""
    if hasattr(obj, "__dataclass_fields__"):
        d = asdict(obj)
        for name in ("orch_cpu_ms_per_step", "mem_mb_per_episode", "mem_total_mb_per_episode"):
            if hasattr(obj, name):
                d[name] = getattr(obj, name)
        return d
    return obj
