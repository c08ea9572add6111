"""producer.taskfile and producer.planning: task files -> validated episode specs (no Redis)."""

from __future__ import annotations

import json
import os
import re
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from broker.records import unpack
from producer.planning import PlannedJob, derive_seed, plan_job
from producer.taskfile import TaskFileError, load_task_file

pytestmark = pytest.mark.unit  # needs no server: make check runs it

URL = "http://env.local:8000"


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def task_file(tmp_path, body: str, name: str = "tasks.yaml"):
    return write(tmp_path / name, body)


ROWS = [{"q": "1+1", "a": 2}, {"q": "2+3", "a": 5}, {"q": "nested", "a": [1, {"x": None}]}]


# --------------------------------------------------------------------------- formats

def _write_dataset(folder, fmt: str):
    p = folder / f"data.{fmt}"
    if fmt == "json":
        p.write_text(json.dumps(ROWS))
    elif fmt == "jsonl":
        # blank lines are skipped
        p.write_text("\n".join(json.dumps(r) for r in ROWS[:2]) + "\n\n   \n" + json.dumps(ROWS[2]) + "\n")
    elif fmt in ("yaml", "yml"):
        p.write_text("- {q: '1+1', a: 2}\n- {q: '2+3', a: 5}\n- q: nested\n  a: [1, {x: null}]\n")
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist([{"q": r["q"], "a": i} for i, r in enumerate(ROWS)]), p)
    return p


@pytest.mark.parametrize("fmt", ["json", "jsonl", "yaml", "yml", "parquet"])
def test_every_dataset_format(tmp_path, fmt):
    _write_dataset(tmp_path, fmt)
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: math
            env_params: {{level: 3}}
            dataset: data.{fmt}
            env_num: 2
            base_url: {URL}
        """)
    plan = plan_job([str(tf)], job_id="job1")
    assert isinstance(plan, PlannedJob)
    assert plan.groups == 3 and len(plan.episodes) == 6
    assert plan.by_env == {"math": 6}
    assert plan.sources == [os.path.abspath(tf)]
    rows = [ep.env_params["dataset"] for ep in plan.episodes[::2]]
    if fmt == "parquet":
        assert rows == [{"q": r["q"], "a": i} for i, r in enumerate(ROWS)]
    else:
        assert rows == ROWS
    for ep in plan.episodes:
        assert ep.env_params["level"] == 3
        assert ep.base_url == URL and ep.queue == "episodes" and ep.env_name == "math"
        assert ep.group_size == 2
        # every spec survives the wire format
        assert unpack(ep.pack()) == ep


def test_inline_dataset_and_no_dataset(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: inline
            dataset: [{{a: 1}}, {{a: 2}}]
            base_url: {URL}
          - env_name: single
            env_params: {{k: v}}
            env_num: 3
            base_url: {URL}
        """)
    plan = plan_job([tf], job_id="j")
    assert [e.env_params for e in plan.episodes[:2]] == [{"dataset": {"a": 1}}, {"dataset": {"a": 2}}]
    single = [e for e in plan.episodes if e.env_name == "single"]
    # no dataset: "dataset": {} is sent, as the original system sends it
    assert len(single) == 3 and all(e.env_params == {"k": "v", "dataset": {}} for e in single)
    assert single[0].env_params["dataset"] is not single[1].env_params["dataset"]
    assert {e.group_id for e in single} == {"j.1.2.1"}
    assert single[0].source == f"{tf} entry 2"
    assert plan.episodes[1].source == f"{tf} entry 1 row 2"
    assert plan.groups == 3 and plan.by_env == {"inline": 2, "single": 3}


def test_relative_dataset_resolves_from_yaml_folder(tmp_path, monkeypatch):
    sub = tmp_path / "conf" / "tasks"
    (sub / "data").mkdir(parents=True)
    (sub / "data" / "rows.jsonl").write_text('{"a": 1}\n')
    (tmp_path / "conf" / "shared.json").write_text('[{"b": 2}]')
    tf = task_file(sub, f"""
        environments:
          - env_name: e1
            dataset: data/rows.jsonl
            base_url: {URL}
          - env_name: e2
            dataset: ../shared.json
            base_url: {URL}
        """)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # cwd must not matter
    plan = plan_job([os.path.relpath(tf)], job_id="j")
    assert [e.env_params["dataset"] for e in plan.episodes] == [{"a": 1}, {"b": 2}]
    entries = load_task_file(tf, default_base_url=URL)
    assert entries[0]["dataset"] == str(sub / "data" / "rows.jsonl")
    assert entries[1]["dataset"] == str(tmp_path / "conf" / "shared.json")


