"""The rollout feed under hostile and unlucky input: what a model server stamps as its version,
what a trainer publishes, takes that wait long, answers a trainer never received, acks that
mix held and foreign groups, groups that go stale for ever, a feed reading the wrong store, and
the cost of catching up. Real Redis, real worker and consumer processes, real HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from broker import feed
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import AttemptRecord, FeedGroup, JobSpec, StepRecord
from broker.states import AttemptStatus, FeedGroupStatus
from consumer.storage import open_store
from interactor.feed_service import FeedService
from interactor.feedserve import FeedApp, make_server
from producer.continuous import ContinuousProducer, create_continuous_job
from tests.conftest import ROOT, wait_for
from tests.test_feed import run_factory, take_all, write_tasks  # noqa: F401 - run_factory is a fixture

pytestmark = pytest.mark.integration

JOB = "trust-job"


def feed_job(settings, redis_client, **cfg) -> Keys:
    """A job with a feed and no episode: groups are announced by the test itself."""
    keys = Keys(settings.key_prefix)
    Ledger.for_settings(redis_client, settings).create_job(
        JobSpec(job_id=JOB, llm_base_url="http://llm/v1", model="m", episodes=0, groups=0), [])
    feed.enable(redis_client, keys, JOB, feed.FeedConfig(**({"max_ahead": 16} | cfg)))
    return keys


def announce(redis_client, keys, gid: str, *, members=None, oldest=None, status=FeedGroupStatus.READY, job=JOB):
    members = members or [f"{gid}-ep"]
    g = FeedGroup(job_id=job, group_id=gid, status=status, members=members, rewards=[1.0] * len(members),
                  size=len(members), oldest_version=oldest, newest_version=oldest)
    assert feed.announce(redis_client, keys, g.pack(), job, gid)


# --- versions a model server stamps --------------------------------------------------------------
@pytest.mark.parametrize("stamped", ["²", "18446744073709551616", "v①", "9" * 5000])
def test_a_version_a_model_server_stamps_never_stops_the_consumer_or_the_feed(run_factory, tmp_path, model_server,
                                                                             procs, stamped):
    """A model answer whose metadata.weight_version is no version we can order (non-ASCII
    digits, past 2^64, thousands of digits) made the consumer of the whole fleet exit on the
    group's announcement, and again on every restart. Now such a step is unversioned: the
    groups are announced and delivered, the consumer process lives on, and the feed server's
    catching up and the original route read them without a fault."""
    model, _ = model_server
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=2, env_num=2), feed_max_ahead=4)
    model.weight_version = stamped
    run.start_producer()
    got = take_all(run, "t", 2)
    for g in got:
        assert g["oldest_version"] is None and g["versions_behind"] is None
        assert all(st["weight_version"] == stamped for s in g["samples"] for st in s["steps"])
    assert procs.procs["consumer"].poll() is None, procs.log("consumer")[-3000:]
    assert "Traceback" not in procs.log("consumer")
    run.service.backfill()
    run.service.ack("t", [g["group_id"] for g in got])
    assert run.service.stats()["acked"] == 2


def test_an_announcement_that_fails_on_its_data_is_contained_to_its_group(settings, redis_client, tmp_path):
    """Whatever goes wrong announcing one group (here: a member row whose reward the record
    cannot carry) is the group's, not the fleet's: it is reported failed with the reason and
    counted, and the consumer goes on with the others."""
    from consumer.announce import FeedAnnouncer

    keys = feed_job(settings, redis_client)

    class Rows:
        identity = "sqlite:/nowhere"

        def feed_groups(self, ids):
            bad = {"group_id": "bad", "job_id": JOB, "size": 1, "members": [("e1", "completed", 2**70, None)],
                   "versions": []}
            good = {"group_id": "good", "job_id": JOB, "size": 1, "members": [("e2", "completed", 1.0, None)],
                    "versions": ["3"]}
            return {g["group_id"]: g for g in (bad, good) if g["group_id"] in ids}

    announcer = FeedAnnouncer(redis_client, keys, Rows())
    assert announcer.announce_groups(["bad", "good"]) == 2
    svc = FeedService(redis_client, settings, JOB)
    assert [g["group_id"] for g in svc.take("t", 2, 0.5)] == ["good"]
    st = svc.stats()
    assert st["failed"] == 1 and "could not be announced" in st["recent_failures"][0]["reason"]
    assert feed.counters(redis_client, keys, JOB)[feed.C_ANNOUNCE_ERRORS] == 1 and announcer.errors == 1


# --- versions a trainer publishes ----------------------------------------------------------------
def test_versions_are_bounded_compared_exactly_and_resettable(settings, redis_client, redis_server):
    keys = feed_job(settings, redis_client)
    svc = FeedService(redis_client, settings, JOB)
    for bad in (2**64, 2**53, -1, "²", "v3", 1.5, True, "9" * 5000):
        with pytest.raises(feed.FeedError) as err:
            svc.set_version(bad)
        assert err.value.status == 400 and "2^53" in str(err.value)
    assert feed.current_version(redis_client, keys, JOB) is None
    top = feed.MAX_VERSION
    assert svc.set_version(top) == top
    with pytest.raises(feed.FeedError) as err:  # one below the top: compared exactly, refused
        svc.set_version(top - 1)
    assert err.value.status == 409 and f"interactor feed version {JOB} --reset" in str(err.value)
    # What only an edit of Redis could leave there is no version (every step stays packable),
    # is named in the refusal, and an operator's reset repairs it, counted.
    redis_client.set(keys.feed_version(JOB), "18446744073709551616")
    assert feed.current_version(redis_client, keys, JOB) is None
    with pytest.raises(feed.FeedError) as err:
        svc.set_version(5)
    assert "18446744073709551616" in str(err.value)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "interactor.cli", "feed", "version", JOB, "--redis-url", redis_server.url,
           "--key-prefix", settings.key_prefix]
    out = subprocess.run([*cmd, "--reset", "4"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "reset from 18446744073709551616 to 4" in out.stdout and "reset" in out.stderr
    assert svc.set_version(5) == 5
    shown = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0 and f"job {JOB}: version 5" in shown.stdout
    bad = subprocess.run([*cmd, "--reset", "-2"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "2^53" in bad.stderr and "Traceback" not in bad.stderr
    assert feed.counters(redis_client, keys, JOB)[feed.C_VERSION_RESETS] == 1


# --- a take is a set -----------------------------------------------------------------------------
def test_a_take_that_waits_past_the_ack_timeout_holds_each_group_once(settings, redis_client):
    """A take waiting for a full batch longer than the ack timeout re-claimed the group it was
    already holding: one answer carried the same group three times. Now a take holding a group
    answers within half the ack timeout, with the group once, and no other take can claim it in
    the meantime."""
    keys = feed_job(settings, redis_client, ack_timeout_s=1.0)
    announce(redis_client, keys, "g1")
    svc = FeedService(redis_client, settings, JOB)
    t0 = time.monotonic()
    got = svc.take("a", 3, 8.0)
    took = time.monotonic() - t0
    assert [g["group_id"] for g in got] == ["g1"] and got[0]["redelivered"] is False
    assert took < 6.0, took  # it did not wait out its 8 s for a batch it could not fill
    # Still a's (its ack clock started at the answer), settled once, never handed out again.
    assert svc.ack("a", ["g1"]) == {"acked": ["g1"], "already": []}
    st = svc.stats()
    assert st["delivered"] == 1 and st["redelivered"] == 0 and st["acked"] == 1
    assert svc.take("b", 1, 1.5) == []


# --- an answer that never arrived ----------------------------------------------------------------
def _raw_post(port: int, path: str, body: dict, give_up_after: float | None = None) -> bytes:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if give_up_after is not None:
        time.sleep(give_up_after)
        s.close()
        return b""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, rest = out.partition(b"\r\n\r\n")
    n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")][0].split(b":")[1])
    while len(rest) < n:
        rest += s.recv(65536)
    s.close()
    return rest


@pytest.mark.parametrize("route", ["/get_rollout_data", "/take"])
def test_groups_of_an_answer_the_trainer_gave_up_on_go_to_the_next_call(settings, redis_client, route):
    """/get_rollout_data acknowledged its groups before writing the answer: a trainer whose
    client gave up waiting lost them for good. Now groups are settled once the answer is
    written, and those of an answer whose trainer is gone are handed to the next call."""
    keys = feed_job(settings, redis_client, ack_timeout_s=60.0)
    announce(redis_client, keys, "g1")
    announce(redis_client, keys, "g2")
    svc = FeedService(redis_client, settings, JOB)
    server = make_server(FeedApp(svc), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    body = ({"batch_size": 3, "timeout": 2} if route == "/get_rollout_data"
            else {"trainer": "rollout-compat", "batch": 3, "timeout": 2})
    try:
        _raw_post(port, route, body, give_up_after=1.0)
        # the server answers once its wait is over, finds the client gone and gives the groups back
        wait_for(lambda: not redis_client.xpending(keys.feed_stream(JOB), feed.TRAINERS)["pending"]
                 or redis_client.xpending_range(keys.feed_stream(JOB), feed.TRAINERS, "-", "+", 1)[0][
                     "time_since_delivered"] >= 60_000, 30, what="the groups given back")
        again = json.loads(_raw_post(port, route, body | {"timeout": 1}))
        groups = (again["data"]["meta_info"]["finished_groups"] if route == "/get_rollout_data"
                  else len(again["groups"]))
        assert groups == 2, again
        if route == "/get_rollout_data":  # settled once written: nothing is handed out a third time
            wait_for(lambda: svc.stats()["acked"] == 2, 30, what="both groups settled")
            assert json.loads(_raw_post(port, route, body | {"timeout": 0.5}))["data"]["meta_info"][
                "finished_groups"] == 0
    finally:
        server.shutdown()
        server.server_close()


# --- staleness that never ends -------------------------------------------------------------------
def test_stale_reruns_are_bounded_and_the_last_is_reported(settings, redis_client, env_server, tmp_path):
    """A model server whose versions count differently from the trainer's made every group
    stale, re-run for ever, and nothing was delivered. Re-runs for staleness now count against
    refill_max, as re-runs of failed groups do; the group past it is dropped and reported."""
    _, env_url = env_server
    s = settings.replace(feed_max_staleness=0, feed_refill_max=1, llm_base_url="http://127.0.0.1:9/v1")
    job = create_continuous_job(redis_client, s, [write_tasks(tmp_path, env_url, rows=1, env_num=2)], epochs=1)
    keys = Keys(s.key_prefix)
    producer = ContinuousProducer(redis_client, s, job.job_id)
    svc = FeedService(redis_client, s, job.job_id)
    svc.set_version(5)
    gid = producer.produce_one(producer.config())
    members = [m.decode() for m in redis_client.hkeys(keys.job_episodes(job.job_id)) if m.decode().startswith(gid)]
    announce(redis_client, keys, gid, members=sorted(members), oldest=1, job=job.job_id)
    assert svc.take("t", 1, 0.3) == []  # 4 versions behind: re-run
    second = producer.produce_one(producer.config())
    assert second and second != gid
    members = [m.decode() for m in redis_client.hkeys(keys.job_episodes(job.job_id)) if m.decode().startswith(second)]
    announce(redis_client, keys, second, members=sorted(members), oldest=2, job=job.job_id)
    assert svc.take("t", 1, 0.3) == []  # behind again: the bound is reached, dropped
    assert redis_client.llen(keys.feed_redo(job.job_id)) == 0
    st = svc.stats()
    assert st["stale_requeued"] == 1 and st["stale_dropped"] == 1
    assert "after 1 re-runs" in st["recent_failures"][0]["reason"]
    assert st["recent_failures"][0]["group_id"] == second


# --- the feed reads the store its job's consumer writes -----------------------------------------
def test_a_group_whose_steps_cannot_be_read_is_never_delivered_empty(settings, redis_client, tmp_path):
    keys = feed_job(settings, redis_client)
    announce(redis_client, keys, "g1", members=["ep-a", "ep-b"])
    store = open_store(str(tmp_path / "other.sqlite"))
    try:
        svc = FeedService(redis_client, settings, JOB, store)
        assert svc.take("t", 1, 0.5) == []
        st = svc.stats()
        assert st["failed"] == 1 and st["delivered"] == 0
        reason = st["recent_failures"][0]["reason"]
        assert "ep-a" in reason and "no stored steps" in reason and "other.sqlite" in reason
    finally:
        store.close()


def test_a_feed_server_reading_another_store_than_its_consumer_writes_refuses(settings, redis_client, tmp_path,
                                                                              redis_server):
    keys = feed_job(settings, redis_client)
    announce(redis_client, keys, "g1")  # something to serve: a feed with nothing left is refused for that
    written = open_store(str(tmp_path / "written.sqlite"))
    written.close()
    redis_client.set(keys.job_store(JOB), f"sqlite:{tmp_path / 'written.sqlite'}")
    store = open_store(str(tmp_path / "other.sqlite"))
    try:
        with pytest.raises(feed.FeedError) as err:
            FeedService(redis_client, settings, JOB, store)
        assert err.value.status == 409 and "written.sqlite" in str(err.value) and "other.sqlite" in str(err.value)
    finally:
        store.close()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "interactor.cli", "feed", "serve", "--job", JOB, "--redis-url",
                          redis_server.url, "--key-prefix", settings.key_prefix, "--db", str(tmp_path / "other.sqlite"),
                          "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "written.sqlite" in out.stderr and "other.sqlite" in out.stderr and "Traceback" not in out.stderr


# --- catching up costs what is new ---------------------------------------------------------------
def _evals(redis_client) -> int:
    stats = redis_client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_eval", "cmdstat_evalsha"))


def settled(i: int) -> list:
    """The records of a one-episode group ``g<i>`` that completed."""
    ep = f"ep{i}"
    step = StepRecord(job_id=JOB, env_id=ep, attempt=1, step_id=1, env_name="x", llm_model="m", group_id=f"g{i}",
                      messages_json=b"[]", response="r", step_reward=1.0, cumulative_reward=1.0, terminated=True,
                      truncated=False, episode_finished=True, is_trainable=True, attempt_id="a1")
    close = AttemptRecord(job_id=JOB, episode_id=ep, attempt=1, status=AttemptStatus.COMPLETED, group_id=f"g{i}",
                          group_size=1, env_name="x", llm_model="m", total_reward=1.0, steps=1, attempt_id="a1")
    return [step, close]


def test_catching_up_on_unannounced_groups_costs_what_is_new(settings, redis_client, tmp_path):
    """The feed server re-announced a job's whole history every 30 s, one Redis script per
    group, on the thread that restarts dead workers. A round now reads the settled groups only
    when their count moved, and runs a script only for a group the feed does not have."""
    from consumer.announce import FeedAnnouncer

    keys = feed_job(settings, redis_client)
    store = open_store(str(tmp_path / "results.sqlite"))
    n = 1500
    try:
        store.write_batch([r for i in range(n) for r in settled(i)])
        announcer = FeedAnnouncer(redis_client, keys, store)
        assert announcer.backfill(JOB) == n  # the first round: everything is new
        before = _evals(redis_client)
        assert announcer.backfill(JOB) == 0
        assert _evals(redis_client) == before  # nothing settled since: no script
        fresh = FeedAnnouncer(redis_client, keys, store)  # a restarted feed server: checks, announces nothing
        assert fresh.backfill(JOB) == 0 and _evals(redis_client) == before
        store.write_batch(settled(n))
        assert announcer.backfill(JOB) == 1
        assert _evals(redis_client) == before + 1
    finally:
        store.close()


def test_an_announcement_a_failover_lost_is_made_again_though_nothing_new_settled(settings, redis_client, tmp_path):
    """A Redis failover to a replica that lacked the last writes loses announcements: the
    group's stream entry and its marker together. No group settles after it (the job's last
    ones), so the settled count the feed server's catching up keys on does not move; the lost
    group must be announced again all the same, or the feed never hands it out and its job
    never ends."""
    from consumer.announce import FeedAnnouncer

    keys = feed_job(settings, redis_client)
    store = open_store(str(tmp_path / "results.sqlite"))
    try:
        store.write_batch([r for i in range(3) for r in settled(i)])
        announcer = FeedAnnouncer(redis_client, keys, store)
        assert announcer.backfill(JOB) == 3
        entry = redis_client.hget(keys.feed_seen(JOB), "g2")
        redis_client.xdel(keys.feed_stream(JOB), entry)  # what the promoted replica never got
        redis_client.hdel(keys.feed_seen(JOB), "g2")
        assert announcer.backfill(JOB) == 1
        assert redis_client.hget(keys.feed_seen(JOB), "g2") is not None
        assert announcer.backfill(JOB) == 0
    finally:
        store.close()


def test_a_take_hands_out_only_the_groups_the_answering_primary_holds_as_taken(settings, redis_client):
    """A failover between a take's read and its answer, to a replica that never got the read,
    leaves the groups unread on the new primary: the take handed them out all the same, and
    the next take handed them out again (a trainer trained on them twice). The take's last
    write now names the groups the primary that answers holds as this trainer's; the others
    are left to the next take, which hands them out once."""
    import tests.feed_filters as filters

    keys = feed_job(settings, redis_client, filter="tests.feed_filters:lose_the_read")
    for gid in ("g1", "g2"):
        announce(redis_client, keys, gid)
    service = FeedService(redis_client, settings, JOB)
    filters.LOST_READS.append((redis_client, keys.feed_stream(JOB)))
    first = service.take("t", 2, 0.5)
    second = service.take("t", 2, 2.0)
    delivered = [g["group_id"] for g in first + second]
    assert sorted(delivered) == ["g1", "g2"], delivered
    assert service.ack("t", delivered)["acked"] == delivered
