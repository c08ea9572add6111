"""The Redis connections every role makes from ``REDIS_URL`` (broker/redisurl.py,
broker/redisconn.py, broker/kombu_redis.py), against real Redis servers: each one-server form
the settings accept is read into one address, from which our pools and the Celery broker's
connect to the same server and database (a unix socket, a ``?db=`` query, TLS), and a Celery
worker takes and runs a job through it; each form refused says why in one line, without the
password; a property test that no password, encoded or not, shows in a refusal or is read as
anything but itself. And the quick clean-connection check our pools and kombu's channel use
(``QuickReadyParser``): a pooled connection the server closed is replaced, not used."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from urllib.parse import quote

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from broker.celery_app import make_app
from broker.embedded import redis_server_binary
from broker.redisconn import QuickReadyParser, client_for, connect
from broker.redisurl import RedisUrlError, SentinelAddress, ServerAddress, parse_redis_url, redis_password
from broker.settings import Settings, SettingsError, redact_url
from tests.storecheck import assert_trajectories_sound
from tests.test_integration import wait_job_stored, write_tasks
from tests.test_tls import tls_redis  # noqa: F401 (a fixture: a TLS redis-server, or skipped)


def _one_connection(settings):
    return connect(settings, max_connections=1)


def _parser_of(client: redis.Redis):
    assert client.ping()
    conn = client.connection_pool.get_connection()
    try:
        return conn._parser
    finally:
        client.connection_pool.release(conn)


def test_our_pools_and_kombus_channel_use_the_quick_check(settings):
    assert isinstance(_parser_of(_one_connection(settings)), QuickReadyParser)
    app = make_app(settings)
    with app.connection_for_write() as c:
        kclient = c.default_channel._create_client()
        assert kclient is c.default_channel._create_client()  # one client per channel
        assert isinstance(_parser_of(kclient), QuickReadyParser)


def test_a_connection_the_server_closed_is_replaced_not_used(settings, redis_client):
    client = _one_connection(settings)
    client.client_setname("quick-check-victim")
    my_id = client.client_id()
    killed = redis_client.client_kill_filter(_id=my_id)
    assert killed == 1
    # The pool's only connection is closed at the server; the next command must reconnect.
    assert client.set(f"{settings.key_prefix}:k", "v") is True
    assert client.get(f"{settings.key_prefix}:k") == b"v"
    assert client.client_id() != my_id


def test_without_hiredis_extras_the_options_are_plain(settings):
    # The options are only ever the parser class; a client built with them talks to Redis.
    r = redis.Redis.from_url(settings.redis_url, parser_class=QuickReadyParser)
    assert r.ping()


# --- the one-server forms, read ----------------------------------------------------------------

@pytest.mark.parametrize("url, address", [
    ("redis://:pw@h:6380/2", ServerAddress("redis", host="h", port=6380, db=2, password="pw")),
    ("redis://h", ServerAddress("redis", host="h", port=6379)),
    ("redis://h:1/", ServerAddress("redis", host="h", port=1)),
    ("redis://h:1?db=3", ServerAddress("redis", host="h", port=1, db=3)),
    ("REDIS://User:p%3Aw@H.example:1/0", ServerAddress("redis", host="h.example", port=1, username="User",
                                                       password="p:w")),
    ("rediss://:p%23w%3F%2F%40%25@[::1]:7/1", ServerAddress("rediss", host="::1", port=7, db=1, password="p#w?/@%")),
    ("unix:///run/redis.sock", ServerAddress("unix", path="/run/redis.sock")),
    ("unix://:p%40w@/run/a%20b.sock?db=4", ServerAddress("unix", path="/run/a b.sock", db=4, password="p@w")),
])
@pytest.mark.unit
def test_each_one_server_form_is_read_into_its_address(url, address):
    assert parse_redis_url(url) == address
    assert redis_password(url) == address.password
    if address.password:
        assert address.password not in repr(address) and address.password not in address.shown()
    assert Settings.from_env({}, redis_url=url).redis_url == url  # accepted by every role


@pytest.mark.parametrize("url, why", [
    ("redis://:s3#cret@h:6379/0", "percent-encode"),
    ("redis://:s3?cret@h:6379/0", "percent-encode"),
    ("redis://:s3/cret@h:6379/0", "percent-encode"),
    ("redis://:s3@cret@h:6379/0", "percent-encode"),
    ("unix://:s3#cret@/run/redis.sock", "percent-encode"),
    ("redis://:s3%cret@h:6379/0", "percent-encoding"),
    ("redis://:s3 cret@h:6379/0", "whitespace"),
    ("redis://:s3cret@h:port/0", r"HOST\[:PORT\]"),
    ("redis://:s3cret@h:0/0", r"HOST\[:PORT\]"),
    ("redis://:s3cret@h_1:6379/0", r"HOST\[:PORT\]"),
    ("redis://:s3cret@h:99999/0", "out of range"),
    ("redis://:s3cret@h:6379/0?socket_timeout=5", "'socket_timeout' is not supported"),
    ("redis://:s3cret@h:6379/0?password=s3cret", "'password' is not supported"),
    ("redis://:s3cret@h:6379/0?db=0", "database twice"),
    ("redis://:s3cret@h:6379?db=1&db=2", "twice"),
    ("redis://:s3cret@h:6379/zero", "database number"),
    ("redis://:s3cret@h:6379?db=x", "database number"),
    ("redis://:s3cret@h:6379/0#frag", "fragment"),
    ("unix://:s3cret@run/redis.sock", "absolute path"),
    ("unix://:s3cret@/run/", "absolute path"),
    ("http://:s3cret@h:6379/0", "must start with"),
    ("127.0.0.1:6379", "must start with"),
])
@pytest.mark.unit
def test_a_bad_one_server_url_is_refused_in_one_line_never_with_its_password(url, why):
    with pytest.raises(RedisUrlError, match=why) as err:
        parse_redis_url(url)
    assert "cret" not in str(err.value)
    with pytest.raises(SettingsError, match=why) as err:
        Settings.from_env({}, redis_url=url)
    assert "cret" not in str(err.value) and "\n" not in str(err.value), str(err.value)


# Markers at both ends of a generated password: any part of it that shows carries one of them.
_HEAD, _TAIL = "Zq9", "Xw7"
_FORMS = ["redis://:{}@h:6379/0", "rediss://u:{}@h/1", "unix://:{}@/run/redis.sock?db=1",
          "redis+sentinel://:{}@s1:26379,s2/ix/0"]


@given(form=st.sampled_from(_FORMS), middle=st.text(min_size=0, max_size=12))
@example(form=_FORMS[0], middle="#")
@example(form=_FORMS[0], middle="?x=1@")
@example(form=_FORMS[2], middle="/")
@example(form=_FORMS[3], middle="%zz")
@hsettings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.unit
def test_a_password_is_read_as_itself_or_refused_and_never_shown(form, middle):
    password = _HEAD + middle + _TAIL
    encoded = form.format(quote(password, safe=""))
    assert parse_redis_url(encoded).password == password
    raw = form.format(password)
    try:
        address = parse_redis_url(raw)
    except RedisUrlError as exc:
        assert _HEAD not in str(exc) and _TAIL not in str(exc), str(exc)
    else:  # accepted unencoded: then it is read as written, and the host is the one after it
        assert address.password.startswith(_HEAD) and address.password.endswith(_TAIL)
        host = address.sentinels[0][0] if isinstance(address, SentinelAddress) else address.host
        assert host in ("h", "s1", "")
    for text in (raw, encoded):
        shown = redact_url(text)
        assert _HEAD not in shown and _TAIL not in shown, shown
        try:
            Settings.from_env({}, redis_url=text)
        except SettingsError as exc:
            assert _HEAD not in str(exc) and _TAIL not in str(exc), str(exc)


# --- the one-server forms, connected: our pools and the Celery broker's -----------------------

SOCKET_PASSWORD = "sock-pw-4d2"


@pytest.fixture(scope="module")
def socket_redis():
    """A redis-server on a unix socket only (no TCP port), with a password. Its folder is short:
    a socket's path has at most 107 bytes."""
    folder = tempfile.mkdtemp(prefix="ix-sock-")
    sock = f"{folder}/redis.sock"
    proc = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
                             "--requirepass", SOCKET_PASSWORD, "--save", "", "--appendonly", "no", "--dir", folder],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = client_for(f"unix://:{SOCKET_PASSWORD}@{sock}", socket_connect_timeout=1)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            assert proc.poll() is None and time.monotonic() < deadline, "the socket redis-server did not start"
            time.sleep(0.05)
    client.close()
    yield sock
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def _tcp_url(server, tail: str) -> str:
    return f"redis://:{server.password}@127.0.0.1:{server.port}{tail}"