def test_absolute_dataset_path(tmp_path):
    (tmp_path / "abs").mkdir()
    ds = _write_dataset(tmp_path / "abs", "json")
    tf = task_file(tmp_path / "t", f"""
        environments:
          - env_name: e
            dataset: {ds}
            base_url: {URL}
        """)
    assert len(plan_job([tf], job_id="j").episodes) == 3


# --------------------------------------------------------------------------- ids

def test_ids_shape_and_uniqueness_across_files_entries_rows(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([{"i": i} for i in range(4)]))
    body = f"""
        environments:
          - env_name: a
            dataset: d.json
            env_num: 3
            base_url: {URL}
          - env_name: b
            env_num: 2
            base_url: {URL}
        """
    t1 = task_file(tmp_path, body, "one.yaml")
    t2 = task_file(tmp_path / "x", body, "one.yaml")  # same basename, another folder
    (tmp_path / "x" / "d.json").write_text(json.dumps([{"i": i} for i in range(4)]))
    plan = plan_job([t1, t2], job_id="run_7-b")
    eps = plan.episodes
    assert len(eps) == 2 * (4 * 3 + 2)
    assert plan.groups == 2 * (4 + 1)
    assert len({e.episode_id for e in eps}) == len(eps)
    assert len({e.group_id for e in eps}) == plan.groups
    for e in eps:
        assert re.fullmatch(r"run_7-b\.[12]\.[12]\.\d+", e.group_id)
        assert e.episode_id.startswith(e.group_id + ".")
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+", e.episode_id)
    assert eps[0].group_id == "run_7-b.1.1.1" and eps[0].episode_id == "run_7-b.1.1.1.1"
    assert eps[5].episode_id == "run_7-b.1.1.2.3"
    b2 = [e for e in eps if e.group_id == "run_7-b.2.2.1"]
    assert [e.episode_id for e in b2] == ["run_7-b.2.2.1.1", "run_7-b.2.2.1.2"]
    assert all(e.group_size == 2 for e in b2)
    # group sizes match the number of episodes in each group
    from collections import Counter
    sizes = Counter(e.group_id for e in eps)
    assert all(sizes[e.group_id] == e.group_size for e in eps)
    assert all(e.job_id == "run_7-b" for e in eps)


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a/b", "ü"])
def test_job_id_must_be_url_safe(tmp_path, bad):
    tf = task_file(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}'}}]\n")
    with pytest.raises(ValueError, match="job_id"):
        plan_job([tf], job_id=bad)


# --------------------------------------------------------------------------- seeds

def _seed_file(tmp_path, seed_line: str = ""):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(5)))
    return task_file(tmp_path, f"""
        environments:
          - env_name: e
            dataset: d.jsonl
            env_num: 4
            base_url: {URL}
            {seed_line}
          - env_name: f
            env_num: 2
            base_url: {URL}
        """)


def test_seeds_are_deterministic_and_independent_of_job_id(tmp_path):
    tf = _seed_file(tmp_path)
    a = plan_job([tf], job_id="first")
    b = plan_job([tf], job_id="second")
    assert [e.seed for e in a.episodes] == [e.seed for e in b.episodes]
    seeds = [e.seed for e in a.episodes]
    assert len(set(seeds)) == len(seeds)  # every episode its own seed, also within a group
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds)
    # matches the public derivation (base 0 when unset, file basename, e, r, k)
    ep = next(e for e in a.episodes if e.episode_id == "first.1.1.3.2")
    assert ep.seed == derive_seed(0, "tasks.yaml", 1, 3, 2)
    ep = next(e for e in a.episodes if e.episode_id == "first.1.2.1.2")
    assert ep.seed == derive_seed(0, "tasks.yaml", 2, 1, 2)


