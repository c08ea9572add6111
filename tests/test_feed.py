"""The online-RL feed (issue 22) against real parts: the session's Redis, real worker and
consumer processes, the stand-in env and model servers, and the feed service."""

from __future__ import annotations

import json
import re
import signal
import textwrap
import threading
import time

import pytest

from broker import feed
from broker.keys import Keys
from broker.states import FeedGroupStatus
from consumer.storage import open_store
from interactor.feed_service import FeedService
from producer.continuous import ContinuousProducer, create_continuous_job
from tests.conftest import wait_for
from tests.taskfiles import write_arith_tasks

pytestmark = pytest.mark.integration


def write_tasks(tmp_path, env_url: str, *, rows: int = 4, env_num: int = 2, extra: str = "") -> str:
    return write_arith_tasks(tmp_path, env_url, rows=rows, env_num=env_num, extra=extra)


class Run:
    """A continuous job with its producer thread, workers, consumer and a feed service."""

    def __init__(self, settings, procs, redis_client, tasks, *, epochs=1, workers=1, **feed_settings):
        self.settings = settings.replace(**feed_settings) if feed_settings else settings
        procs.settings = self.settings
        self.procs = procs
        self.r = redis_client
        self.keys = Keys(self.settings.key_prefix)
        self.job = create_continuous_job(redis_client, self.settings, [tasks], epochs=epochs, seed=7)
        self.job_id = self.job.job_id
        self.stop = threading.Event()
        self.producer = ContinuousProducer(redis_client, self.settings, self.job_id)
        self.thread = threading.Thread(target=self.producer.run, args=(self.stop,), daemon=True)
        self.store = open_store(self.settings.results_store)
        self.service = FeedService(redis_client, self.settings, self.job_id, self.store)
        for i in range(workers):
            procs.worker(f"w{i + 1}")
        procs.consumer()

    def start_producer(self):
        self.thread.start()
        return self

    def close(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(10)
        self.store.close()

    def counters(self):
        return feed.counters(self.r, self.keys, self.job_id)


@pytest.fixture
def run_factory(settings, procs, redis_client, env_server, model_server):
    runs = []
    _, env_url = env_server
    model, model_url = model_server
    model.weight_version = ""  # no metadata: steps carry the version the feed published

    def make(tasks_fn, **kw):
        s = settings.replace(llm_base_url=model_url + "/v1")
        run = Run(s, procs, redis_client, tasks_fn(env_url), **kw)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def take_all(run, trainer, n, timeout=120.0, batch=1):
    got = []

    def more():
        got.extend(run.service.take(trainer, batch, 1.0))
        return len(got) >= n

    wait_for(more, timeout, interval=0.01, what=f"{n} groups taken by {trainer}")
    return got


def test_take_ack_versions_and_a_trainer_that_never_acks(run_factory, tmp_path):
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=4), feed_ack_timeout_s=2.0, feed_max_ahead=8)
    run.start_producer()
    svc = run.service
    svc.set_version(1)
    with pytest.raises(feed.FeedError) as err:
        svc.set_version(0)
    assert err.value.status == 409 and "behind" in str(err.value)
    svc.set_version(1)  # the same again is a retry, not an error

    # Trainer A takes one group and dies without acknowledging it.
    lost = take_all(run, "trainer-a", 1)[0]
    assert lost["status"] == FeedGroupStatus.READY and len(lost["samples"]) == 2
    assert all(s["steps"] and s["steps"][-1]["weight_version"] == "1" for s in lost["samples"])
    assert lost["oldest_version"] == 1 and lost["versions_behind"] == 0
    # Trainer B gets every group, A's among them (once, after its ack timeout). It acknowledges
    # each batch before taking the next: a group held past the ack timeout is handed out again,
    # to whoever takes next (B itself included).
    got, checked = [], []

    def more():
        batch = svc.take("trainer-b", 4, 1.0)
        got.extend(batch)
        ids = [g["group_id"] for g in batch]
        if lost["group_id"] in ids:
            # A's late ack is refused, naming the group and its holder; nothing was acknowledged by it.
            with pytest.raises(feed.FeedError) as err:
                svc.ack("trainer-a", [lost["group_id"]])
            assert err.value.status == 404 and lost["group_id"] in str(err.value) and "trainer-b" in str(err.value)
            # An unknown group: 404 naming it, and the groups the trainer holds in the same call
            # are acknowledged all the same (one late id must not make it train on them twice).
            acked_before = svc.stats()["acked"]
            with pytest.raises(feed.FeedError) as err:
                svc.ack("trainer-b", [lost["group_id"], "no-such-group"])
            assert err.value.status == 404 and "no-such-group" in str(err.value)
            assert err.value.extra["acked"] == [lost["group_id"]] and list(err.value.extra["refused"]) == ["no-such-group"]
            assert svc.stats()["acked"] == acked_before + 1
            checked.append(True)
        if ids:
            first = svc.ack("trainer-b", ids)
            assert sorted(first["acked"] + first["already"]) == sorted(ids) and set(first["already"]) <= {lost["group_id"]}
            assert svc.ack("trainer-b", ids) == {"acked": [], "already": ids}  # a retried ack changes nothing
        return len(got) >= 4

    wait_for(more, 120, interval=0.01, what="4 groups taken by trainer-b")
    ids = [g["group_id"] for g in got]
    assert sorted(ids) == sorted(set(ids)) and lost["group_id"] in ids and checked
    assert [g["redelivered"] for g in got if g["group_id"] == lost["group_id"]] == [True]
    # Exactly once after acknowledgement: nothing more comes.
    assert svc.take("trainer-c", 1, 1.0) == []
    st = svc.stats()
    assert st["acked"] == 4 and st["delivered"] == 4 and st["redelivered"] == 1 and st["taken"] == 0
    assert st["inflight"] == 0 and st["produced"] == 4 and st["version"] == 1
    with pytest.raises(feed.FeedError) as err:
        svc.take("trainer-b", 9, 0)
    assert "max_ahead" in str(err.value)