def _assert_both_readers_reach_one_database(settings: Settings, db: int, password: str) -> None:
    """Our pool and the Celery broker's both answer, on the same server and database ``db``."""
    ours = connect(settings)
    assert ours.ping()
    key = f"{settings.key_prefix}:where:{uuid.uuid4().hex[:6]}"
    ours.set(key, "here", ex=60)
    app = make_app(settings)
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        assert client.ping()
        assert client.get(key) == b"here"  # the same database as ours
        assert client.connection_pool.connection_kwargs["db"] == db
        assert password not in conn.as_uri()
    assert password not in app.conf.broker_url  # Celery is given where Redis is, not how to log in
    ours.close()


@pytest.mark.parametrize("tail, db", [("/0", 0), ("", 0), ("?db=1", 1), ("/2", 2)])
def test_a_tcp_url_connects_our_pools_and_the_celery_broker_to_its_database(redis_server, settings, tail, db):
    s = settings.replace(redis_url=_tcp_url(redis_server, tail)).validated()
    _assert_both_readers_reach_one_database(s, db, redis_server.password)


@pytest.mark.parametrize("query, db", [("", 0), ("?db=0", 0), ("?db=1", 1)])
def test_a_unix_socket_url_connects_our_pools_and_the_celery_broker(socket_redis, settings, query, db):
    s = settings.replace(redis_url=f"unix://:{SOCKET_PASSWORD}@{socket_redis}{query}").validated()
    _assert_both_readers_reach_one_database(s, db, SOCKET_PASSWORD)
    with make_app(s).connection_for_write() as conn:
        pool = conn.default_channel.client.connection_pool
        assert issubclass(pool.connection_class, redis.UnixDomainSocketConnection)
        assert "socket_keepalive" not in pool.connection_kwargs