def test_seed_base_changes_seeds(tmp_path):
    s0 = [e.seed for e in plan_job([_seed_file(tmp_path / "a")], job_id="j").episodes]
    s7 = [e.seed for e in plan_job([_seed_file(tmp_path / "b", "seed: 7")], job_id="j").episodes]
    s7b = [e.seed for e in plan_job([_seed_file(tmp_path / "c", "seed: 7")], job_id="k").episodes]
    assert s7 == s7b
    assert s0[:20] != s7[:20] and not set(s0[:20]) & set(s7[:20])
    assert s0[20:] == s7[20:]  # the second entry has no seed key in either file


def test_seed_null_lets_the_env_choose(tmp_path):
    plan = plan_job([_seed_file(tmp_path, "seed: null")], job_id="j")
    assert all(e.seed is None for e in plan.episodes if e.env_name == "e")
    assert all(isinstance(e.seed, int) for e in plan.episodes if e.env_name == "f")


# --------------------------------------------------------------------------- defaults, copies

def test_defaults_and_overrides(tmp_path):
    tf = task_file(tmp_path, """
        environments:
          - env_name: plain
          - env_name: custom
            base_url: https://other.example/api
            queue: slow
            env_params:
        """)
    plan = plan_job([tf], job_id="j", default_base_url=URL, default_queue="fast")
    plain, custom = plan.episodes
    assert (plain.base_url, plain.queue, plain.env_params, plain.group_size) == (URL, "fast", {"dataset": {}}, 1)
    assert (custom.base_url, custom.queue, custom.env_params) == ("https://other.example/api", "slow",
                                                                  {"dataset": {}})
    assert plain.image == custom.image == ""


def test_episodes_do_not_alias_params(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: e
            env_params: {{opts: {{depth: 1, tags: [a]}}, flat: 1}}
            dataset: [{{r: 1}}, {{r: 2}}]
            env_num: 2
            base_url: {URL}
          - env_name: flat
            env_params: {{x: 1}}
            env_num: 2
            base_url: {URL}
        """)
    eps = plan_job([tf], job_id="j").episodes
    eps[0].env_params["opts"]["tags"].append("mutated")
    eps[0].env_params["opts"]["depth"] = 99
    assert eps[1].env_params["opts"] == {"depth": 1, "tags": ["a"]}
    assert eps[2].env_params["opts"] == {"depth": 1, "tags": ["a"]}
    eps[4].env_params["x"] = 2
    eps[4].env_params["dataset"]["y"] = 3
    assert eps[5].env_params == {"x": 1, "dataset": {}}
    # rows: one object per group at most, never shared across groups
    assert eps[0].env_params["dataset"] is not eps[2].env_params["dataset"]


def test_yaml_aliased_rows_are_not_shared_across_groups(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: e
            dataset: [&row {{a: [1]}}, *row]
            base_url: {URL}
        """)
    eps = plan_job([tf], job_id="j").episodes
    assert eps[0].env_params["dataset"] is not eps[1].env_params["dataset"]
    eps[0].env_params["dataset"]["a"].append(2)
    assert eps[1].env_params["dataset"] == {"a": [1]}