def test_consumer_killed_mid_run_announces_no_group_twice(run_factory, tmp_path, procs):
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=12), feed_max_ahead=12, workers=2)
    run.start_producer()
    wait_for(lambda: run.counters().get(feed.C_ANNOUNCED, 0) >= 2, 120, what="first groups announced")
    procs.kill("consumer", signal.SIGKILL)
    procs.consumer()
    got = take_all(run, "t", 12, timeout=180, batch=4)
    ids = [g["group_id"] for g in got]
    assert len(ids) == len(set(ids)) == 12
    run.service.ack("t", ids)
    assert run.r.xlen(run.keys.feed_stream(run.job_id)) == 12
    assert run.r.hlen(run.keys.feed_seen(run.job_id)) == 12
    assert run.counters()[feed.C_ANNOUNCED] == 12
    # A backfill (what a feed server does at start) finds every group announced already.
    assert run.service.backfill() == 0
    assert run.service.take("t", 1, 0.5) == []


def test_stale_groups_are_requeued_and_never_delivered(run_factory, tmp_path, model_server):
    model, _ = model_server
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=6), feed_max_ahead=6, feed_max_staleness=0)
    svc = run.service
    svc.set_version(1)
    run.start_producer()
    # Every group is sampled at version 1; the trainer then moves to 2 before taking any.
    wait_for(lambda: run.counters().get(feed.C_ANNOUNCED, 0) >= 6, 120, what="six groups announced")
    svc.set_version(2)
    got = take_all(run, "t", 6, timeout=180, batch=6)
    assert all(g["oldest_version"] == 2 and g["versions_behind"] == 0 for g in got)
    svc.ack("t", [g["group_id"] for g in got])
    st = svc.stats()
    assert st["stale_requeued"] == 6 and st["delivered"] == 6 and st["acked"] == 6
    assert st["produced"] == 12 and st["inflight"] == 0  # each stale group ran once more, fresh
    assert svc.take("t", 1, 0.5) == []


def test_stale_groups_dropped_when_asked(run_factory, tmp_path):
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=3), feed_max_ahead=3, feed_max_staleness=0,
                      feed_stale_policy="drop")
    svc = run.service
    svc.set_version(5)
    run.start_producer()
    wait_for(lambda: run.counters().get(feed.C_ANNOUNCED, 0) >= 3, 120, what="three groups announced")
    svc.set_version(6)
    assert svc.take("t", 3, 2.0) == []
    st = svc.stats()
    assert st["stale_dropped"] == 3 and st["delivered"] == 0 and st["inflight"] == 0 and st["produced"] == 3


def test_backpressure_stops_production_at_max_ahead_and_resumes(run_factory, tmp_path):
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=10), feed_max_ahead=3)
    run.start_producer()
    wait_for(lambda: run.counters().get(feed.C_ANNOUNCED, 0) >= 3, 120, what="three groups announced")
    # The trainer has taken nothing: three groups are ready and the producer waits.
    for _ in range(20):  # the producer polls every 0.1 s: twenty of its rounds pass without producing
        run.stop.wait(0.1)
        assert run.counters()[feed.C_PRODUCED] == 3
    got = run.service.take("t", 2, 5.0)
    assert len(got) == 2 and run.counters()[feed.C_PRODUCED] == 3  # taken is not settled
    run.service.ack("t", [g["group_id"] for g in got])
    wait_for(lambda: run.counters()[feed.C_PRODUCED] == 5, 30, what="two more groups produced")
    position = run.r.hgetall(run.keys.feed_position(run.job_id))
    assert int(position[b"seq"]) == 5 and int(position[b"index"]) == 5


def test_a_group_with_a_dead_lettered_member_is_reported_failed(run_factory, tmp_path):
    def tasks(url):
        return write_tasks(tmp_path, url, rows=1, extra=textwrap.indent(textwrap.dedent(f"""\
            - env_name: no_such_env
              base_url: {url}
              env_num: 2
            """), "  "))

    run = run_factory(tasks, feed_max_ahead=4, max_attempts=1)
    run.start_producer()
    got = take_all(run, "t", 1, timeout=120)
    assert got[0]["status"] == FeedGroupStatus.READY
    run.service.ack("t", [got[0]["group_id"]])
    wait_for(lambda: run.service.take("t", 1, 0.5) == [] and run.service.stats()["failed"] == 1, 120,
             what="the failed group reported")
    st = run.service.stats()
    assert st["inflight"] == 0 and st["recent_failures"]
    assert "failed" in st["recent_failures"][0]["reason"]


