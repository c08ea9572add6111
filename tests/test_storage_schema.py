"""The results tables declared once (consumer/storage/schema.py): what each backend creates from
the declaration, on a real SQLite file and a real PostgreSQL, is the declared columns in the
declared order with each dialect's type; the writer's column lists follow the declaration; the
group statistics the store, the exports and the browser show are one formula."""

from __future__ import annotations

import math

import pytest

from consumer.storage import open_store, schema
from consumer.storage.backend import ATTEMPT_COLUMNS, EPISODE_COLUMNS, STEP_COLUMNS
from consumer.storage.group_stats import ADVANTAGE_EPS, advantage, group_stats, reward_mean_std
from consumer.storage.plan import EpisodeState

ALL_TABLES = (*schema.TABLES, schema.STEP_TOKENS, schema.ATTEMPT_PHASES)


# information_schema's names of the PostgreSQL types we declare, where not the lower-case spelling
PG_REPORTED = {"DOUBLE PRECISION": "double precision", "TIMESTAMPTZ": "timestamp with time zone"}


def declared(table: schema.Table, dialect: str) -> list[tuple[str, str]]:
    """(column, type) as the database reports them back."""
    out = []
    for c in table.columns:
        if c.type == "rowid":  # the type, without its key clause
            t = "INTEGER" if dialect == schema.SQLITE else "bigint"
        elif dialect == schema.SQLITE:
            t = schema.TYPES[c.type][0]
        else:
            t = schema.TYPES[c.type][1]
            t = PG_REPORTED.get(t, t.lower())
        out.append((c.name, t))
    return out


def test_each_backend_creates_the_declared_tables(store_url):
    s = open_store(store_url)
    try:
        postgres = "://" in store_url
        for table in ALL_TABLES:
            if table.only == schema.POSTGRES and not postgres:
                continue
            if postgres:
                got = [tuple(r) for r in s.sql(
                    "SELECT column_name, data_type FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
                    (table.name,))]
            else:
                got = [(r[1], r[2]) for r in s.sql(f"PRAGMA table_info({table.name})")]
            assert got == declared(table, schema.POSTGRES if postgres else schema.SQLITE), table.name
        if postgres:
            indexes = {r[0] for r in s.sql("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()")}
        else:
            indexes = {r[0] for r in s.sql("SELECT name FROM sqlite_master WHERE type = 'index'")}
        wanted = {i.name for t in ALL_TABLES for i in t.indexes} | {i.name for i in schema.BROWSE_INDEXES}
        assert wanted <= indexes
    finally:
        s.close()


@pytest.mark.unit
def test_the_writers_column_lists_follow_the_declaration():
    assert STEP_COLUMNS == tuple(c.name for c in schema.STEP_FIELDS)
    assert schema.SUPERSEDED_STEPS.insert_columns == STEP_COLUMNS + ("superseded_reason", "superseded_at")
    # the planner's episode state is the head of the episodes row, in order (plan.py EpisodeState)
    assert EPISODE_COLUMNS == EpisodeState.COLUMNS + ("duration_s", "updated_at")
    assert ATTEMPT_COLUMNS == schema.ATTEMPTS.names
    # SQLite spells a flag's default 0, PostgreSQL FALSE; the attempts key is the row in SQLite only
    assert "finished BOOLEAN NOT NULL DEFAULT 0" in schema.JOB_ENVIRONMENTS.ddl(schema.SQLITE)
    assert "finished BOOLEAN NOT NULL DEFAULT FALSE" in schema.JOB_ENVIRONMENTS.ddl(schema.POSTGRES)
    assert "WITHOUT ROWID" in schema.ATTEMPTS.ddl(schema.SQLITE)
    assert "WITHOUT ROWID" not in schema.ATTEMPTS.ddl(schema.POSTGRES)


@pytest.mark.unit
def test_group_statistics_are_one_formula():
    from interactor.ui.formatting import advantage as shown

    rewards = [1.0, 0.0, 0.5, 0.25]
    mean, std, adv, equal = group_stats(rewards)
    assert (mean, std) == reward_mean_std(rewards) and not equal
    assert adv == [advantage(r, mean, std) for r in rewards]
    assert adv[0] == pytest.approx((1.0 - mean) / (std + ADVANTAGE_EPS))
    # the browser, from a stored groups row, shows what the export writes
    assert [shown(r, {"reward_mean": mean, "reward_std": std}) for r in rewards] == adv
    assert reward_mean_std([]) == (None, None)
    with pytest.raises(ValueError):
        group_stats([])


