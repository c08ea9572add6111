"""The store readers behind the results browser, on both backends: keyset pages that walk
every episode (and group) once in either direction whatever the sort and its NULLs, and
page queries that read an index, not the job, at 100,000 episodes."""

from __future__ import annotations

import random

import pytest

from consumer.storage import open_store
from tests.test_store import episode, job

JOB = "job1"
EP_COLUMNS = ("episode_id", "job_id", "group_id", "env_name", "llm_model", "status", "attempt", "attempt_id",
              "attempts", "total_reward", "steps", "reason", "ended_by", "started_at", "finished_at", "duration_s",
              "updated_at")


def insert_episodes(store, rows: list[tuple]) -> None:
    """Episode rows written straight into the table (what the consumer's upserts leave)."""
    with store.transaction():
        store.executemany(f"INSERT INTO episodes ({', '.join(EP_COLUMNS)}) VALUES ({', '.join('?' for _ in EP_COLUMNS)})",
                          rows)


def synthetic(n: int, job_id: str = JOB, *, seed: int = 7, prefix: str = "e") -> list[tuple]:
    """Episodes with ties in every sort column and NULL durations and start times (running
    ones), ids that sort the same in Python and in any collation."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        status = rng.choice(["completed", "completed", "completed", "failed", "running"])
        started = None if status == "running" and i % 2 else 1000.0 + rng.randrange(50)
        finished = 1100.0 + i if status != "running" else None
        duration = (finished - started) if finished is not None and started is not None else None
        rows.append((f"{job_id}.{prefix}{i:06d}", job_id, f"{job_id}.g{i // 4:05d}", rng.choice(["alpha", "beta"]),
                     "m", status, 1, f"a{i}", rng.choice([1, 1, 2, 3]), float(rng.choice([0, 0.5, 1.0])),
                     rng.randrange(1, 6), "model_malformed" if status == "failed" else None,
                     "terminated" if status == "completed" else None, started, finished, duration, 2000.0))
    return rows


def expected_order(rows: list[dict], col: str, descending: bool) -> list[str]:
    """The documented order: the sort column with NULLs first ascending, then episode_id;
    descending is exactly the reverse."""
    key = sorted(rows, key=lambda r: (r[col] is not None, r[col] if r[col] is not None else 0, r["episode_id"]))
    ids = [r["episode_id"] for r in key]
    return ids[::-1] if descending else ids


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    yield s
    s.close()


@pytest.mark.parametrize("sort", ["episode_id", "reward", "duration", "started", "steps", "status", "attempts"])
def test_keyset_pages_walk_every_episode_once_both_ways(store, sort):
    insert_episodes(store, synthetic(53))
    insert_episodes(store, synthetic(9, "other"))  # another job's rows never show up
    col = store.EPISODE_SORTS[sort]
    everything = store.page_episodes(JOB, limit=1000)
    assert len(everything) == 53
    for descending in (False, True):
        want = expected_order(everything, col, descending)
        got, after = [], None
        while True:
            page = store.page_episodes(JOB, sort=sort, descending=descending, limit=7, after=after)
            got += [r["episode_id"] for r in page]
            if len(page) < 7:
                break
            after = (page[-1][col], page[-1]["episode_id"])
        assert got == want, (sort, descending)
        # Backwards from the end: the same rows, flipped direction, each page reversed.
        back, before = [], None
        while True:
            page = store.page_episodes(JOB, sort=sort, descending=not descending, limit=7, after=before)
            back = [r["episode_id"] for r in page][::-1] + back
            if len(page) < 7:
                break
            before = (page[-1][col], page[-1]["episode_id"])
        assert back == want, (sort, descending)


def test_keyset_pages_with_filters_and_counts(store):
    rows = synthetic(80)
    insert_episodes(store, rows)
    filters = {"statuses": ["completed"], "env_names": ["alpha"], "reward_min": 0.5}
    want = [r[0] for r in sorted(rows, key=lambda r: (r[9], r[0])) if r[5] == "completed" and r[3] == "alpha"
            and r[9] >= 0.5]
    got, after = [], None
    while True:
        page = store.page_episodes(JOB, sort="reward", limit=5, after=after, **filters)
        got += [r["episode_id"] for r in page]
        if len(page) < 5:
            break
        after = (page[-1]["total_reward"], page[-1]["episode_id"])
    assert got == want and store.count_episodes(JOB, **filters) == len(want)
    assert store.count_episodes(JOB, reason="model_malformed") == sum(r[5] == "failed" for r in rows)
    assert store.count_episodes(JOB, reason="terminated") == sum(r[5] == "completed" for r in rows)
    facets = store.episode_facets(JOB)
    assert sum(facets["status"].values()) == 80 and set(facets["env_name"]) == {"alpha", "beta"}
    with pytest.raises(ValueError):
        store.page_episodes(JOB, sort="nope")


def test_groups_pages_progress_and_members(store):
    recs = [job(12, 4)]
    for g in range(4):
        for k in range(3):
            recs += episode(f"e{g}{k}", [float(k == 0 or g == 3)], group=f"g{g}", size=3, env="alpha")
    store.write_batch(recs)
    ids, after = [], None
    while True:
        page = store.page_groups(JOB, sort="std", descending=True, limit=3, after=after)
        ids += [g["group_id"] for g in page]
        if len(page) < 3:
            break
        after = (page[-1]["reward_std"], page[-1]["group_id"])
    assert ids == ["g2", "g1", "g0", "g3"]  # std 0.47 three times (id descending), then the all-equal group
    assert store.count_groups(JOB, zero_std=True) == 1
    assert [g["group_id"] for g in store.page_groups(JOB, zero_std=True)] == ["g3"]
    assert store.count_groups(JOB, complete=False) == 0
    members = store.group_members_many(["g0", "g3"])
    assert [m["episode_id"] for m in members["g0"]] == ["e00", "e01", "e02"]
    assert [m["total_reward"] for m in members["g3"]] == [1.0, 1.0, 1.0]
    p = store.job_progress(JOB)
    assert p["statuses"] == {"completed": 12} and p["steps"] == 12 and p["episodes_expected"] == 12
    assert p["mean_reward"] == pytest.approx(6 / 12)


# --- 100,000 episodes -------------------------------------------------------------------------
N_BIG = 100_000


def captured_sql(store):
    """The statements page_episodes runs, captured from the store's query primitive."""
    seen = []
    real = store.query_dicts

    def spy(sql, args=()):
        seen.append((sql, tuple(args)))
        return real(sql, args)

    store.query_dicts = spy
    return seen