def test_a_rediss_url_connects_our_pools_and_the_celery_broker(tls_redis, settings):  # noqa: F811
    url, ca, _ = tls_redis
    s = settings.replace(redis_url=url, redis_tls_ca=ca).validated()
    _assert_both_readers_reach_one_database(s, 0, "tls-pw")
    with make_app(s).connection_for_write() as conn:
        assert issubclass(conn.default_channel.client.connection_pool.connection_class, redis.SSLConnection)


def _run_a_job_through(settings: Settings, procs, env_server, model_server, tmp_path, password: str) -> None:
    _, env_url = env_server
    _, model_url = model_server
    s = settings.replace(llm_base_url=model_url + "/v1")
    procs.settings = s
    from producer.enqueue import submit

    sub = submit(connect(s), s, [write_tasks(tmp_path, env_url, guess=1, rows=2, arith_num=1)])
    procs.worker("w1")
    procs.consumer()
    res = wait_job_stored(s, sub.job.job_id, 3, timeout=120)
    assert res["completed"] == 3, procs.log("w1")[-3000:]
    assert_trajectories_sound(s.results_db, sub.job.job_id)
    assert password not in procs.log("w1") + procs.log("consumer")


@pytest.mark.integration
def test_a_celery_worker_takes_a_job_through_a_unix_socket(socket_redis, settings, procs, env_server, model_server,
                                                           tmp_path):
    s = settings.replace(redis_url=f"unix://:{SOCKET_PASSWORD}@{socket_redis}?db=1")
    _run_a_job_through(s, procs, env_server, model_server, tmp_path, SOCKET_PASSWORD)


@pytest.mark.integration
def test_a_celery_worker_takes_a_job_through_a_db_query(redis_server, settings, procs, env_server, model_server,
                                                        tmp_path):
    s = settings.replace(redis_url=_tcp_url(redis_server, "?db=3"))
    _run_a_job_through(s, procs, env_server, model_server, tmp_path, redis_server.password)