def test_dates_stay_strings(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: e
            env_params: {{day: 2024-01-31}}
            dataset: [{{when: 2024-02-01 10:00:00}}]
            base_url: {URL}
        """)
    (ep,) = plan_job([tf], job_id="j").episodes
    assert ep.env_params == {"day": "2024-01-31", "dataset": {"when": "2024-02-01 10:00:00"}}
    assert unpack(ep.pack()) == ep


# --------------------------------------------------------------------------- errors

def _err(tmp_path, body: str, *, name="tasks.yaml", **kw) -> str:
    tf = task_file(tmp_path, body, name)
    with pytest.raises(TaskFileError) as ei:
        plan_job([tf], job_id="j", **kw)
    msg = str(ei.value)
    assert str(tf) in msg, msg
    return msg


def test_error_unknown_entry_key(tmp_path):
    msg = _err(tmp_path, f"""
        environments:
          - env_name: ok
            base_url: {URL}
          - env_name: typo
            env_nums: 4
            base_url: {URL}
        """)
    assert "entry 2" in msg and "'env_nums'" in msg and "unknown key" in msg


def test_error_unknown_top_level_key(tmp_path):
    msg = _err(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}'}}]\nenviroment: x\n")
    assert "'enviroment'" in msg


def test_error_duplicate_key(tmp_path):
    msg = _err(tmp_path, f"""
        environments:
          - env_name: e
            env_num: 2
            env_num: 3
            base_url: {URL}
        """)
    assert "duplicate key 'env_num'" in msg and "line 4" in msg


@pytest.mark.parametrize("body, expect", [
    ("", "empty file"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("other: 1\n", "missing key 'environments'"),  # 'other' alone is ignored, as the original ignores it
    ("environment: []\n", "unknown key 'environment': did you mean 'environments'?"),
    ("environments: []\n", "non-empty list"),
    ("environments: {a: 1}\n", "non-empty list"),
    ("environments:\n", "missing key 'environments'"),
])
def test_error_top_level_shape(tmp_path, body, expect):
    assert expect in _err(tmp_path, body)


def test_error_not_yaml(tmp_path):
    msg = _err(tmp_path, "environments:\n  - env_name: [unclosed\n  - x: 1\n")
    assert "not valid YAML" in msg and re.search(r"line \d+", msg)


def test_error_missing_task_file(tmp_path):
    with pytest.raises(TaskFileError, match="nope.yaml: task file not found"):
        plan_job([str(tmp_path / "nope.yaml")], job_id="j")


@pytest.mark.parametrize("entry, field, expect", [
    ("{base_url: 'URL'}", "env_name", "missing"),
    ("{env_name: 'a b', base_url: 'URL'}", "env_name", "letters, digits"),
    ("{env_name: 'a/b', base_url: 'URL'}", "env_name", "letters, digits"),
    ("{env_name: 5, base_url: 'URL'}", "env_name", "5"),
    ("{env_name: e, env_params: [1], base_url: 'URL'}", "env_params", "mapping"),
    ("{env_name: e, env_num: 0, base_url: 'URL'}", "env_num", ">= 1"),
    ("{env_name: e, env_num: '4', base_url: 'URL'}", "env_num", "integer"),
    ("{env_name: e, env_num: true, base_url: 'URL'}", "env_num", "integer"),
    ("{env_name: e, env_num: 1.5, base_url: 'URL'}", "env_num", "integer"),
    ("{env_name: e}", "base_url", "no default"),
    ("{env_name: e, base_url: 'ftp://x'}", "base_url", "http(s) URL"),
    ("{env_name: e, base_url: 'localhost:8000'}", "base_url", "http(s) URL"),
    ("{env_name: e, base_url: 'URL', seed: abc}", "seed", "integer or null"),
    ("{env_name: e, base_url: 'URL', seed: 1.5}", "seed", "integer or null"),
    ("{env_name: e, base_url: 'URL', queue: ''}", "queue", "non-empty string"),
    ("{env_name: e, base_url: 'URL', queue: 3}", "queue", "non-empty string"),
    ("{env_name: e, base_url: 'URL', dataset: 5}", "dataset", "file path or a list"),
    ("{env_name: e, base_url: 'URL', dataset: []}", "dataset", "no rows"),
    ("{env_name: e, base_url: 'URL', dataset: d.csv}", "dataset", "unknown format '.csv'"),
    ("{env_name: e, base_url: 'URL', dataset: [{a: 1}], env_params: {dataset: x}}", "env_params", "overwrite"),
    ("{env_name: e, base_url: 'URL', env_params: {1: x}}", "env_params", "keys must be strings"),
    ("{env_name: e, base_url: 'URL', env_params: {b: !!binary aGk=}}", "env_params", "env_params.b"),
])
def test_error_entry_fields(tmp_path, entry, field, expect):
    body = f"environments:\n  - {{env_name: fine, base_url: '{URL}'}}\n  - {entry.replace('URL', URL)}\n"
    msg = _err(tmp_path, body)
    assert "entry 2" in msg and f"field '{field}'" in msg and expect in msg, msg


def test_error_entry_not_mapping(tmp_path):
    msg = _err(tmp_path, "environments:\n  - just-a-string\n")
    assert "entry 1" in msg and "must be a mapping" in msg


def test_error_missing_dataset_file(tmp_path):
    msg = _err(tmp_path, f"""
        environments:
          - env_name: e
            base_url: {URL}
            dataset: data/missing.jsonl
        """)
    assert "entry 1" in msg and "field 'dataset'" in msg and "data/missing.jsonl" in msg
    assert "not found" in msg and str(tmp_path / "data" / "missing.jsonl") in msg


def test_error_bad_jsonl_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n')
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: d.jsonl}}\n")
    assert "d.jsonl" in msg and "line 4" in msg and "row 3" in msg and "entry 1" in msg


def test_error_jsonl_row_not_mapping(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: d.jsonl}}\n")
    assert "row 2" in msg and "line 2" in msg and "list" in msg


@pytest.mark.parametrize("fmt, content, expect", [
    ("json", '[{"a": 1}, 2]', "row 2"),
    ("json", '{"a": 1}', "must be a list"),
    ("json", '[{"a": 1},\n {"a": }]', "line 2"),
    ("yaml", "- {a: 1}\n- {b: 2}\n- scalar\n", "row 3"),
    ("yaml", "a: 1\n", "must be a list"),
    ("yml", "- {a: 1\n", "not valid YAML"),
])
def test_error_bad_dataset_rows(tmp_path, fmt, content, expect):
    (tmp_path / f"d.{fmt}").write_text(content)
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: d.{fmt}}}\n")
    assert f"d.{fmt}" in msg and "entry 1" in msg and "field 'dataset'" in msg and expect in msg, msg


def test_error_inline_row_not_mapping(tmp_path):
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: [{{a: 1}}, [x]]}}\n")
    assert "entry 1" in msg and "row 2" in msg and "mapping" in msg


def test_error_parquet_unsendable_values(tmp_path):
    import datetime as dt
    pq.write_table(pa.Table.from_pylist([{"a": 1, "t": None}, {"a": 2, "t": dt.datetime(2024, 1, 1)}]),
                   tmp_path / "d.parquet")
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: d.parquet}}\n")
    assert "row 2" in msg and "dataset.t" in msg and "datetime" in msg


def test_error_corrupt_parquet(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    msg = _err(tmp_path, f"environments:\n  - {{env_name: e, base_url: '{URL}', dataset: d.parquet}}\n")
    assert "cannot read Parquet" in msg


def test_whole_file_set_is_validated_before_returning(tmp_path):
    good = task_file(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}'}}]\n", "good.yaml")
    bad = task_file(tmp_path, "environments: [{env_name: e}]\n", "bad.yaml")
    with pytest.raises(TaskFileError, match=r"bad\.yaml: entry 1 \(e.*field 'base_url'"):
        plan_job([good, bad], job_id="j")


# --------------------------------------------------------------------------- speed

def test_100k_episode_plan_is_fast(tmp_path):
    with open(tmp_path / "d.jsonl", "w") as fh:
        for i in range(25_000):
            fh.write(json.dumps({"id": i, "prompt": f"task {i}", "answer": [i, i + 1]}) + "\n")
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: bench
            env_params: {{level: 3, opts: {{a: [1, 2]}}}}
            dataset: d.jsonl
            env_num: 4
            base_url: {URL}
        """)
    t0 = time.perf_counter()
    plan = plan_job([tf], job_id="bench")
    took = time.perf_counter() - t0
    print(f"\nplanned {len(plan.episodes)} episodes in {plan.groups} groups in {took:.3f}s")
    assert len(plan.episodes) == 100_000 and plan.groups == 25_000
    assert len({e.episode_id for e in plan.episodes}) == 100_000
    assert took < 10