def test_sqlite_page_queries_read_an_index_at_100k_episodes(tmp_path):
    store = open_store(str(tmp_path / "big.sqlite"))
    try:
        insert_episodes(store, synthetic(N_BIG))
        insert_episodes(store, synthetic(20_000, "other", prefix="o"))
        deep = store.page_episodes(JOB, limit=N_BIG)[-100]  # a row near the end
        for sort, col, index in (("episode_id", "episode_id", "episodes_job_episode"),
                                 ("reward", "total_reward", "episodes_job_reward")):
            for descending in (False, True):
                seen = captured_sql(store)
                page = store.page_episodes(JOB, sort=sort, descending=descending, limit=50,
                                           after=(deep[col], deep["episode_id"]))
                del store.query_dicts
                assert page and seen
                for sql, args in seen:
                    plan = " | ".join(r[3] for r in store.sql("EXPLAIN QUERY PLAN " + sql, args))
                    assert f"USING INDEX {index}" in plan or f"USING COVERING INDEX {index}" in plan, plan
                    assert "TEMP B-TREE" not in plan and "SCAN episodes" not in plan, plan

        # What a page costs, in SQLite VM instructions: the same on page 1 and near the end
        # (keyset), against an OFFSET read of the same depth.
        conn = store._conn
        ticks = [0]

        def tick():
            ticks[0] += 1
            return 0

        def cost(fn) -> int:
            ticks[0] = 0
            conn.set_progress_handler(tick, 100)
            try:
                fn()
            finally:
                conn.set_progress_handler(None, 100)
            return ticks[0]

        first = cost(lambda: store.page_episodes(JOB, sort="reward", descending=True, limit=50))
        near_end = cost(lambda: store.page_episodes(JOB, sort="reward", descending=True, limit=50,
                                                    after=(deep["total_reward"], deep["episode_id"])))
        offset = cost(lambda: store.list_episodes(JOB, sort="reward", descending=True, limit=50, offset=N_BIG - 100))
        assert near_end <= 2 * first + 5, (first, near_end)
        assert offset > 20 * near_end, (near_end, offset)
    finally:
        store.close()


def test_postgres_page_queries_read_an_index_at_100k_episodes(pg_server):
    store = open_store(pg_server.create_database())
    try:
        insert_episodes(store, synthetic(N_BIG))
        store.execute("ANALYZE episodes")  # what autovacuum does after a bulk load
        deep = store.page_episodes(JOB, limit=N_BIG)[-100]
        for sort, col in (("episode_id", "episode_id"), ("reward", "total_reward")):
            for descending in (False, True):
                seen = captured_sql(store)
                store.page_episodes(JOB, sort=sort, descending=descending, limit=50,
                                    after=(deep[col], deep["episode_id"]))
                del store.query_dicts
                for sql, args in seen:
                    # The planner may pick the primary key for episode_id order (ids start with
                    # the job's); either way an index range, never a sort of the job's rows.
                    plan = "\n".join(r[0] for r in store.sql("EXPLAIN " + sql, args))
                    assert "Index Scan" in plan or "Index Only Scan" in plan, plan
                    assert "Sort" not in plan and "Seq Scan" not in plan, plan
                    if sort == "reward":
                        assert "episodes_job_reward" in plan, plan
    finally:
        store.close()


@pytest.mark.unit
def test_writer_adds_browse_indexes_to_an_older_store(tmp_path):
    path = str(tmp_path / "old.sqlite")
    store = open_store(path)
    store.execute("DROP INDEX episodes_job_reward")
    store.close()
    reader = open_store(path, readonly=True)  # readers never write
    assert not reader.sql("SELECT 1 FROM sqlite_master WHERE name = 'episodes_job_reward'")
    reader.close()
    writer = open_store(path)
    assert writer.sql("SELECT 1 FROM sqlite_master WHERE name = 'episodes_job_reward'")
    writer.close()