# --- over HTTP ------------------------------------------------------------------------------
def serve_in_thread(service, token=""):
    from interactor.feedserve import FeedApp, make_server

    server = make_server(FeedApp(service), "127.0.0.1", 0, token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_http_routes_client_and_the_compatibility_shape(run_factory, tmp_path, env_server, model_server):
    import urllib.request

    from interactor.feed_client import Feed, FeedHTTPError
    from interactor.feedserve import make_server, FeedApp
    from broker.settings import SettingsError

    with pytest.raises(SettingsError, match="INTERACTOR_FEED_TOKEN"):
        make_server(FeedApp(None), "0.0.0.0", 0, "")
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=3), feed_max_ahead=3)
    server, url = serve_in_thread(run.service, token="tok-123")
    try:
        assert json.loads(urllib.request.urlopen(url + "/health").read())["status"] == "ok"  # no token needed
        with pytest.raises(FeedHTTPError) as err:
            Feed(url, token="wrong").stats()
        assert err.value.status == 401
        f = Feed(url, trainer="t1", token="tok-123")
        assert f.set_version(3) == 3
        with pytest.raises(FeedHTTPError) as err:
            f.set_version(2)
        assert err.value.status == 409 and "behind" in str(err.value)
        run.start_producer()
        groups = []
        wait_for(lambda: groups.extend(f.take(1, timeout=1.0)) or groups, 120, interval=0.01, what="a group")
        with pytest.raises(FeedHTTPError) as err:
            f.ack(["nope"])
        assert err.value.status == 404 and "nope" in str(err.value)
        assert f.ack([groups[0]["group_id"]])["acked"] == [groups[0]["group_id"]]
        # The original buffer server's route: the rest of the groups, item by item.
        compat = Feed(url, token="tok-123")
        body = {}
        wait_for(lambda: body.update(compat._call("POST", "/get_rollout_data", {"batch_size": 2, "timeout": 1.0}))
                 or body["data"]["meta_info"]["finished_groups"] == 2, 120, what="two groups by get_rollout_data")
        assert body["success"] is True
        items, meta = body["data"]["data"], body["data"]["meta_info"]
        assert meta["total_samples"] == len(items) == 4  # two groups of two single-turn episodes
        assert meta["avg_weight_version"] == 3 and meta["max_weight_version"] == 3
        assert abs(meta["avg_reward"] - sum(i["reward"] for i in items) / 4) < 1e-9
        for item in items:
            # the original buffer server's keys, and the prompt alone (an extension: docs/training.md)
            assert set(item) == {"uid", "instance_id", "messages", "prompt", "reward", "extra_info"}
            x = item["extra_info"]
            assert set(x) == {"timestamp", "steps", "finish_reason", "session_id", "env_id", "group_id",
                              "weight_version", "truncated"}
            assert item["instance_id"] == x["group_id"] and x["session_id"] == x["env_id"]
            assert x["weight_version"] == "3" and x["steps"] == 1 and x["finish_reason"] == "stop"
            # what the store holds is what the env and the model saw: the prompt, then the answer
            step = run.store.feed_steps(x["session_id"])[0]
            assert item["messages"][:-1] == json.loads(step[6])
            assert item["messages"][-1] == {"role": "assistant", "content": step[7]}
            assert "What is" in json.dumps(item["messages"][:-1])
        # /get_rollout_data has no ack: the server settles its groups once the answer is written
        # out, so the counters may trail the answer by a moment.
        wait_for(lambda: f.stats()["acked"] == 3, 30, what="the compatibility route's groups settled")
        st = f.stats()
        assert st["acked"] == 3 and st["inflight"] == 0 and st["version"] == 3
    finally:
        server.shutdown()


def test_feed_server_killed_and_restarted_delivers_every_group_once(run_factory, tmp_path, procs):
    """The feed server as its own process (`interactor feed serve --job J`), SIGKILLed while a
    trainer takes: the restarted server serves the rest, and no acknowledged group comes back."""
    import socket

    from interactor.feed_client import Feed, FeedHTTPError

    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=8), feed_max_ahead=8, feed_ack_timeout_s=2.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def start():
        procs.start("feed", "feed", "serve", "--job", run.job_id, "--port", str(port))

        def up():
            try:
                return Feed(url).health()["job_id"] == run.job_id
            except (OSError, FeedHTTPError):
                return False

        wait_for(up, 60, what="the feed server up")

    start()  # its producer produces the groups
    f = Feed(url, trainer="t")
    seen = []

    def take_some(n):
        def more():
            got = f.take(2, timeout=1.0)
            f.ack([g["group_id"] for g in got])
            seen.extend(g["group_id"] for g in got)
            return len(seen) >= n
        wait_for(more, 120, interval=0.01, what=f"{n} groups acknowledged")

    take_some(3)
    procs.kill("feed", signal.SIGKILL)
    start()
    take_some(8)
    assert len(seen) == len(set(seen)) == 8
    assert f.take(2, timeout=1.0) == []
    st = f.stats()
    assert st["acked"] == 8 and st["produced"] == 8 and st["inflight"] == 0


def test_status_shows_the_feed(run_factory, tmp_path):
    from interactor.fleet_reader import FleetReader
    from interactor.status_text import render_status

    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=2), feed_max_ahead=2)
    run.service.set_version(4)
    run.start_producer()
    got = take_all(run, "t", 1)
    run.service.ack("t", [got[0]["group_id"]])
    snap = FleetReader(run.r, run.settings).snapshot(run.job_id)
    f = snap["jobs"][0]["feed"]
    assert f["version"] == 4 and f["acked"] == 1
    assert f"feed       {run.job_id}: version=4" in render_status(snap)


