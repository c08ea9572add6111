"""Checks the tests make of a results store, on either backend (SQLite path or PostgreSQL URL):
plain SQL through the store's reader, with ``?`` placeholders."""

from __future__ import annotations

import pytest

from consumer.storage import open_store


def db_rows(target: str, sql: str, args=()) -> list[tuple]:
    store = open_store(target, readonly=True)
    try:
        return [tuple(r) for r in store.sql(sql, args)]
    finally:
        store.close()


def assert_trajectories_sound(target: str, job_id: str) -> None:
    """Every completed episode's trajectory (its session_steps rows): one attempt, steps 1..n
    in order, cumulative rewards that add up to the episode's total; failed episodes keep no
    rows there; no step twice."""
    store = open_store(target, readonly=True)
    try:
        episodes = store.sql("SELECT episode_id, completed_attempt_id, total_reward, steps FROM episodes "
                             "WHERE job_id = ? AND status = 'completed'", (job_id,))
        assert episodes
        for episode_id, attempt_id, total, steps in episodes:
            rows = store.sql("SELECT step_id, step_reward, reward, attempt_id, is_session_completed "
                             "FROM session_steps WHERE session_id = ? ORDER BY step_id", (episode_id,))
            assert [r[0] for r in rows] == list(range(1, len(rows) + 1)), episode_id
            assert len(rows) == steps
            assert {r[3] for r in rows} == {attempt_id}, "one attempt's steps per trajectory"
            assert rows[-1][4] == 1 and all(r[4] == 0 for r in rows[:-1])
            running = 0.0
            for _, reward, cumulative, _, _ in rows:
                running += reward
                assert cumulative == pytest.approx(running)
            assert total == pytest.approx(running)
        assert store.sql("SELECT COUNT(*) FROM session_steps s JOIN episodes e ON e.episode_id = s.session_id "
                         "WHERE e.job_id = ? AND e.status = 'failed'", (job_id,))[0][0] == 0
        assert store.sql("SELECT session_id, step_id FROM session_steps WHERE job_id = ? "
                         "GROUP BY session_id, step_id HAVING COUNT(*) > 1", (job_id,)) == []
    finally:
        store.close()


TABLES = ("job_environments", "session_steps", "superseded_steps", "episodes", "attempts", "groups", "jobs")


def store_text(target: str) -> str:
    """Every row of every table as text, to grep for what must never be stored (secrets)."""
    store = open_store(target, readonly=True)
    try:
        return "\n".join(repr(row) for table in TABLES for row in store.sql(f"SELECT * FROM {table}"))
    finally:
        store.close()