# --------------------------------------------------------------------------- inproc transport

def test_inproc_entries_need_no_base_url(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: textarena.GuessTheNumber-v0
            transport: inproc
            env_class: envs.textarena_env:TextArenaEnv
            dataset: [{{seed: 1}}, {{seed: 2}}]
            env_num: 2
          - env_name: reasoning_gym
            env_class: mypkg.envs:Inner              # env_class alone implies inproc
            env_params: {{task: leg_counting}}
          - env_name: guess_number                   # http entries are unchanged
            base_url: {URL}
        """)
    plan = plan_job([tf], job_id="j")  # no default base URL given: inproc entries do not need one
    by_env = {}
    for ep in plan.episodes:
        by_env.setdefault(ep.env_name, []).append(ep)
    ta = by_env["textarena.GuessTheNumber-v0"]
    assert len(ta) == 4 and {(e.transport, e.env_class, e.base_url) for e in ta} == {
        ("inproc", "envs.textarena_env:TextArenaEnv", "")}
    assert {e.env_params["dataset"]["seed"] for e in ta} == {1, 2}
    (rg,) = by_env["reasoning_gym"]
    assert (rg.transport, rg.env_class) == ("inproc", "mypkg.envs:Inner")
    (http,) = by_env["guess_number"]
    assert (http.transport, http.env_class, http.base_url) == ("http", "", URL)
    again = unpack(ta[0].pack())
    assert (again.transport, again.env_class) == ("inproc", "envs.textarena_env:TextArenaEnv")


def test_inproc_entries_ignore_the_default_base_url(tmp_path):
    tf = task_file(tmp_path, "environments: [{env_name: e, env_class: 'm:C'}]\n")
    (ep,) = plan_job([tf], job_id="j", default_base_url=URL).episodes
    assert (ep.transport, ep.base_url) == ("inproc", "")


@pytest.mark.parametrize("entry, field, words", [
    ("{env_name: e, transport: grpc, base_url: 'URL'}", "transport", "http, inproc"),
    ("{env_name: e, transport: inproc}", "env_class", "missing"),
    ("{env_name: e, transport: inproc, env_class: 'mypkg.envs.MyEnv'}", "env_class", "module:Class"),
    ("{env_name: e, transport: inproc, env_class: 'a b:C'}", "env_class", "module:Class"),
    # One attribute of the module: a dotted path reaches whatever the module imported (os.abort).
    ("{env_name: e, transport: inproc, env_class: 'mypkg.envs:Outer.Inner'}", "env_class", "module:Class"),
    ("{env_name: e, transport: inproc, env_class: 'workers.experience:os.abort'}", "env_class", "module:Class"),
    ("{env_name: e, transport: inproc, env_class: 5}", "env_class", "module:Class"),
    ("{env_name: e, env_class: 'm:C', base_url: 'URL'}", "base_url", "not used with transport inproc"),
    ("{env_name: e, transport: http, env_class: 'm:C', base_url: 'URL'}", "env_class", "only used with"),
])
def test_inproc_entry_errors(tmp_path, entry, field, words):
    msg = _err(tmp_path, f"environments: [{entry.replace('URL', URL)}]\n")
    assert "entry 1" in msg and f"field {field!r}" in msg and words in msg, msg


# --------------------------------------------------------------------------- URLs and integers

@pytest.mark.parametrize("url, words", [
    # urlsplit reads the host after the '@' (localhost), the HTTP client ends it at the '\\'.
    ("http://127.0.0.1:9\\@localhost:8000/v1", "backslash"),
    ("http://user:pw@env.local:8000", "user information"),
    ("https://TOKEN@env.local", "user information"),
    ("http://env.local:8000\t/x", "control character"),
    ("http://env .local:8000", "whitespace"),
    ("http://\u00e9nv.local:8000", "non-ASCII"),
    ("http://env.local:0", "port"),
    ("http://env.local:65536", "port"),
    ("http://env.local:8000?x=1", "query"),
    ("http://env.local:8000#x", "fragment"),
    ("http://env.local:8000%2f@evil", "host"),
    ("ftp://env.local", "http"),
])
def test_base_urls_the_client_could_read_differently_are_refused_naming_file_entry_and_field(tmp_path, url, words):
    msg = _err(tmp_path, f"environments:\n  - {{env_name: fine, base_url: '{URL}'}}\n"
                         f"  - env_name: e\n    base_url: '{url}'\n")
    assert "tasks.yaml" in msg and "entry 2" in msg and "field 'base_url'" in msg and words in msg, msg
    assert "pw" not in msg and "TOKEN" not in msg  # the refused URL is shown redacted


def test_the_default_base_url_gets_the_same_check(tmp_path):
    msg = _err(tmp_path, "environments: [{env_name: e}]\n", default_base_url="http://127.0.0.1:9\\@localhost:8000")
    assert "entry 1" in msg and "field 'base_url'" in msg and "(the default)" in msg and "backslash" in msg, msg


@pytest.mark.parametrize("params, where", [
    ("{big: 123456789012345678901234567890}", "env_params.big"),
    ("{small: -9223372036854775809}", "env_params.small"),
    ("{nested: {deep: [1, 18446744073709551616]}}", "env_params.nested.deep[1]"),
])
def test_an_integer_msgpack_cannot_carry_is_refused_naming_where(tmp_path, params, where):
    msg = _err(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}', env_params: {params}}}]\n")
    assert "entry 1" in msg and "field 'env_params'" in msg and where in msg and "64 bits" in msg, msg


def test_64_bit_integers_still_travel(tmp_path):
    tf = task_file(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}', "
                             f"env_params: {{a: 18446744073709551615, b: -9223372036854775808}}}}]\n")
    (ep,) = plan_job([tf], job_id="j").episodes
    assert unpack(ep.pack()).env_params == {"a": 2**64 - 1, "b": -(2**63), "dataset": {}}


@pytest.mark.parametrize("fmt", [".jsonl", ".json"])
def test_a_too_large_integer_in_a_json_dataset_names_its_row(tmp_path, fmt):
    rows = [{"a": 1}, {"a": 2**70}]
    path = tmp_path / f"d{fmt}"
    path.write_text("\n".join(json.dumps(r) for r in rows) if fmt == ".jsonl" else json.dumps(rows))
    msg = _err(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}', dataset: d{fmt}}}]\n")
    assert "entry 1" in msg and "row 2" in msg and "field 'dataset'" in msg and "64 bits" in msg, msg


# --------------------------------------------------------------------------- the original system's keys

def test_env_image_is_read_and_kept_with_every_episode(tmp_path):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: qa_gym
            env_image: registry.example/qa-gym:1.3
            dataset: [{{prompt: a}}, {{prompt: b}}]
            env_num: 2
            base_url: {URL}
          - env_name: plain
            env_image: null
            base_url: {URL}
        """)
    eps = plan_job([tf], job_id="j").episodes
    assert [e.image for e in eps] == ["registry.example/qa-gym:1.3"] * 4 + [""]
    assert unpack(eps[0].pack()).image == "registry.example/qa-gym:1.3"
    assert all("env_image" not in e.env_params for e in eps)  # stored, not sent