def test_every_reader_of_the_feed_means_one_thing_by_each_counter(run_factory, tmp_path):
    """/stats, the status line, the metrics and the browser read one view (broker/feed.py
    summary): a group reported failed and one re-filled are two counts everywhere, never one sum
    in one reader and a part in another."""
    from broker import feed
    from interactor.fleet_reader import FleetReader
    from interactor.metrics import exposition
    from interactor.status_text import render_status

    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=2), feed_max_ahead=2)
    run.r.hset(run.keys.feed_stats(run.job_id), mapping={feed.C_FAILED: 2, feed.C_REFILLED: 3,
                                                         feed.C_STALE_DROPPED: 5, f"{feed.C_FILTERED}:uniform": 7})
    st = run.service.stats()
    assert (st["failed"], st["refilled"], st["stale_dropped"], st["filtered"]) == (2, 3, 5, {"uniform": 7})
    assert {k: v for k, v in st.items() if k not in ("job_id", "recent_failures", "config")} == feed.summary(
        run.r, run.keys, run.job_id)
    snap = FleetReader(run.r, run.settings).snapshot(run.job_id)
    assert "dropped=5 filtered=7 failed=2 refilled=3" in render_status(snap)
    text = exposition(FleetReader(run.r, run.settings))
    assert 'outcome="failed",reason=""} 2.0' in text and 'outcome="refilled",reason=""} 3.0' in text


# --- a trainer process killed and restarted under its own name -------------------------------
class TrainerProc:
    """tests/feed_trainer.py as a process of its own, in its own session (killed as a whole)."""

    def __init__(self, tmp_path, url, name, *args, tag="1"):
        import subprocess
        import sys

        from tests.conftest import ROOT

        self.out = tmp_path / f"trainer-{name}-{tag}.jsonl"
        with open(self.out, "wb") as log:
            self.p = subprocess.Popen([sys.executable, "-m", "tests.feed_trainer", url, name, *args],
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=str(ROOT), start_new_session=True)

    def lines(self):
        rows = []
        for line in self.out.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def took(self):
        return [r for r in self.lines() if "took" in r]

    def kill(self):
        import os

        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def test_a_trainer_killed_before_acking_gets_its_groups_back_when_restarted_alone(run_factory, tmp_path):
    """The only trainer, SIGKILLed holding two groups, restarted under the same name: after the
    ack timeout those two come back to it, once each, and once acknowledged never again."""
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=4), feed_ack_timeout_s=3.0, feed_max_ahead=4)
    run.start_producer()
    server, url = serve_in_thread(run.service)
    procs = []
    try:
        first = TrainerProc(tmp_path, url, "solo", "--groups", "2", "--hold")
        procs.append(first)
        wait_for(lambda: any("holding" in r for r in first.lines()) or first.p.poll() is not None, 180,
                 what="the first trainer holding two groups")
        held = [r["took"] for r in first.took()]
        assert len(held) == 2 and first.p.poll() is None, first.out.read_text()
        first.kill()
        assert run.service.stats()["taken"] == 2 and run.service.stats()["acked"] == 0

        again = TrainerProc(tmp_path, url, "solo", "--groups", "4", "--batch", "2", tag="2")
        procs.append(again)
        assert again.p.wait(240) == 0, again.out.read_text()
        took = again.took()
        ids = [r["took"] for r in took]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 4, took  # each group once
        assert set(held) <= set(ids)
        assert {r["took"] for r in took if r["redelivered"]} == set(held)
        acked = [g for r in again.lines() if "acked" in r for g in r["acked"]]
        assert sorted(acked) == sorted(ids)
        # Acknowledged is final: a take that waits past the ack timeout gets nothing back.
        assert run.service.take("solo", 2, 4.0) == []
        st = run.service.stats()
        assert st["acked"] == 4 and st["delivered"] == 4 and st["redelivered"] == 2
        assert st["taken"] == 0 and st["inflight"] == 0 and st["produced"] == 4
    finally:
        for p in procs:
            p.kill()
        server.shutdown()


# --- filters ----------------------------------------------------------------------------------
def group_rewards(run, group_ids):
    """Each group's rewards as the store holds them: what the filters' verdicts are checked by."""
    from consumer.announce import settled_group

    return {gid: settled_group(g).rewards for gid, g in run.store.feed_groups(group_ids).items()}


def test_drop_uniform_and_a_user_filter_counted_by_reason_and_the_batch_kept_full(run_factory, tmp_path,
                                                                                  model_server):
    """Twelve groups of four; four tasks always answered right (uniform rewards), the rest
    right half the time. drop_uniform and tests.feed_filters:even_groups run before delivery;
    with max_ahead 2, a batch of 2 is filled only if filtered groups are replaced by new ones."""
    model, _ = model_server
    model.skill = 0.5
    model.replies = {f"What is {i} + {i + 3}?": str(2 * i + 3) for i in range(4)}
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=12, env_num=4), feed_max_ahead=2,
                      feed_drop_uniform=True, feed_filter="tests.feed_filters:even_groups",
                      feed_filters="tests.feed_filters:even_groups", workers=2)
    run.start_producer()
    svc = run.service
    batches = []

    def settled():
        st = svc.stats()
        return st["acked"] + sum(st["filtered"].values())

    while settled() < 12:
        got = svc.take("t", 2, 30.0)
        assert got or settled() == 12, svc.stats()
        if got:
            batches.append([g["group_id"] for g in got])
            svc.ack("t", batches[-1])
    assert all(len(b) == 2 for b in batches[:-1]), batches  # over-sampling: full until the feed ran dry
    delivered = [gid for b in batches for gid in b]
    everyone = [f"{run.job_id}.s{i}" for i in range(1, 13)]
    rewards = group_rewards(run, everyone)
    assert len(rewards) == 12
    uniform = {g for g, r in rewards.items() if max(r) == min(r)}
    odd = {g for g in everyone if int(g.rsplit(".s", 1)[1]) % 2 and g not in uniform}
    assert len(uniform) >= 4  # the four tasks answered right every time
    assert sorted(delivered) == sorted(set(everyone) - uniform - odd)
    st = svc.stats()
    assert st["filtered"] == {k: v for k, v in {feed.FILTER_UNIFORM: len(uniform), feed.FILTER_USER: len(odd)}.items()
                              if v}
    assert st["produced"] == 12 and st["inflight"] == 0 and st["delivered"] == len(delivered)
    for b in batches:  # what was delivered is what the filters let through
        assert all(int(g.rsplit(".s", 1)[1]) % 2 == 0 and len(set(rewards[g])) > 1 for g in b)


