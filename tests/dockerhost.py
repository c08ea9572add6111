"""A real Docker engine for the container tests (tests/test_containers.py), made on this machine.

No Docker engine runs here and no image registry is reachable, so the tests bring their own:

* Debian's ``docker.io`` and ``docker-compose`` (1.29) and ``debootstrap``, installed with apt
  when missing (as root; otherwise the tests skip and say why);
* a ``dockerd`` of their own: its data root, exec root and socket in a temporary folder, the vfs
  storage driver (works on any file system), no default bridge and no iptables rules. Compose's
  project network is a plain bridge its containers share, with no route out of the machine;
  only image builds use the host's network (``--network host``), for Debian's and PyPI's
  packages;
* base images made from Debian's packages: ``debootstrap --variant=minbase bookworm`` imported
  as an image, then a Python 3.11 image (python3, python3-venv, pip), a Redis image
  (redis-server) and a PostgreSQL image (postgresql), from ``tests/containers/*.Dockerfile``.

These are cached under ``~/.cache/interactor-containers`` (``INTERACTOR_CONTAINERS_CACHE``),
each file named by a hash of what made it (Debian suite and mirror, the Dockerfile's text), so a
second run only loads them (``docker load``). Our own image is always built, from the real
``Dockerfile``, with ``BASE_IMAGE`` pointing at the Debian-made Python image.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "containers"
SUITE = "bookworm"
CACHE = Path(os.environ.get("INTERACTOR_CONTAINERS_CACHE", Path.home() / ".cache" / "interactor-containers"))
# Debian's own client: it matches the engine we start (a newer client elsewhere on PATH may
# speak an API version this engine does not).
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
COMPOSE = "/usr/bin/docker-compose"

DEBIAN_IMAGE = "interactor-test/debian:" + SUITE
PYTHON_IMAGE = "interactor-test/python:3.11"
REDIS_IMAGE = "interactor-test/redis:" + SUITE
POSTGRES_IMAGE = "interactor-test/postgres:" + SUITE
IMAGE = "interactor:latest"


class Unavailable(Exception):
    """No engine can be started here; the message is the reason to skip with."""


def log(msg: str) -> None:
    print(f"[containers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, env: dict | None = None, check: bool = True, timeout: float = 1800,
        capture: bool = True, stderr_apart: bool = False, **kw) -> subprocess.CompletedProcess:
    """``stderr_apart``: stdout holds only what the command printed there (a container's own
    output), not the docker CLI's warnings, which go to stderr (on a host with IPv4 forwarding
    off, every ``docker run`` warns that networking will not work)."""
    err = subprocess.PIPE if stderr_apart else subprocess.STDOUT
    r = subprocess.run(cmd, env=env, timeout=timeout, text=True,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=err if capture else None, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{(r.stdout or '')[-4000:]}"
                           + (f"\n{(r.stderr or '')[-2000:]}" if stderr_apart else ""))
    return r


# --- packages --------------------------------------------------------------------------------
def ensure_packages() -> None:
    needed = {"docker.io": DOCKERD, "docker-compose": COMPOSE, "debootstrap": "/usr/sbin/debootstrap"}
    missing = [pkg for pkg, path in needed.items() if not os.path.exists(path)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"needs Debian's {', '.join(missing)}: run as root, or apt-get install them")
    if not shutil.which("apt-get"):
        raise Unavailable(f"needs {', '.join(missing)} and there is no apt-get here")
    log(f"apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        run(["apt-get", "update", "-qq"], env=env, timeout=900)
        run(["apt-get", "install", "-y", "-qq", *missing], env=env, timeout=1800)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"apt-get install {' '.join(missing)} failed: {exc}") from exc


def debian_mirror() -> str:
    """The machine's own Debian mirror (its apt sources), so debootstrap asks what apt asks."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for block in path.read_text().split("\n\n"):
            if re.search(rf"^Suites:.*\b{SUITE}\b", block, re.M) and not re.search(r"security", block):
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m:
                    return m.group(1)
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return next(p for p in parts[1:] if "://" in p)
    raise Unavailable("no Debian bookworm mirror in the apt sources (debootstrap needs one)")


# --- pip inside the image build -------------------------------------------------------------
def pip_build_secrets(workdir: Path) -> list[str]:
    """``--secret`` flags carrying this machine's pip index and certificate bundle into the
    build, read from ``pip config list`` now (the index may be a mirror; nothing is written
    into the repository or into an image layer). Local ``file://`` indexes and find-links do
    not exist inside the build and are left out."""
    out = run([sys.executable, "-m", "pip", "config", "list"], check=False).stdout or ""
    conf: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"^[^.]*\.([a-z-]+)='(.*)'$", line.strip())
        if m:
            conf[m.group(1)] = m.group(2)
    parser = configparser.ConfigParser()
    parser["global"] = {}
    glob = parser["global"]
    if conf.get("index-url", "").startswith(("http://", "https://")):
        glob["index-url"] = conf["index-url"]
    extra = [u for u in conf.get("extra-index-url", "").split() if u.startswith(("http://", "https://"))]
    if extra:
        glob["extra-index-url"] = " ".join(extra)
    for key in ("trusted-host", "timeout", "default-timeout", "retries"):
        if conf.get(key):
            glob[key] = conf[key]
    flags = []
    cert = conf.get("cert") or os.environ.get("PIP_CERT") or ""
    if cert and os.path.isfile(cert):
        glob["cert"] = "/run/secrets/pip-cert"
        flags += ["--secret", f"id=pip-cert,src={cert}"]
    path = workdir / "pip.conf"
    with path.open("w") as fh:
        parser.write(fh)
    flags += ["--secret", f"id=pip.conf,src={path}"]
    return flags