@pytest.mark.unit
def test_group_statistics_stay_finite_or_the_group_is_unusable():
    """Finite rewards whose sum or squares overflow still get finite statistics (the same as
    scaled-down rewards'); a group with a reward that is not finite is unusable: no mean, no
    std, every advantage None (never NaN, which trainers would read as a number)."""
    from interactor.ui.formatting import advantage as shown

    big = group_stats([1e308, 1e308, -1e308])
    assert math.isfinite(big.mean) and math.isfinite(big.std) and big.usable
    assert big.advantages == pytest.approx([2 ** -0.5, 2 ** -0.5, -(2 ** 0.5)])
    assert group_stats([1e200, -1e200]) == (0.0, 1e200, [1.0, -1.0], False)  # squares past the range
    assert group_stats([1.7e308, -1.7e308]) == (0.0, 1.7e308, [1.0, -1.0], False)
    for bad in (math.inf, -math.inf, math.nan):
        stats = group_stats([bad, 1.0])
        assert stats == (None, None, [None, None], False) and not stats.usable
        assert reward_mean_std([1.0, bad]) == (None, None)
    # a difference past the float range, from stored (finite) statistics
    assert advantage(1e308, -1e308, 1e308) == pytest.approx(2.0)
    assert shown(1e308, {"reward_mean": -1e308, "reward_std": 1e308}) == pytest.approx(2.0)
    assert advantage(math.inf, 0.0, 1.0) is None and shown(1.0, {"reward_mean": math.nan, "reward_std": 1.0}) is None


@pytest.mark.unit
def test_the_rows_the_writer_builds_line_up_with_the_declared_columns():
    # A stored field is declared in schema.py and filled in by _step_row / _attempt_row in the
    # column's position: every column here must get its own record field, not its neighbour's.
    from broker.records import AttemptRecord, StepRecord
    from consumer.storage.backend import _attempt_row, _step_row

    step = StepRecord(job_id="job", env_id="ep", attempt=3, step_id=7, env_name="env", llm_model="llm",
                      group_id="grp", messages_json=b'[{"role": "user"}]', response="resp", step_reward=0.25,
                      cumulative_reward=1.5, terminated=True, truncated=False, episode_finished=True,
                      is_trainable=False, weight_version="wv9", finish_reason="length", env_latency_s=0.125,
                      model_latency_s=0.375, created_at=1234.5, attempt_id="aid", prompt_tokens=11,
                      completion_tokens=13, ended_by="terminated")
    row = dict(zip(STEP_COLUMNS, _step_row(step), strict=True))
    assert row == {
        "session_id": "ep", "step_id": 7, "env_name": "env", "llm_model": "llm", "group_id": "grp", "job_id": "job",
        "messages": '[{"role": "user"}]', "response": "resp", "step_reward": 0.25, "reward": 1.5,
        "env_state": row["env_state"], "is_terminal": True, "is_truncated": False, "is_session_completed": True,
        "is_trainable": False, "created_at": 1234.5, "attempt": 3, "attempt_id": "aid", "weight_version": "wv9",
        "finish_reason": "length", "ended_by": "terminated", "env_latency_s": 0.125, "model_latency_s": 0.375,
        "prompt_tokens": 11, "completion_tokens": 13, "created_ts": 1234.5}
    assert "wv9" in row["env_state"]

    close = AttemptRecord(job_id="job", episode_id="ep", attempt=3, status="failed", group_id="grp", group_size=4,
                          env_name="env", llm_model="llm", total_reward=0.5, steps=6, reason="env_http_error",
                          error_class="HTTPError", error="boom", started_at=100.0, finished_at=160.0, worker="w1",
                          attempt_id="aid", ended_by="", prompt_tokens=17, completion_tokens=19)
    row = dict(zip(ATTEMPT_COLUMNS, _attempt_row(close), strict=True))
    assert row == {
        "episode_id": "ep", "attempt_id": "aid", "attempt": 3, "job_id": "job", "status": "failed",
        "reason": "env_http_error", "error_class": "HTTPError", "error": "boom", "total_reward": 0.5, "steps": 6,
        "ended_by": None, "prompt_tokens": 17, "completion_tokens": 19, "started_at": 100.0, "finished_at": 160.0,
        "worker": "w1"}