def test_a_filter_off_the_allow_list_is_refused(settings, procs, redis_client, tmp_path):
    """By the service (a FeedError naming it) and by the command (exit 2, before anything starts):
    off the list, or not defined in the module it is named by (as hooks are checked)."""
    import subprocess
    import sys

    from interactor.feed_service import load_filter
    from tests.conftest import ROOT

    assert load_filter("tests.feed_filters:even_groups", "tests.feed_filters:*") is not None
    with pytest.raises(feed.FeedError, match=r"tests.feed_filters:even_groups' is not in feed_filters"):
        load_filter("tests.feed_filters:even_groups", "tests.other:*")
    with pytest.raises(feed.FeedError, match="is not defined in tests.feed_filters"):
        load_filter("tests.feed_filters:reexported", "tests.feed_filters:*")
    with pytest.raises(feed.FeedError, match="must be 'module:function'"):
        load_filter("os.path.join", "")
    for name, allowed, says in [("os:abort", "tests.feed_filters:*", "is not in feed_filters"),
                                ("tests.feed_filters:reexported", "tests.feed_filters:*", "is not defined in")]:
        env = procs.env(feed_filters=allowed)
        out = subprocess.run([sys.executable, "-m", "interactor.cli", "feed", "serve",
                              "--filter", name, "--port", "0"], env=env, cwd=str(ROOT), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert name in out.stderr and says in out.stderr and "Traceback" not in out.stderr


# --- failed_policy refill -----------------------------------------------------------------------
def tasks_with_a_late_env(tmp_path, url):
    """One arithmetic task that works, and one of ``later_env``, an env the server does not know
    (reset answers 400: dead-lettered at once with max_attempts 1) until a test teaches it."""
    return write_tasks(tmp_path, url, rows=1, extra=textwrap.indent(textwrap.dedent(f"""\
        - env_name: later_env
          base_url: {url}
          dataset: [{{question: "What is 9 + 9?", answer: 18}}]
          env_num: 2
        """), "  "))


def take_and_ack_until(run, done, timeout=180, batch_size=1):
    got = []

    def more():
        batch = run.service.take("t", batch_size, 1.0)
        got.extend(batch)
        if batch:
            run.service.ack("t", [g["group_id"] for g in batch])
        return done(run.service.stats())

    wait_for(more, timeout, interval=0.01, what="the feed to get there")
    return got


def test_refill_runs_a_failed_groups_tasks_again_and_delivers_them(run_factory, tmp_path, monkeypatch):
    """failed_policy refill: the group with a dead-lettered member is settled as refilled and its
    tasks run again as a fresh group (new episode ids, every member anew); once the env answers,
    that group is delivered. Nothing is left pending, nothing is reported failed."""
    from envs.bundled import ENVS, ArithmeticEnv

    run = run_factory(lambda url: tasks_with_a_late_env(tmp_path, url), feed_max_ahead=4, max_attempts=1,
                      feed_failed_policy="refill", feed_refill_max=2)
    run.start_producer()
    got = take_and_ack_until(run, lambda st: st["refilled"] >= 1)
    monkeypatch.setitem(ENVS, "later_env", ArithmeticEnv)  # the env server knows it from now on
    got += take_and_ack_until(run, lambda st: st["acked"] == 2 and st["inflight"] == 0)
    st = run.service.stats()
    assert st["failed"] == 0 and 1 <= st["refilled"] <= 2 and st["produced"] == 2 + st["refilled"]
    assert st["delivered"] == 2 and st["taken"] == 0 and st["ready"] == 0
    late = [g for g in got if "What is 9 + 9?" in json.dumps(g["samples"][0]["steps"][0]["messages"])]
    assert len(late) == 1 and late[0]["status"] == FeedGroupStatus.READY and len(late[0]["samples"]) == 2
    assert all(s["steps"] for s in late[0]["samples"])
    # The failed runs are what the trainer can read of them, with their reason.
    assert st["recent_failures"] and all("failed" in f["reason"] for f in st["recent_failures"])
    assert late[0]["group_id"] not in {f["group_id"] for f in st["recent_failures"]}
    assert run.service.take("t", 1, 0.5) == []


def test_refill_gives_up_after_refill_max_and_reports_the_group(run_factory, tmp_path):
    """A task that fails every time is re-run refill_max times, then reported failed with its
    reason and the count: never pending, never re-run without end."""
    run = run_factory(lambda url: tasks_with_a_late_env(tmp_path, url), feed_max_ahead=4, max_attempts=1,
                      feed_failed_policy="refill", feed_refill_max=1)
    run.start_producer()
    take_and_ack_until(run, lambda st: st["failed"] == 1 and st["acked"] == 1 and st["inflight"] == 0)
    st = run.service.stats()
    assert st["refilled"] == 1 and st["produced"] == 3 and st["delivered"] == 1
    reasons = [f["reason"] for f in st["recent_failures"]]
    assert len(reasons) == 2 and "re-run 1 times (feed_refill_max 1), reported" in reasons[0]
    assert reasons[0].startswith(f"episode {run.job_id}.s3.") and " failed: " in reasons[0]
    # Produced no more after that: the position says one epoch of two tasks, and one re-run.
    run.stop.wait(1.0)
    assert run.service.stats()["produced"] == 3 and run.service.take("t", 1, 0.5) == []


# --- a worker killed mid-run; versions moving while episodes run -------------------------------
def guess_tasks(tmp_path, url, rows):
    """Multi-turn episodes (a binary search over [low, high]), so that a worker dies, or the
    version moves, in the middle of one."""
    path = tmp_path / "guess.yaml"
    rows_yaml = ", ".join(f"{{low: 1, high: {60 + 7 * i}}}" for i in range(rows))
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {url}
            env_params: {{max_turns: 8}}
            dataset: [{rows_yaml}]
            env_num: 2
        """))
    return str(path)


def test_a_worker_killed_mid_run_every_group_delivered_exactly_once(run_factory, tmp_path, procs, model_server):
    model, _ = model_server
    model.latency_ms = 150  # episodes of several turns, each a while: the kill lands inside some
    run = run_factory(lambda url: guess_tasks(tmp_path, url, 8), feed_max_ahead=8, workers=2)
    run.start_producer()
    steps = lambda: run.store.query("SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (run.job_id,))[0][0]  # noqa: E731
    wait_for(lambda: steps() >= 6, 120, what="episodes under way")
    procs.kill("w1", signal.SIGKILL)  # the episodes it ran go to w2 (and w3) about one lease TTL later
    procs.worker("w3")
    got = take_and_ack_until(run, lambda st: st["acked"] >= 8, timeout=240, batch_size=4)
    ids = [g["group_id"] for g in got]
    assert len(ids) == len(set(ids)) == 8
    assert all(g["status"] == FeedGroupStatus.READY and len(g["samples"]) == 2 for g in got)
    assert all(s["steps"] and s["steps"][-1]["is_terminal"] for g in got for s in g["samples"])
    assert run.service.take("t", 4, 2.0) == []
    st = run.service.stats()
    assert st["acked"] == 8 and st["produced"] == 8 and st["delivered"] == 8 and st["redelivered"] == 0
    assert st["failed"] == 0 and st["inflight"] == 0
    assert run.r.xlen(run.keys.feed_stream(run.job_id)) == 8  # each group announced once


def test_versions_bumped_while_episodes_run_no_delivered_group_older_than_n(run_factory, tmp_path, model_server):
    """max_staleness 1. The trainer's version moves from 1 to 3 while the first groups are in the
    middle of their episodes (their steps then span versions), and by one more after each group
    it takes. Stale groups run again as fresh groups; every delivered group is at most one
    version behind when handed over. The counts add up: every announced group was delivered or
    re-queued, and every re-queue produced one group more."""
    model, _ = model_server
    model.latency_ms = 400  # an episode of several turns takes seconds: the bump lands inside
    # Re-runs for staleness are bounded by feed_refill_max (2 by default): high here, so that
    # every task is delivered however often its group fell behind.
    run = run_factory(lambda url: guess_tasks(tmp_path, url, 6), feed_max_ahead=4, feed_max_staleness=1, workers=2,
                      feed_refill_max=50)
    svc = run.service
    svc.set_version(1)
    run.start_producer()
    steps = lambda: run.store.query("SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (run.job_id,))[0][0]  # noqa: E731
    wait_for(lambda: steps() >= 2, 120, what="episodes under way")
    svc.set_version(2)
    svc.set_version(3)
    got = []

    def more():
        batch = svc.take("t", 1, 1.0)
        for g in batch:
            assert g["versions_behind"] is not None and g["versions_behind"] <= 1, g
        got.extend(batch)
        if batch:
            svc.ack("t", [g["group_id"] for g in batch])
            svc.set_version(feed.current_version(run.r, run.keys, run.job_id) + 1)  # trained on it: a new version
        return len(got) >= 6 and svc.stats()["inflight"] == 0

    wait_for(more, 300, interval=0.01, what="six tasks delivered")
    st = svc.stats()
    entries = [unpack_group(f) for _, f in run.r.xrange(run.keys.feed_stream(run.job_id))]
    delivered = {g["group_id"] for g in got}
    requeued = [e for e in entries if e.group_id not in delivered]
    assert len(got) == len(delivered) == st["delivered"] == st["acked"] == 6
    assert st["stale_requeued"] == len(requeued) and len(entries) == 6 + len(requeued)
    assert st["produced"] == 6 + st["stale_requeued"] and st["stale_dropped"] == 0
    assert requeued, "the version moved by more than one while some group ran: at least one is re-queued"
    assert any(e.oldest_version < e.newest_version for e in entries), "some group sampled across versions"
    # What the group says of its versions is what its steps were recorded with.
    for g in got:
        versions = [feed.parse_version(st["weight_version"]) for s in g["samples"] for st in s["steps"]]
        assert min(versions) == g["oldest_version"] and max(versions) == g["newest_version"]
    # The six tasks are the six delivered groups, each once.
    firsts = sorted(json.dumps(g["samples"][0]["steps"][0]["messages"]).split("between 1 and ")[1][:2] for g in got)
    assert len(set(firsts)) == 6, firsts


def unpack_group(fields):
    from broker.records import unpack

    return unpack(fields[b"g"])


# --- visible: metrics and the results browser ---------------------------------------------------
def test_metrics_and_the_browser_show_the_feed(settings, redis_client, tmp_path):
    """A feed over real Redis, settled by the feed service itself (one group delivered and
    acknowledged, one filtered as uniform, one failed, one ready), read back by a Prometheus
    scrape and on the results browser's job page."""
    from prometheus_client.parser import text_string_to_metric_families

    from broker.ledger import Ledger
    from broker.records import FeedGroup, JobSpec
    from interactor.fleet_reader import FleetReader
    from interactor.metrics import exposition
    from interactor.ui.source import LiveState
    from tests.test_ui import JOB, client_for, fill

    db = str(tmp_path / "results.sqlite")
    store = open_store(db)
    fill(store)
    store.close()
    keys = Keys(settings.key_prefix)
    Ledger.for_settings(redis_client, settings).create_job(
        JobSpec(job_id=JOB, llm_base_url="http://llm/v1", model="m", episodes=0, groups=0), [])
    feed.enable(redis_client, keys, JOB, feed.FeedConfig(max_ahead=8, max_staleness=2, drop_uniform=True))
    feed.set_version(redis_client, keys, JOB, 5)
    redis_client.hincrby(keys.feed_stats(JOB), feed.C_PRODUCED, 4)  # as the continuous producer counts them
    groups = [FeedGroup(job_id=JOB, group_id="g1", status=FeedGroupStatus.READY, members=["ep-x", "ep-y"],
                        rewards=[1.0, 0.0], size=2, oldest_version=4, newest_version=5),
              FeedGroup(job_id=JOB, group_id="g2", status=FeedGroupStatus.READY, members=["a", "b"], rewards=[0.5, 0.5],
                        size=2, oldest_version=5, newest_version=5),
              FeedGroup(job_id=JOB, group_id="g3", status=FeedGroupStatus.FAILED, members=["c", "d"], rewards=[1.0],
                        size=2, reason="episode d failed: env_bad_request")]
    for g in groups:
        assert feed.announce(redis_client, keys, g.pack(), JOB, g.group_id)
    svc = FeedService(redis_client, settings, JOB)
    got = svc.take("t", 3, 0.5)
    assert [g["group_id"] for g in got] == ["g1"] and got[0]["versions_behind"] == 1
    svc.ack("t", ["g1"])
    g4 = FeedGroup(job_id=JOB, group_id="g4", status=FeedGroupStatus.READY, members=["e"], rewards=[1.0], size=1)
    feed.announce(redis_client, keys, g4.pack(), JOB, "g4")

    fams = {f.name: f for f in text_string_to_metric_families(exposition(FleetReader(redis_client, settings)))}

    def val(name, sample=None, **labels):
        found = [s.value for s in fams[name].samples
                 if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, fams[name].samples)
        return found[0]

    assert val("interactor_feed_groups", job_id=JOB, state="ready") == 1
    assert val("interactor_feed_groups", job_id=JOB, state="taken") == 0
    assert val("interactor_feed_groups", job_id=JOB, state="inflight") == 1  # 4 produced, 3 settled
    settled = "interactor_feed_groups_settled"
    assert val(settled, settled + "_total", job_id=JOB, outcome="acked") == 1
    assert val(settled, settled + "_total", job_id=JOB, outcome="filtered", reason="uniform") == 1
    assert val(settled, settled + "_total", job_id=JOB, outcome="failed") == 1
    assert val(settled, settled + "_total", job_id=JOB, outcome="stale_requeued") == 0
    assert val("interactor_feed_groups_delivered", "interactor_feed_groups_delivered_total", job_id=JOB,
               kind="first") == 1
    assert val("interactor_feed_version", job_id=JOB) == 5
    assert val("interactor_feed_versions_behind_mean", job_id=JOB) == 1
    assert val("interactor_feed_trainer_wait_seconds", "interactor_feed_trainer_wait_seconds_total", job_id=JOB) > 0
    assert val("interactor_feed_takes", "interactor_feed_takes_total", job_id=JOB) == 1

    page = client_for(db, live=LiveState(settings)).get(f"/jobs/{JOB}")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert 'id="feed"' in html and "version <b>5</b>" in html and "staleness bound 2 (requeue)" in html
    rows = dict(re.findall(r"<tr><td>([^<]+)</td><td class=\"r\">([^<]+)</td></tr>", html.split('id="feed-groups"')[1]))
    assert rows["ready (announced, not taken)"] == "1" and rows["acknowledged"] == "1"
    assert rows["filtered: uniform"] == "1" and rows["failed: reported"] == "1" and rows["stale: re-queued"] == "0"
    assert "versions behind per delivered group: 1.00 on average" in html
    # Without Redis the browser shows what the store has, and no feed.
    assert 'id="feed"' not in client_for(db).get(f"/jobs/{JOB}").get_data(as_text=True)


# --- retention ------------------------------------------------------------------------------------
def test_a_finished_feed_expires_with_its_job_and_is_forgotten_with_it(run_factory, tmp_path):
    """The sweeper's housekeeping keeps a feed job while a group is ready, gives its feed's keys
    the job's retention once nothing more can come, and forgets the feed with the job."""
    from broker.recovery import Sweeper

    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=2), feed_max_ahead=2)
    run.start_producer()
    wait_for(lambda: run.counters().get(feed.C_ANNOUNCED, 0) == 2, 120, what="both groups ready")
    sweeper = Sweeper(run.r, run.settings)

    def housekeep():
        sweeper._last_housekeeping = 0.0
        sweeper._housekeeping()

    retention = run.settings.job_retention_s
    housekeep()  # no episode runs, but two groups wait for a trainer: kept
    assert feed.holds(run.r, run.keys, run.job_id, retention)
    assert run.r.ttl(run.keys.job_spec(run.job_id)) == -1 and run.r.ttl(run.keys.feed_config(run.job_id)) == -1
    got = run.service.take("t", 2, 30.0)
    run.service.ack("t", [g["group_id"] for g in got])
    assert not feed.holds(run.r, run.keys, run.job_id, retention)  # one epoch, all settled
    housekeep()
    present = [k for k in run.keys.job_keys(run.job_id) + run.keys.feed_keys(run.job_id) if run.r.exists(k)]
    assert run.keys.feed_stream(run.job_id) in present and run.keys.feed_position(run.job_id) in present
    for k in present:
        assert 0 < run.r.ttl(k) <= retention, k
    # Retention runs out (sped up here): the keys go, and the next housekeeping forgets the job.
    for k in present:
        run.r.pexpire(k, 1)
    wait_for(lambda: not any(run.r.exists(k) for k in present), 10, what="the keys expired")
    housekeep()
    assert run.job_id not in {j.decode() for j in run.r.smembers(run.keys.feeds)}
    assert run.r.zscore(run.keys.jobs, run.job_id) is None