# --- the engine ------------------------------------------------------------------------------
class Engine:
    """One dockerd of our own, stopped (with everything it ran) by :meth:`stop`."""

    def __init__(self, workdir: Path):
        # The exec root holds containerd's sockets: a short path (unix sockets take 108 bytes).
        self.dir = Path(tempfile.mkdtemp(prefix="ixd-", dir="/tmp"))
        self.workdir = workdir
        self.sock = self.dir / "docker.sock"
        self.proc: subprocess.Popen | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
        self.env["DOCKER_HOST"] = f"unix://{self.sock}"
        self.env["DOCKER_BUILDKIT"] = "1"

    def start(self) -> None:
        # overlay2 where the kernel allows it: vfs copies the whole image for every container
        # (30 s per container for ours, measured); vfs works everywhere.
        drivers = [os.environ["INTERACTOR_DOCKER_STORAGE"]] if os.environ.get("INTERACTOR_DOCKER_STORAGE") \
            else ["overlay2", "vfs"]
        for i, driver in enumerate(drivers):
            try:
                return self._start(driver)
            except Unavailable:
                if i == len(drivers) - 1:
                    raise
                log(f"dockerd with {driver} failed; trying {drivers[i + 1]}")
                self._kill()

    def _start(self, driver: str) -> None:
        log_path = self.workdir / f"dockerd-{driver}.log"
        self.log = log_path.open("w")
        self.driver = driver
        self.proc = subprocess.Popen(
            [DOCKERD, "--data-root", str(self.dir / "root"), "--exec-root", str(self.dir / "exec"),
             "--pidfile", str(self.dir / "dockerd.pid"), "--host", f"unix://{self.sock}",
             "--storage-driver", driver,
             # No docker0 and no NAT: the compose network is a bridge between its containers only.
             "--bridge", "none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
             "--userland-proxy=false"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(120):
            if self.proc.poll() is not None:
                raise Unavailable(f"dockerd exited {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            if self.sock.exists() and run([DOCKER, "version"], env=self.env, check=False, timeout=30).returncode == 0:
                log(f"dockerd up, storage driver {driver}, socket {self.sock}")
                return
            time.sleep(0.5)
        raise Unavailable(f"dockerd did not answer in 60 s: {log_path.read_text()[-2000:]}")

    def docker(self, *args: str, check: bool = True, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
        return run([DOCKER, *args], env=self.env, check=check, timeout=timeout, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            ids = self.docker("ps", "-aq", check=False, timeout=60).stdout.split()
            if ids:
                self.docker("rm", "-f", "-v", *ids, check=False, timeout=300)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                # Its whole session: dockerd, its containerd and the shims.
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._kill()
        # vfs copies every layer: gigabytes that must not outlive the test. Mounts first.
        run(["sh", "-c", f"grep -o ' {self.dir}[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l"],
            check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill(self) -> None:
        if self.proc is not None:
            # Anything dockerd left in its session (a shim whose container it could not stop).
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            self.log.close()
            self.proc = None

    # --- images ---------------------------------------------------------------------------
    def has_image(self, name: str) -> bool:
        return self.docker("image", "inspect", name, check=False, timeout=60).returncode == 0

    def cached_image(self, name: str, key: str, make) -> None:
        """Load ``name`` from the cache file for ``key``, else make it and save it there."""
        CACHE.mkdir(parents=True, exist_ok=True)
        slug = name.split("/")[-1].replace(":", "-")
        path = CACHE / f"{slug}-{key}.tar"
        if path.exists():
            log(f"load {name} from {path}")
            self.docker("load", "-i", str(path))
            return
        t0 = time.monotonic()
        make()
        tmp = path.with_suffix(".tmp")
        self.docker("save", "-o", str(tmp), name)
        tmp.rename(path)
        for old in CACHE.glob(f"{slug}-*.tar"):  # earlier inputs' files
            if old != path:
                old.unlink()
        log(f"made {name} in {time.monotonic() - t0:.0f} s, cached as {path}")

    def base_images(self) -> None:
        mirror = debian_mirror()
        debian_key = _key(SUITE, "minbase", mirror)

        def make_debian():
            rootfs = self.workdir / "rootfs"
            log(f"debootstrap --variant=minbase {SUITE} from {mirror}")
            run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror], timeout=1800)
            # Leave apt's downloads out of the image.
            run(["sh", "-c", f"rm -rf {rootfs}/var/cache/apt/archives/*.deb {rootfs}/var/lib/apt/lists/*"])
            run(["sh", "-c", f"tar -C {rootfs} -c . | {DOCKER} import - {DEBIAN_IMAGE}"], env=self.env)
            shutil.rmtree(rootfs, ignore_errors=True)

        self.cached_image(DEBIAN_IMAGE, debian_key, make_debian)
        for name, dockerfile in ((PYTHON_IMAGE, "python.Dockerfile"), (REDIS_IMAGE, "redis.Dockerfile"),
                                 (POSTGRES_IMAGE, "postgres.Dockerfile")):
            inputs = [debian_key] + [p.read_text() for p in sorted(HERE.glob(dockerfile.split(".")[0] + "*"))]

            def make(name=name, dockerfile=dockerfile):
                self.build(name, HERE / dockerfile, HERE, "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}")

            self.cached_image(name, _key(*inputs), make)

    def build(self, tag: str, dockerfile: Path, context: Path, *extra: str) -> None:
        log(f"docker build -t {tag} -f {dockerfile.relative_to(ROOT)}")
        self.docker("build", "--network", "host", "--progress", "plain", "-t", tag, "-f", str(dockerfile),
                    *extra, str(context), timeout=3600)


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