def test_keys_the_original_reader_ignores_are_ignored_with_a_warning_naming_them(tmp_path, caplog):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: dabstepgym
            image: dabstep:latest
            base_url: {URL}
          - env_name: qa_gym
            demo_dataset: /mnt/private/harmbench.jsonl
            image: qa:1
            base_url: {URL}
        notes: a top-level key of the team's own
        """)
    with caplog.at_level("WARNING", logger="interactor.producer"):
        plan = plan_job([tf], job_id="j")
    assert len(plan.episodes) == 2
    assert plan.warnings == [
        f"{tf}: top level: key 'notes' ignored: neither interactor nor the original system's reader reads it",
        f"{tf}: entries 1, 2: key 'image' ignored: neither interactor nor the original system's reader reads it",
        f"{tf}: entry 2: key 'demo_dataset' ignored: neither interactor nor the original system's reader reads it",
    ]
    assert [r.getMessage() for r in caplog.records] == plan.warnings


@pytest.mark.parametrize("entry, field, expect", [
    ("{env_name: e, base_url: 'URL', env_image: 3}", "env_image", "must be a string"),
    ("{env_name: e, base_url: 'URL', env_image: [a]}", "env_image", "must be a string"),
    ("{env_name: e, base_url: 'URL', dataset: [{a: 1}], dataset_load_mode: lazy}", "dataset_load_mode",
     "'eager' (the rows are read here and sent) or 'parquet_row_ref'"),
    ("{env_name: e, base_url: 'URL', dataset: [{a: 1}], dataset_load_mode: 1}", "dataset_load_mode", "got 1"),
])
def test_bad_values_of_the_original_keys_are_errors(tmp_path, entry, field, expect):
    body = f"environments:\n  - {{env_name: fine, base_url: '{URL}'}}\n  - {entry.replace('URL', URL)}\n"
    msg = _err(tmp_path, body)
    assert "entry 2" in msg and f"field '{field}'" in msg and expect in msg, msg


@pytest.mark.parametrize("key, ours", [("env_nums", "env_num"), ("base_ulr", "base_url"), ("envparams", "env_params"),
                                       ("env_imag", "env_image"), ("dataset_mode", "dataset_load_mode")])
def test_a_typo_of_one_of_our_keys_is_still_an_error(tmp_path, key, ours):
    msg = _err(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}', {key}: 4}}]\n")
    assert f"unknown key {key!r}: did you mean {ours!r}?" in msg and "entry 1" in msg, msg


@pytest.mark.parametrize("empty", ['""', "null", "'  '"])
def test_an_empty_dataset_is_no_dataset(tmp_path, empty):
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: dabstepgym
            dataset: {empty}
            env_params: {{split: dev}}
            env_num: 2
            base_url: {URL}
        """)
    plan = plan_job([tf], job_id="j")
    assert plan.groups == 1 and [e.env_params for e in plan.episodes] == [{"split": "dev", "dataset": {}}] * 2