def test_trim_drops_only_settled_groups_and_an_idle_endless_feed_is_let_go(settings, redis_client):
    from broker.records import FeedGroup

    keys = Keys(settings.key_prefix)
    job = "trimjob"
    feed.enable(redis_client, keys, job, feed.FeedConfig(max_ahead=8, continuous=True, epochs=0))
    for i in range(1, 5):
        g = FeedGroup(job_id=job, group_id=f"g{i}", status=FeedGroupStatus.READY, members=[f"e{i}"], rewards=[1.0], size=1)
        feed.announce(redis_client, keys, g.pack(), job, g.group_id)
    svc = FeedService(redis_client, settings, job)
    first = svc.take("t", 2, 1.0)
    assert [g["group_id"] for g in first] == ["g1", "g2"]
    svc.ack("t", ["g1"])  # g2 taken, not acknowledged; g3 and g4 not read yet
    stream = keys.feed_stream(job)
    assert feed.trim(redis_client, keys, job, older_than_s=0) == 1 and redis_client.xlen(stream) == 3
    assert feed.trim(redis_client, keys, job, older_than_s=0) == 0  # g2 is pending: it stays, and what follows
    assert svc.ack("t", ["g1"]) == {"acked": [], "already": ["g1"]}  # trimmed and settled: a retry is harmless
    assert svc.ack("t", ["g2"])["acked"] == ["g2"]
    assert [g["group_id"] for g in svc.take("t", 2, 1.0)] == ["g3", "g4"]
    # An entry not older than the bound stays, settled or not.
    assert feed.trim(redis_client, keys, job, older_than_s=3600) == 0
    # A continuous feed without end holds its job while a trainer comes by; one nobody asked
    # anything of for the retention period is let go.
    retention = 600.0
    assert feed.holds(redis_client, keys, job, retention)
    assert not feed.holds(redis_client, keys, job, retention, now=time.time() + retention + 5)
    svc.take("t", 1, 0)  # a trainer asks: the clock starts again
    assert feed.holds(redis_client, keys, job, retention, now=time.time() + retention - 5)


