"""URLs a job names: one check (broker/urls.py), made by the parser that connects, at submit and
again in the worker; and code a job names: one attribute defined in the module named.

Real Redis, real loopback servers, a real worker process; a property test (Hypothesis) that no
URL the check accepts connects anywhere but where the check said."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st
from urllib3.util import parse_url

from broker import errors
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.queueing import push_episodes
from broker.records import EpisodeSpec, JobSpec, OrphanInstance
from broker.settings import Settings, SettingsError, origin_of, redact_url
from broker.urls import UrlError, check_url
from envs.base import import_object
from tests.conftest import wait_for
from tests.test_runner import make_job
from workers.allowlist import HostAllowlist
from workers.breakers import BreakerBoard
from workers.envclient import EnvClient
from workers.http_transport import HttpPool, make_session
from workers.orphans import OrphanCloser
from workers.runner import WorkerRuntime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Listener:
    """A TCP port that records every connection and what arrived on it (nothing should)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(0.5)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                self.received.append(b"")
            conn.close()

    def close(self):
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture
def runtime_with(settings):
    made = []

    def make(**overrides):
        rt = WorkerRuntime(settings.replace(**overrides), name=f"urls-{len(made)}")
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.stop()


def port_of(url: str) -> int:
    return check_url(url).port


def backslash_url(listen_port: int, trusted: str) -> str:
    """The review's repro: urlsplit reads the host after the '@', the client ends it at '\\'."""
    t = check_url(trusted)
    return f"http://127.0.0.1:{listen_port}\\@{t.host}:{t.port}"


# --------------------------------------------------------------------------- the check itself

@pytest.mark.unit
def test_the_backslash_form_has_no_origin_and_is_on_no_allow_list():
    url = "http://127.0.0.1:9999\\@localhost:8000/v1"
    assert origin_of(url) == ""
    assert origin_of("http://localhost:8000/v1") == "http://localhost:8000"
    assert not HostAllowlist("localhost:8000").allows(url)
    assert not HostAllowlist("").allows(url)  # "any host" still means a URL the check accepts
    assert HostAllowlist("http://LOCALHOST:8000/").allows("http://localhost:8000/x")
    for bad in (url, "http://user:pw@localhost:8000", "https://TOKEN@h", "http://h\r\nX: y/", "http://h:99999",
                "http://h:0", "http://h?x", "http://h#x", "http://h%2F@e", "http://\u0435vil.com", "javascript:x",
                "http://[::1%25eth0]:80", "http:/h", "http://h.:80", ""):
        with pytest.raises(UrlError):
            check_url(bad)
    assert check_url("HTTPS://Api.Example.COM/v1").origin == "https://api.example.com:443"
    assert check_url("http://[::1]:8080/").origin == "http://[::1]:8080"


@pytest.mark.unit
def test_settings_refuse_urls_the_check_refuses():
    for field in ("llm_base_url", "env_base_url", "llm_trusted_origins"):
        with pytest.raises(SettingsError, match=field):
            Settings.from_env({}, **{field: "http://127.0.0.1:9\\@localhost:8000/v1"})
    with pytest.raises(SettingsError, match="llm_base_url") as ei:
        Settings.from_env({}, llm_base_url="https://sk-secret@model/v1")
    assert "sk-secret" not in str(ei.value)


# Where requests, the worker's own plain-http client (workers/plainhttp.py) and its urllib3
# shortcut (workers/http_transport.py, for https and with the plain client off) would connect.
_SESSION = make_session(Settings())
_POOLS = {"plain": HttpPool(_SESSION), "shortcut": HttpPool(_SESSION, plain=False)}


def _strip(host: str) -> str:
    return host.strip("[]").lower()


def connects_to(url: str) -> set[tuple[str, str, str, int]]:
    prep = requests.Request("GET", url).prepare()
    adapter = _SESSION.get_adapter(prep.url)
    pool = adapter.get_connection_with_tls_context(prep, True, proxies={})
    out = {("requests", pool.scheme, _strip(pool.host), pool.port)}
    for name, pools in _POOLS.items():
        fast = pools.pool_for(url)
        if fast is not None:
            out.add((name, fast.scheme, _strip(fast.host), fast.port))
    p = parse_url(url)
    out.add(("parse_url", p.scheme, _strip(p.host or ""), p.port or {"http": 80, "https": 443}[p.scheme]))
    return out


