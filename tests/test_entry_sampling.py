"""Per-entry sampling settings in task files (issue 48): an entry's ``max_tokens``,
``temperature`` and ``stop`` are checked, stored with each of its episodes
(``EpisodeSpec.sampling``), and reach that entry's model calls over the job's flags; ``n`` is
the entry's samples per task, as ``env_num``."""

from __future__ import annotations

import textwrap

import pytest

from broker.records import EpisodeSpec, unpack
from producer.planning import plan_job
from producer.taskfile import TaskFileError

URL = "http://env.local:8000"


def plan(tmp_path, body: str):
    path = tmp_path / "tasks.yaml"
    path.write_text(textwrap.dedent(body).lstrip("\n"))
    return plan_job([str(path)], job_id="j1")


def test_an_entrys_sampling_is_stored_with_each_of_its_episodes(tmp_path):
    job = plan(tmp_path, f"""
        environments:
          - env_name: short
            base_url: {URL}
            max_tokens: 32
            temperature: 0
            stop: "</answer>"
            n: 3
          - env_name: plain
            base_url: {URL}
        """)
    short = [e for e in job.episodes if e.env_name == "short"]
    plain = [e for e in job.episodes if e.env_name == "plain"]
    assert len(short) == 3 and {e.group_size for e in short} == {3}
    assert all(e.sampling == {"max_tokens": 32, "temperature": 0.0, "stop": ["</answer>"]} for e in short)
    assert [e.sampling for e in plain] == [{}]
    # through the ledger's packing and back, as a worker reads it
    back = unpack(short[0].pack())
    assert isinstance(back, EpisodeSpec) and back.sampling == short[0].sampling


def test_a_spec_packed_without_sampling_reads_as_the_jobs():
    spec = EpisodeSpec("j", "j.1.1.1.1", "j.1.1.1", 1, "e", URL, {})
    raw = spec.to_dict()
    del raw["sampling"]
    assert EpisodeSpec.from_dict(raw).sampling == {}


@pytest.mark.parametrize("line, says", [
    ("max_tokens: 0", "'max_tokens': must be an integer >= 1"),
    ("max_tokens: lots", "'max_tokens': must be an integer >= 1"),
    ("temperature: -1", "'temperature': must be a number >= 0"),
    ("temperature: hot", "'temperature': must be a number >= 0"),
    ("stop: []", "'stop': must be a non-empty string or a list of them"),
    ("stop: [1, 2]", "'stop': must be a non-empty string or a list of them"),
    ("n: 0", "'n': must be an integer >= 1"),
    ("n: 2\n    env_num: 3", "'n': is 2 and env_num is 3"),
    ("max_token: 5", "did you mean 'max_tokens'"),
])
def test_bad_sampling_is_refused_naming_the_entry_and_field(tmp_path, line, says):
    with pytest.raises(TaskFileError) as err:
        plan(tmp_path, f"environments:\n  - env_name: e1\n    base_url: {URL}\n    {line}\n")
    assert says in str(err.value) and "entry 1 (" in str(err.value)