def test_an_own_dataset_key_of_an_entry_without_a_dataset_is_sent_as_written(tmp_path):
    tf = task_file(tmp_path, f"environments: [{{env_name: e, base_url: '{URL}', env_params: {{dataset: {{q: 1}}}}}}]\n")
    (ep,) = plan_job([tf], job_id="j").episodes
    assert ep.env_params == {"dataset": {"q": 1}}


def test_parquet_row_ref_sends_each_row_as_a_reference_to_its_place(tmp_path):
    path = tmp_path / "data" / "rows.parquet"
    path.parent.mkdir()
    with pq.ParquetWriter(path, pa.schema([("q", pa.string())])) as w:  # two row groups: 2 rows, then 1
        w.write_table(pa.Table.from_pylist([{"q": "a"}, {"q": "b"}]))
        w.write_table(pa.Table.from_pylist([{"q": "c"}]))
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: e
            dataset: data/rows.parquet
            dataset_load_mode: parquet_row_ref
            base_url: {URL}
          - env_name: eager
            dataset: data/rows.parquet
            dataset_load_mode: " "
            base_url: {URL}
        """)
    plan = plan_job([tf], job_id="j")
    refs = [e.env_params["dataset"] for e in plan.episodes[:3]]
    assert refs == [{"__dataset_ref__": {"kind": "parquet_row", "path": str(path), "row_group": g, "row_in_group": i,
                                         "row_idx": n}} for n, (g, i) in enumerate([(0, 0), (0, 1), (1, 0)])]
    assert [e.env_params["dataset"] for e in plan.episodes[3:]] == [{"q": "a"}, {"q": "b"}, {"q": "c"}]
    assert plan.warnings == []


def test_parquet_row_ref_on_other_datasets_reads_them_whole_and_says_so(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"q": 1}\n')
    tf = task_file(tmp_path, f"""
        environments:
          - env_name: e
            dataset: d.jsonl
            dataset_load_mode: parquet_row_ref
            base_url: {URL}
          - env_name: none
            dataset_load_mode: parquet_row_ref
            base_url: {URL}
        """)
    plan = plan_job([tf], job_id="j")
    assert [e.env_params["dataset"] for e in plan.episodes] == [{"q": 1}, {}]
    assert [w.split(": ", 2)[1:] for w in plan.warnings] == [
        ["entry 1", "dataset_load_mode 'parquet_row_ref' applies to .parquet files only: these rows are read and "
                    "sent whole, as the original system reads them"],
        ["entry 2", "dataset_load_mode without a dataset has no effect"]]