def test_groups_carry_the_token_ids_and_logprobs_the_model_sampled(run_factory, tmp_path):
    """With tokens asked for, every step a trainer gets (the feed's samples and the original
    route's items) carries the prompt ids, completion ids and logprobs the store holds for it."""
    run = run_factory(lambda url: write_tasks(tmp_path, url, rows=2), feed_max_ahead=2, tokens="auto")
    run.start_producer()
    got = take_all(run, "t", 1, timeout=120)
    steps = [st for s in got[0]["samples"] for st in s["steps"]]
    assert steps
    for st in steps:
        stored = {t["step_id"]: t for t in run.store.episode_tokens(st["session_id"])}[st["step_id"]]
        assert st["token_status"] == stored["token_status"] == "ok", st.get("token_status")
        assert st["prompt_ids"] == stored["prompt_ids"] and st["completion_ids"] == stored["completion_ids"]
        assert st["prompt_ids"] and all(isinstance(i, int) for i in st["prompt_ids"])
        assert len(st["completion_logprobs"]) == len(st["completion_ids"]) > 0
    run.service.ack("t", [got[0]["group_id"]])
    body = {}
    wait_for(lambda: body.update(run.service.rollout_data(1, 1.0)[0]) or body["data"]["meta_info"]["finished_groups"] == 1,
             120, what="a group by get_rollout_data")
    for item in body["data"]["data"]:
        assert item["completion_ids"] and len(item["completion_logprobs"]) == len(item["completion_ids"])
        assert item["prompt_ids"] and item["token_status"] == "ok"
