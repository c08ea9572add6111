"""The folders a request may make the producer read (producer/readroots.py), and the task-file
reader held to them. The feed server's use over HTTP is in tests/test_feed_serve.py."""
from __future__ import annotations

import json
import os

import pytest

from producer.readroots import OutsideRoots, ReadRoots
from producer.planning import plan_job
from producer.taskfile import TaskFileError, load_task_file

pytestmark = pytest.mark.unit  # needs no server: make check runs it


@pytest.fixture
def tree(tmp_path):
    """allowed/ (a root) holding a task file and rows; private rows beside it; a folder whose
    name starts like the root's; symlinks both ways."""
    allowed, private, twin = tmp_path / "allowed", tmp_path / "private", tmp_path / "allowed-twin"
    for d in (allowed, private, twin):
        d.mkdir()
    (allowed / "rows.jsonl").write_text(json.dumps({"q": 1}) + "\n")
    (private / "rows.jsonl").write_text(json.dumps({"q": "SECRET-ROW-TEXT"}) + "\n")
    (twin / "rows.jsonl").write_text(json.dumps({"q": 2}) + "\n")
    (allowed / "out.jsonl").symlink_to(private / "rows.jsonl")  # inside, pointing outside
    (private / "in.jsonl").symlink_to(allowed / "rows.jsonl")  # outside, pointing inside
    (allowed / "sub").symlink_to(private, target_is_directory=True)
    return tmp_path, ReadRoots.of([allowed])


def test_a_path_is_judged_by_where_it_resolves(tree):
    base, roots = tree
    allowed, private = base / "allowed", base / "private"
    assert roots.resolve(allowed / "rows.jsonl", "the file") == os.path.realpath(allowed / "rows.jsonl")
    # not yet existing files inside are fine (the reader says "not found" itself)
    assert roots.resolve(allowed / "new" / "x.yaml", "the file").startswith(roots.roots[0])
    # an outside symlink to an inside file is read by its inside path
    assert roots.resolve(private / "in.jsonl", "the file") == os.path.realpath(allowed / "rows.jsonl")
    for spelled in [private / "rows.jsonl", allowed / ".." / "private" / "rows.jsonl",
                    f"{allowed}//../private/rows.jsonl", allowed / "out.jsonl", allowed / "sub" / "rows.jsonl",
                    base / "allowed-twin" / "rows.jsonl", "/etc/passwd", "/"]:
        with pytest.raises(OutsideRoots) as err:
            roots.resolve(spelled, "the file")
        assert str(allowed) in str(err.value) and "INTERACTOR_FEED_TASK_ROOTS" in str(err.value), spelled


def test_the_setting_names_folders_or_defaults(tmp_path, monkeypatch):
    a, b, c = (tmp_path / n for n in "abc")
    assert ReadRoots.from_setting("", default=a).roots == (str(a),)
    assert ReadRoots.from_setting(f" {a} , {b},", default=c, also=[c]).roots == (str(a), str(b), str(c))
    assert ReadRoots.from_setting(f"{a},{a}/", default=c).roots == (str(a),)
    monkeypatch.setenv("HOME", str(b))
    assert ReadRoots.from_setting("~/data", default=c).roots == (str(b / "data"),)
    with pytest.raises(ValueError, match="no folders"):
        ReadRoots.of([])


def _tasks(path, dataset):
    path.write_text(json.dumps({"environments": [{"env_name": "arith", "base_url": "http://127.0.0.1:1",
                                                  "dataset": dataset}]}))
    return path


def test_a_task_file_and_its_datasets_are_read_only_inside_the_roots(tree):
    base, roots = tree
    allowed, private = base / "allowed", base / "private"
    inside = _tasks(allowed / "tasks.yaml", "rows.jsonl")
    (entry,) = load_task_file(inside, roots=roots)
    assert entry["rows"] == [{"q": 1}] and entry["dataset"] == os.path.realpath(allowed / "rows.jsonl")
    # without roots (the command line), the same reader reads anywhere
    (entry,) = load_task_file(_tasks(allowed / "t2.yaml", str(private / "rows.jsonl")))
    assert entry["rows"] == [{"q": "SECRET-ROW-TEXT"}]
    for tasks, where in [(_tasks(allowed / "t3.yaml", str(private / "rows.jsonl")), "field 'dataset'"),
                         (_tasks(allowed / "t4.yaml", "../private/rows.jsonl"), "field 'dataset'"),
                         (_tasks(allowed / "t5.yaml", "out.jsonl"), "field 'dataset'"),
                         (_tasks(allowed / "t6.yaml", "sub/rows.jsonl"), "field 'dataset'"),
                         (_tasks(private / "t7.yaml", str(allowed / "rows.jsonl")), "task file")]:
        with pytest.raises(TaskFileError) as err:
            load_task_file(tasks, roots=roots)
        text = str(err.value)
        assert "outside the folders this server may read" in text and where in text, text
        assert "SECRET-ROW-TEXT" not in text


def test_a_job_plans_only_when_every_file_is_inside(tree):
    base, roots = tree
    allowed, private = base / "allowed", base / "private"
    good = _tasks(allowed / "tasks.yaml", "rows.jsonl")
    assert len(plan_job([good], job_id="j1", roots=roots).episodes) == 1
    bad = _tasks(allowed / "bad.yaml", str(private / "rows.jsonl"))
    with pytest.raises(TaskFileError, match="outside the folders"):
        plan_job([good, bad], job_id="j2", roots=roots)
    assert len(plan_job([good, bad], job_id="j3").episodes) == 2  # the operator's own paths
