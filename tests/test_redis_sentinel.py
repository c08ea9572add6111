"""A fleet's Redis behind Sentinel: the URL form (broker/redisurl.py), the clients every role
makes from it (broker/redisconn.py, the Celery broker's transport), the replica waits at the
commit points (broker/replicas.py) and the sweepers seeing a failover as an outage
(broker/ledger.py ``OUTAGE_FN``). Real ``redis-server`` processes: a primary, a replica and
three Sentinels (tests/sentinel.py); the fleet under a failover is tests/test_fault_failover.py's."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from broker.celery_app import make_app
from broker.keys import Keys, member
from broker.kombu_redis import SentinelTransport
from broker.ledger import Ledger
from broker.records import AttemptRecord, EpisodeSpec, JobSpec
from broker.redisconn import QuickReadyParser, connect
from broker.redisurl import RedisUrlError, ServerAddress, parse_redis_url, redis_password
from broker.replicas import ReplicaWait
from broker.settings import Settings, SettingsError, redact_url
from broker.states import AttemptStatus, LedgerState
from tests.sentinel import SentinelCluster

# --- the URL ----------------------------------------------------------------------------------


@pytest.mark.parametrize("url, sentinels, service, db, user, password", [
    ("redis+sentinel://:pw@s1:26380,s2:26381,s3/ix/2", (("s1", 26380), ("s2", 26381), ("s3", 26379)), "ix", 2, "",
     "pw"),
    ("redis+sentinel://s1:1/mymaster", (("s1", 1),), "mymaster", 0, "", ""),
    ("redis+sentinel://app:p%40ss%2Fw%2Cd@[::1]:5000,10.0.0.2:5001/my.service-1/", (("::1", 5000), ("10.0.0.2", 5001)),
     "my.service-1", 0, "app", "p@ss/w,d"),
    ("REDIS+SENTINEL://:pw@H1:7/ix", (("h1", 7),), "ix", 0, "", "pw"),
])
@pytest.mark.unit
def test_the_sentinel_form_is_read_into_its_parts(url, sentinels, service, db, user, password):
    a = parse_redis_url(url)
    assert (a.sentinels, a.service, a.db, a.username, a.password) == (sentinels, service, db, user, password)
    assert redis_password(url) == password
    assert password not in repr(a) or not password  # an address travels in Celery's options
    Settings.from_env({}, redis_url=url)  # accepted by every role


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://:s3cret@s1:1", "must name the service"),
    ("redis+sentinel://:s3cret@s1:1/", "must name the service"),
    ("redis+sentinel://:s3cret@s1:1/ix/zero", "at most a database number"),
    ("redis+sentinel://:s3cret@s1:1/ix/0/1", "at most a database number"),
    ("redis+sentinel://:s3cret@s1:99999/ix", "out of range"),
    ("redis+sentinel://:s3cret@s1:1,/ix", "Sentinel 2 of the list"),
    ("redis+sentinel://:s3cret@s_1:1/ix", "Sentinel 1 of the list"),
    ("redis+sentinel://:s3/cret@s1:1/ix", "percent-encode"),  # a raw '/' in a password
    ("redis+sentinel://:s3cret@s1:1/ix?password=x", "query"),
    ("redis+sentinel://:s3cret@s1:1/ix#frag", "query"),
    ("redis+sentinel://:s3 cret@s1:1/ix", "whitespace"),
    ("rediss+sentinel://:s3cret@s1:1/ix", "not supported"),
    ("sentinel://:s3cret@s1:1/ix", "must start with"),
])
@pytest.mark.unit
def test_a_bad_sentinel_url_is_refused_saying_why_never_its_password(url, why):
    with pytest.raises(RedisUrlError, match=why) as err:
        parse_redis_url(url)
    assert "s3cret" not in str(err.value) and "cret" not in str(err.value)
    with pytest.raises(SettingsError, match=why) as err:
        Settings.from_env({}, redis_url=url)
    assert "s3cret" not in str(err.value)


@pytest.mark.unit
def test_passwords_of_the_sentinel_form_are_hidden_wherever_the_url_is_shown():
    url = "redis+sentinel://user:pw-of-redis@s1:26379,s2:26379/ix/0"
    assert redact_url(url) == "redis+sentinel://user:***@s1:26379,s2:26379/ix/0"
    s = Settings.from_env({"REDIS_URL": url, "INTERACTOR_REDIS_SENTINEL_PASSWORD": "pw-of-sentinels"})
    assert "pw-of-redis" not in repr(s) and "pw-of-sentinels" not in repr(s)
    assert s.redis_sentinel_password.reveal() == "pw-of-sentinels"
    assert s.as_environ()["INTERACTOR_REDIS_SENTINEL_PASSWORD"] == "pw-of-sentinels"  # for child processes
    # The one-server forms are read by the same parser (tests/test_redisconn.py has them all).
    assert parse_redis_url("redis://:pw@h:6379/0") == ServerAddress("redis", host="h", port=6379, password="pw")
    assert redis_password("redis://:p%40w@h:6379/0") == "p@w"


# --- clients through the Sentinels ------------------------------------------------------------
@pytest.fixture
def cluster(tmp_path):
    c = SentinelCluster(tmp_path / "sentinel", sentinel_password="sentinels-own-pw").start()
    yield c
    c.stop()


def _settings(cluster: SentinelCluster, **kw) -> Settings:
    return Settings.from_env({}, redis_url=cluster.url, redis_sentinel_password=cluster.sentinel_password,
                             key_prefix=f"t{uuid.uuid4().hex[:6]}", lease_ttl_s=3.0, **kw)


def test_a_client_finds_the_primary_through_the_sentinels_and_follows_a_failover(cluster):
    client = connect(_settings(cluster))
    assert client.set("k", "before") and client.get("k") == b"before"
    conn = client.connection_pool.get_connection()
    assert isinstance(conn._parser, QuickReadyParser) and conn.port == cluster.primary().port
    client.connection_pool.release(conn)
    old = cluster.kill_primary()
    cluster.wait_failover(old)
    # The pooled connection to the dead primary fails; the command is retried on the promoted one.
    assert client.set("k2", "after") and client.get("k") == b"before"
    assert cluster.primary().port != old and cluster.primary().client().get("k2") == b"after"


def test_a_wrong_sentinel_password_fails_at_once_and_says_so(cluster):
    s = Settings.from_env({}, redis_url=cluster.url, redis_sentinel_password="wrong")
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError) as err:  # no primary found: every Sentinel refused us
        connect(s).ping()
    assert time.monotonic() - t0 < 60 and "No master found" in str(err.value)
    assert "wrong" not in str(err.value)


def test_the_celery_broker_connects_through_our_sentinel_transport(cluster):
    s = _settings(cluster)
    app = make_app(s)
    assert app.conf.broker_transport.endswith(":SentinelTransport")
    assert cluster.password not in app.conf.broker_url  # the URL Celery logs names a Sentinel only
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, SentinelTransport)
        kclient = conn.default_channel._create_client()
        assert kclient is conn.default_channel._create_client()  # one client per channel
        kclient.lpush("celery-probe", "m")
    assert cluster.primary().client().lpop("celery-probe") == b"m"


# --- replica waits at the commit points --------------------------------------------------------
def _one_episode(ledger: Ledger, job_id: str) -> str:
    job = JobSpec(job_id=job_id, llm_base_url="http://127.0.0.1:1/v1", model="m", episodes=1, groups=1)
    ep = EpisodeSpec(job_id=job_id, episode_id=f"{job_id}.1", group_id=f"{job_id}.g", group_size=1, env_name="e",
                     base_url="http://127.0.0.1:2", env_params={}, seed=1, queue="q", source="t")
    ledger.create_job(job, [ep])
    return ep.episode_id


def _waits(handle) -> int:
    return int(handle.client().info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def _start_and_finish(ledger: Ledger, job_id: str) -> None:
    episode = _one_episode(ledger, job_id)
    started = ledger.start(job_id, episode, "w1")
    assert started.status == "ok"
    record = AttemptRecord(job_id=job_id, episode_id=episode, attempt=1, status=AttemptStatus.COMPLETED,
                           group_id=f"{job_id}.g", group_size=1, env_name="e", llm_model="m",
                           attempt_id=started.lease.attempt_id)
    assert ledger.finish(started.lease, record, LedgerState.DONE)


def test_start_and_finish_wait_for_the_replica_and_stop_waiting_while_it_lags(cluster):
    s = _settings(cluster)  # redis_wait auto: on with a Sentinel URL
    ledger = Ledger.for_settings(connect(s), s)
    primary, replica = cluster.primary(), cluster.replica()
    _start_and_finish(ledger, "j0")  # the scripts loaded (a first EVALSHA finds none: sent again)
    before = _waits(primary)
    _start_and_finish(ledger, "j1")
    assert _waits(primary) == before + 2 and ledger.replicas.timeouts == 0
    assert replica.client().hget(Keys(s.key_prefix).job_state("j1"), "j1.1") == LedgerState.DONE.encode()
    replica.pause()  # it reads nothing of its link
    try:
        t0 = time.monotonic()
        _start_and_finish(ledger, "j2")  # the START waits out its timeout; the FINISH no longer waits
        took = time.monotonic() - t0
        assert ledger.replicas.timeouts == 1 and _waits(primary) == before + 3
        assert s.redis_wait_timeout_ms / 1000 <= took < s.redis_wait_timeout_ms / 1000 + 5
        assert ledger.state("j2", "j2.1") == LedgerState.DONE  # the writes themselves stand
    finally:
        replica.resume()
    off = Ledger.for_settings(ledger.r, s.replace(redis_wait="off"))
    _start_and_finish(off, "j3")
    assert _waits(primary) == before + 3


@pytest.mark.unit
def test_replica_waits_follow_the_setting():
    sentinel_url = "redis+sentinel://:pw@s1:1/ix"
    for url, mode, on in [(sentinel_url, "auto", True), ("redis://:pw@h:1/0", "auto", False),
                          ("redis://:pw@h:1/0", "on", True), (sentinel_url, "off", False)]:
        assert ReplicaWait.for_settings(Settings.from_env({}, redis_url=url, redis_wait=mode)).enabled is on, (url, mode)
    with pytest.raises(SettingsError, match="redis_wait"):
        Settings.from_env({}, redis_wait="sometimes")
    with pytest.raises(SettingsError, match="redis_wait_timeout_ms"):
        Settings.from_env({}, redis_wait_timeout_ms=0)


# --- a failover is an outage to the sweepers ----------------------------------------------------
def test_the_sweep_clock_holds_reclaims_after_a_failover_however_quick(cluster):
    """A failover faster than the sweepers' gap rule (half a lease TTL) left no gap in the sweep
    clock, so leases the promoted replica had as live were reclaimed, and counted, once they
    lapsed: those of attempts whose renewals or FINISH it never got. The primary's replication
    id changes with the promotion; the sweep clock takes that for an outage."""
    s = _settings(cluster)
    client = connect(s)
    ledger = Ledger.for_settings(client, s)
    no_gap = (3600.0, 6.0)  # no gap in the clock can be long enough: only the failover can hold
    assert ledger.sweep_clock(*no_gap) is False
    episode = _one_episode(ledger, "j")
    started = ledger.start("j", episode, "w1")
    assert ledger.sweep_clock(*no_gap) is False
    cluster.wait_in_sync()
    old = cluster.kill_primary()
    cluster.wait_failover(old)
    assert ledger.sweep_clock(*no_gap) is True  # held: the leases' holders get to take them back
    assert client.exists(Keys(s.key_prefix).reclaim_hold)
    # The lease of that attempt (never renewed again if its worker "finished" on the old primary)
    # lapses in the failover's window: reclaimed uncounted once the hold is over.
    assert ledger.lapsed_in_outage(member("j", started.lease.episode_id))
    assert ledger.sweep_clock(*no_gap) is True  # still held, until the hold expires


def test_a_submit_returns_once_a_replica_has_the_job_and_knows_when_a_failover_lost_it(cluster, tmp_path):
    """A job written to a primary that died before passing it on would be reported enqueued and
    never run: the submit checks, at its end, that the primary answering has it and a replica
    too (SubmitLost otherwise)."""
    from producer.enqueue import submit
    from tests.taskfiles import write_arith_tasks

    s = _settings(cluster)
    client = connect(s)
    keys = Keys(s.key_prefix)
    primary, replica = cluster.primary(), cluster.replica()
    before = _waits(primary)
    job = submit(client, s, [write_arith_tasks(tmp_path, "http://127.0.0.1:9", rows=3, env_num=2)]).job
    assert _waits(primary) == before + 1
    assert replica.client().exists(keys.job_spec(job.job_id))  # on the replica when submit returned
    waits = ReplicaWait.for_settings(s)
    assert waits.confirm(client, keys.job_spec(job.job_id), keys.replica_barrier)
    assert not waits.confirm(client, keys.job_spec("a-job-the-failover-lost"), keys.replica_barrier)
