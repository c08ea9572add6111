"""A real PostgreSQL server for the tests and the benchmark, on a free loopback port.

The binaries come from the ``pgserver`` package (PyPI, PostgreSQL 16), or else the machine's
own (``/usr/lib/postgresql/*/bin``, ``postgres`` on the PATH), so a fresh machine needs nothing
installed by hand. PostgreSQL refuses to run as root; when the tests run as root, the server
runs as an unprivileged system user made for it (``interactor-pg``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

PG_USER = "interactor-pg"


def binaries() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("pgserver")  # its binaries, without importing it (side effects)
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "pginstall" / "bin"
        if (path / "postgres").exists():
            return path
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("postgres")
    return Path(which).parent if which else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to run the server as, when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
                       check=True, capture_output=True)
        entry = pwd.getpwnam(PG_USER)
    return entry.pw_uid, entry.pw_gid


class EmbeddedPostgres:
    """``with EmbeddedPostgres(folder) as pg: pg.url`` (a superuser ``postgres``, trust auth)."""

    def __init__(self, folder: str | os.PathLike, *, port: int | None = None, fsync: bool = True):
        self.folder = Path(folder).resolve()
        self.data = self.folder / "data"
        self.port = port or _free_port()
        self.fsync = fsync
        self.bin = binaries()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL binaries: pip install pgserver (or the machine's postgresql package)")
        self.proc: subprocess.Popen | None = None
        self._ids = _run_as()

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _preexec(self):
        ids = self._ids

        def drop() -> None:
            os.setsid()
            if ids is not None:
                os.setgid(ids[1])
                os.setuid(ids[0])
        return drop

    def _traversable(self) -> None:
        """The unprivileged server user must reach its data folder and the binaries."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._ids is None:
            return
        for p in [self.folder, *self.folder.parents, self.bin, *self.bin.parents]:
            try:
                mode = p.stat().st_mode
                if not mode & 0o001:
                    p.chmod(mode | 0o005)
            except OSError:
                pass
        for lib in (self.bin.parent / "lib", self.bin.parent / "share"):
            if lib.exists():
                for root, dirs, files in os.walk(lib):
                    for name in dirs + files:
                        q = Path(root) / name
                        try:
                            q.chmod(q.stat().st_mode | 0o005)
                        except OSError:
                            pass
        os.chown(self.folder, *self._ids)

    def start(self, timeout: float = 60.0) -> "EmbeddedPostgres":
        self._traversable()
        log = self.folder / "postgres.log"
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(parents=True, exist_ok=True)
            if self._ids:
                os.chown(self.data, *self._ids)
            out = subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                                  "--encoding=UTF8", "--no-instructions"],
                                 capture_output=True, text=True, preexec_fn=self._preexec())
            if out.returncode != 0:
                raise RuntimeError(f"initdb failed: {out.stderr[-2000:]}")
        logf = open(log, "ab")
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
             "-k", str(self.folder), "-c", f"fsync={'on' if self.fsync else 'off'}", "-c", "max_connections=200",
             "-c", "shared_buffers=64MB"],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=self._preexec())
        logf.close()
        deadline = time.monotonic() + timeout
        import psycopg

        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"postgres did not start on port {self.port}: {tail}")
                time.sleep(0.1)

    def create_database(self, name: str | None = None) -> str:
        """A fresh database; returns its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def stop(self, *, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(9 if kill else 2)  # SIGINT: fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