_TRICKY = "\\@/:?#%[].;=&- \t\r\n\x00\x7fé\u0435\uff0eaZ09"
_hosts = st.one_of(st.sampled_from(["localhost", "127.0.0.1", "env.internal", "a-b.c", "[::1]", "evil.com", "EVIL.com",
                                    "xn--e1afmkfd.xn--p1ai"]),
                   st.text(_TRICKY + "abcxyz.", min_size=0, max_size=12))
_ports = st.one_of(st.just(""), st.integers(0, 70000).map(lambda p: f":{p}"), st.text(":0123456789\\@", max_size=7))
_userinfo = st.one_of(st.just(""), st.text(_TRICKY + "user", max_size=10).map(lambda u: u + "@"))
_paths = st.one_of(st.just(""), st.text(_TRICKY + "v1xyz", max_size=16).map(lambda p: "/" + p))
_urls = st.one_of(
    st.builds(lambda sc, sep, ui, h, pt, pa: f"{sc}{sep}{ui}{h}{pt}{pa}",
              st.sampled_from(["http", "https", "HTTP", "hTTps", "ftp", "", "http\t"]),
              st.sampled_from(["://", ":/", ":///", "//", ":\\\\", "://\\"]), _userinfo, _hosts, _ports, _paths),
    st.text(_TRICKY + "htps", max_size=40).map(lambda t: "http://" + t),
    # Mostly well-formed, with the tricky characters where a check could be fooled: after the
    # host, around the port, in the path.
    st.builds(lambda sc, h, pt, mid, pa: f"{sc}://{h}{pt}{mid}{pa}",
              st.sampled_from(["http", "https"]),
              st.one_of(_hosts, st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,10}[a-z0-9]", fullmatch=True)),
              st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}")),
              st.sampled_from(["", "", "", "\\@evil.com", "@evil.com", ":80@evil.com", "%2F@evil.com", "\\",
                               "/..\\@evil.com", "/@evil.com", "/:80@evil.com", "#@evil.com", "?@evil.com", ";@evil.com"]),
              _paths),
)


@hsettings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_urls)
@example("http://127.0.0.1:9999\\@localhost:8000/v1")
@example("http://localhost:8000\\@127.0.0.1:9999/v1")
@example("http://a@b@c:80/")
@example("http://localhost:8000/v1")
def test_a_url_the_check_accepts_connects_only_where_it_said(url):
    try:
        target = check_url(url)
    except UrlError:
        return
    approved = (target.scheme, _strip(target.host), target.port)
    for base in (url, url.rstrip("/") + "/reset", url.rstrip("/") + "/chat/completions"):
        seen = connects_to(base)
        assert {(sc, h, p) for _, sc, h, p in seen} == {approved}, (url, base, seen)
    assert origin_of(url) == target.origin


# --------------------------------------------------------------------------- in the worker

def test_the_api_key_never_goes_where_the_check_did_not_approve(settings, redis_client, env_server, model_server,
                                                                 runtime_with, listener):
    _, env_url = env_server
    model, model_url = model_server
    rt = runtime_with(llm_api_key="sk-never-leaked", llm_base_url=model_url + "/v1")
    url = backslash_url(listener.port, model_url) + "/v1"
    job, (ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=url)
    assert rt.run(job.job_id, ep.episode_id) == "failed"
    (letter,) = DeadLetterQueue(redis_client, settings).list(job_id=job.job_id)
    assert letter.reason == errors.BAD_TASK and "model endpoint" in letter.error and "backslash" in letter.error
    time.sleep(0.3)
    assert listener.received == []


def test_an_env_url_off_the_allow_list_by_the_connecting_parser_is_never_called(settings, redis_client, env_server,
                                                                                 model_server, runtime_with,
                                                                                 listener):
    env, env_url = env_server
    _, model_url = model_server
    t = check_url(env_url)
    rt = runtime_with(env_hosts=f"{t.host}:{t.port}")
    job, (ep,) = make_job(redis_client, settings, env_url=backslash_url(listener.port, env_url),
                          llm_url=model_url + "/v1")
    before = env.stats()["requests"]
    assert rt.run(job.job_id, ep.episode_id) == "failed"
    (letter,) = DeadLetterQueue(redis_client, settings).list(job_id=job.job_id)
    assert letter.reason == errors.BAD_TASK and "env server" in letter.error and "backslash" in letter.error
    time.sleep(0.3)
    assert listener.received == [] and env.stats()["requests"] == before


def test_submit_refuses_the_url_and_exits_2_naming_file_entry_and_field(settings, redis_client, tmp_path):
    tasks = tmp_path / "t.yaml"
    tasks.write_text("environments:\n  - env_name: guess_number\n"
                     "    base_url: 'http://127.0.0.1:9\\@localhost:8000'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "submit", str(tasks)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert str(tasks) in out.stderr and "entry 1" in out.stderr and "field 'base_url'" in out.stderr
    assert "backslash" in out.stderr and "Traceback" not in out.stderr
    assert redis_client.llen(settings.queue) == 0


# --------------------------------------------------------------------------- other calls to job URLs

def test_the_orphan_closer_calls_only_env_servers_the_checks_accept(settings, redis_client, env_server, listener):
    env, env_url = env_server
    keys = Keys(settings.key_prefix)
    t = check_url(env_url)
    client = EnvClient(settings)
    closer = OrphanCloser(redis_client, keys, client, env_hosts=HostAllowlist(f"{t.host}:{t.port}"))
    for base_url in (f"http://127.0.0.1:{listener.port}", backslash_url(listener.port, env_url), env_url):
        redis_client.rpush(keys.orphans, OrphanInstance(base_url=base_url, env_name="guess_number",
                                                        instance_id="x~1-abc").pack())
    before = env.stats()["requests"]
    closer.tick()
    time.sleep(0.3)
    assert listener.received == []
    assert closer.refused == 2 and closer.closed == 1 and env.stats()["requests"] == before + 1
    client.shutdown()


class _Redirect(BaseHTTPRequestHandler):
    target = ""

    def do_GET(self):  # noqa: N802
        self.send_response(302)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_breaker_probes_get_the_same_checks_and_follow_no_redirect(listener):
    board = BreakerBoard(None, None, "w", env_hosts=HostAllowlist("envs.internal:8080"))
    with pytest.raises(errors.EpisodeError) as ei:
        board.for_model(f"http://127.0.0.1:{listener.port}\\@localhost:8000/v1")
    assert ei.value.reason == errors.BAD_TASK and not ei.value.transient
    with pytest.raises(errors.EpisodeError, match="INTERACTOR_ENV_HOSTS"):
        board.for_env(f"http://127.0.0.1:{listener.port}")
    # A model endpoint may be anywhere, but its probe does not follow a redirect elsewhere.
    _Redirect.target = f"http://127.0.0.1:{listener.port}/models"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        breaker = BreakerBoard(None, None, "w").for_model(f"http://127.0.0.1:{server.server_port}/v1")
        assert breaker.confirm_down() is False  # the 302 is an answer: the server is up
    finally:
        server.shutdown()
        server.server_close()
    time.sleep(0.3)
    assert listener.received == []


# --------------------------------------------------------------------------- redaction

@pytest.mark.parametrize("url, secret", [
    ("https://TOKEN123@api.example.com/v1", "TOKEN123"),
    ("https://u:pw123@api.example.com/v1", "pw123"),
    ("https://h/cb?state=1&code=abc123", "abc123"),
    ("https://bucket.s3/x?X-Amz-Signature=sig123&X-Amz-Credential=cred123", "sig123"),
    ("https://bucket.s3/x?X-Amz-Signature=sig123&X-Amz-Credential=cred123", "cred123"),
    ("https://blob/x?sv=1&sig=abc123", "abc123"),
    ("https://h/#access_token=tok123", "tok123"),
    # Passwords with a character left unencoded that ends the host for a URL parser.
    ("redis://:pw#123@h:6379/0", "pw"),
    ("redis://:pw?123@h:6379/0", "123"),
    ("redis://:pw/123@h:6379/0", "123"),
    ("redis://:p@w123@h:6379/0", "w123"),
    ("redis://user:pw123/x@h:6379/0?x=1&token=tok123", "tok123"),
])
@pytest.mark.unit
def test_redact_url_hides_tokens_codes_and_signatures(url, secret):
    shown = redact_url(url)
    assert secret not in shown and "***" in shown, shown
    assert "api.example.com" in shown or "h/" in shown or "h:" in shown or "s3" in shown or "blob" in shown


@given(scheme=st.sampled_from(["redis", "rediss", "unix", "https", "redis+sentinel"]),
       middle=st.text(min_size=0, max_size=10), after=st.sampled_from(["h:6379/0", "/run/r.sock", "h/v1?a=b"]))
@example(scheme="redis", middle="#", after="h:6379/0")
@example(scheme="https", middle="/x?y", after="h/v1?a=b")
@hsettings(max_examples=300, deadline=None)
@pytest.mark.unit
def test_redact_url_never_shows_a_password_whatever_it_holds(scheme, middle, after):
    password = "Zq9" + middle + "Xw7"  # any part of it that shows carries one of the ends
    for url in (f"{scheme}://:{password}@{after}", f"{scheme}://user:{password}@{after}"):
        shown = redact_url(url)
        assert "Zq9" not in shown and "Xw7" not in shown, (url, shown)


# --------------------------------------------------------------------------- code a job names

@pytest.mark.unit
def test_only_what_a_module_defines_itself_can_be_imported():
    assert import_object("envs.bundled:BundledEnv").__name__ == "BundledEnv"
    for path in ("workers.experience:os", "workers.experience:Path", "tests.reexported_env:BundledEnv"):
        with pytest.raises(ImportError, match="not defined in"):
            import_object(path)
    with pytest.raises(ImportError, match="no dotted path"):
        import_object("workers.experience:os.abort")


def test_a_worker_refuses_code_reached_through_another_module_and_survives(settings, procs, redis_client,
                                                                            env_server, model_server):
    _, env_url = env_server
    _, model_url = model_server
    settings = settings.replace(llm_base_url=model_url + "/v1", env_classes="tests.reexported_env:*")
    procs.settings = settings
    ledger = Ledger(redis_client, Keys(settings.key_prefix))
    hook_job, (hook_ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                                    job_id="hookjob", episode_hook="workers.experience:os.abort")
    path_job, (path_ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                                    job_id="pathjob", episode_hook="workers.experience:Path")
    # An env class under an allowed pattern, but defined elsewhere (envs.bundled, not on the list).
    cls_job = JobSpec(job_id="clsjob", llm_base_url=model_url + "/v1", model="stand-in", episodes=1, groups=1)
    cls_ep = EpisodeSpec(job_id="clsjob", episode_id="clsjob.1.1.1.1", group_id="clsjob.1.1.1", group_size=1,
                         env_name="guess_number", base_url="", env_params={"low": 1, "high": 8}, seed=1,
                         queue=settings.queue, transport="inproc", env_class="tests.reexported_env:BundledEnv")
    ledger.create_job(cls_job, [cls_ep])
    good_job, (good_ep,) = make_job(redis_client, settings, env_url=env_url, llm_url=model_url + "/v1",
                                    job_id="goodjob")
    worker = procs.worker("w1")
    push_episodes(redis_client, [(j.job_id, e.episode_id, settings.queue)
                                 for j, e in ((hook_job, hook_ep), (path_job, path_ep), (cls_job, cls_ep),
                                              (good_job, good_ep))])
    wait_for(lambda: ledger.states("goodjob") and set(ledger.states("goodjob").values()) <= {"done"}
             and all(set(ledger.states(j).values()) <= {"failed"} for j in ("hookjob", "pathjob", "clsjob")),
             90, what="episodes settled")
    dlq = DeadLetterQueue(redis_client, settings)
    (hook_letter,) = dlq.list(job_id="hookjob")
    assert hook_letter.reason == errors.BAD_TASK and "no dotted path" in hook_letter.error
    (path_letter,) = dlq.list(job_id="pathjob")
    assert path_letter.reason == errors.BAD_TASK and "not defined in workers.experience" in path_letter.error
    (cls_letter,) = dlq.list(job_id="clsjob")
    assert "not defined in tests.reexported_env" in cls_letter.error, cls_letter.error
    # The worker process never died (its supervisor would have restarted it: os.abort did, -6).
    assert worker.poll() is None and "without being asked to" not in procs.log("w1"), procs.log("w1")[-3000:]


def test_submit_refuses_a_dotted_episode_hook_and_exits_2(settings, redis_client, tmp_path):
    tasks = tmp_path / "t.yaml"
    tasks.write_text("environments:\n  - env_name: guess_number\n    base_url: 'http://127.0.0.1:8000'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env.update(settings.as_environ())
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "submit", str(tasks),
                          "--episode-hook", "workers.experience:os.abort"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "episode_hook" in out.stderr and "no dotted attribute path" in out.stderr and "Traceback" not in out.stderr
    assert redis_client.llen(settings.queue) == 0
