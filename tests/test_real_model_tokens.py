"""Token-exact trajectories against a real server: llama.cpp's ``llama-server`` serving
SmolLM2-135M-Instruct (the same server as tests/test_real_model.py, ``make test-real-model``
installs it), through Redis, worker and consumer processes and the bundled env server.

What the stand-in's toy tokenizer cannot show: a real tokenizer and chat template, real
logprobs, llama-server's own ``/apply-template``, ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import requests

from consumer.export import export_streams
from consumer.storage import open_store
from consumer.streams import START_DRIFT, build
from producer.enqueue import submit
from tests.storecheck import assert_trajectories_sound
from tests.test_real_model import guess_tasks, llama, real_settings, wait_stored  # noqa: F401 - fixtures

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


def detokenize(llama, ids: list[int]) -> str:
    r = requests.post(llama.url + "/detokenize", json={"tokens": ids}, timeout=30)
    r.raise_for_status()
    return r.json()["content"]


def test_llama_server_answer_shape_is_what_the_table_reads(llama):
    """The real answer, read off the wire: ids in logprobs.content, prompt ids from the
    server's own template and tokenizer as many as its usage says."""
    from workers.token_answers import read_tokens, request_fields

    messages = [{"role": "user", "content": "Say hi."}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0,
            **request_fields("auto")}
    answer = requests.post(llama.url + "/v1/chat/completions", json=body, timeout=120).json()
    print("\n[real-model tokens] answer:", json.dumps(answer)[:600])
    t = read_tokens("auto", answer, answer["choices"][0]["message"]["content"])
    assert t.source == "llama.cpp" and t.status == "ok", t.error
    prompt = requests.post(llama.url + "/apply-template", json={"messages": messages}, timeout=30).json()["prompt"]
    ids = requests.post(llama.url + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True},
                        timeout=30).json()["tokens"]
    assert len(ids) == answer["usage"]["prompt_tokens"]


def test_multi_turn_episodes_with_tokens(real_settings, procs, env_server, redis_client, tmp_path, llama):
    """Full history (append-only template) and message_cut 1 (trimming), tokens asked for:
    every stored completion's ids detokenize (the server's own /detokenize) to the stored
    answer, logprobs are finite and <= 0, full-history episodes are one stream with no drift,
    and the trimmed job records drift where it trims."""
    _, env_url = env_server
    # one line per answer; greedy, so a run is reproducible
    full = real_settings.replace(message_cut=0, temperature=0.0, tokens="auto")
    cut = real_settings.replace(message_cut=1, temperature=0.0, tokens="llama.cpp")
    procs.settings = full
    t0 = time.monotonic()
    job_full = submit(redis_client, full, [guess_tasks(tmp_path, env_url, "tfull", guess=3, max_turns=4,
                                                       arith=1)]).job.job_id
    job_cut = submit(redis_client, cut, [guess_tasks(tmp_path, env_url, "tcut", guess=2, max_turns=4,
                                                     arith=1)]).job.job_id
    procs.worker("w1")
    procs.consumer()
    wait_stored(full, job_full, 4, 900)
    wait_stored(full, job_cut, 3, 900)
    db = full.results_store
    with open_store(db, readonly=True) as store:
        figures = {}
        for job in (job_full, job_cut):
            res = store.results(job)
            assert res["job"]["completed"] == res["job"]["episodes"], procs.log("w1")[-4000:]
            assert_trajectories_sound(db, job)
            t = res["token_ids"]
            figures[job] = t
            statuses = t["by_status"]
            answered = res["job"]["steps"] - sum(
                1 for ep in store.list_episodes(job) for s in store.episode_trajectory(ep["episode_id"])
                if s["ended_by"] == "context_length")
            assert statuses.get("ok", 0) == answered and t["steps"] == answered, (statuses, procs.log("w1")[-3000:])
            multi = 0
            for ep in store.list_episodes(job):
                steps = {s["step_id"]: s for s in store.episode_trajectory(ep["episode_id"])}
                rows = store.episode_tokens(ep["episode_id"])
                multi += len(rows) > 1
                for r in rows:
                    text = detokenize(llama, r["completion_ids"])
                    answer = steps[r["step_id"]]["response"]
                    # the end-of-generation token, when listed, is not part of the answer's text
                    assert text.replace("<|im_end|>", "").strip() == answer.strip(), (text, answer)
                    assert all(math.isfinite(x) and x <= 0 for x in r["completion_logprobs"])
                    assert len(r["completion_logprobs"]) == len(r["completion_ids"]) == r["completion_len"]
                    assert len(r["prompt_ids"]) == steps[r["step_id"]]["prompt_tokens"]
                stream = build(rows)
                if job == job_full:
                    assert stream.single, [(s.first_step, s.starts_because, s.drift_at) for s in stream.segments]
                    seg = stream.segments[0]
                    assert seg.ids[:len(rows[-1]["prompt_ids"])] == rows[-1]["prompt_ids"]
                    assert sum(seg.mask) == sum(len(r["completion_ids"]) for r in rows)
                elif len(rows) > 2:
                    # system + the last message only: from the third turn on, history was trimmed
                    assert any(s.starts_because == START_DRIFT for s in stream.segments)
            assert multi >= 1, "no multi-turn episode in the job"
        assert figures[job_full]["drift_steps"] == 0
        assert figures[job_cut]["drift_steps"] > 0
    out = tmp_path / "streams.jsonl"
    summary = export_streams(db, job_full, out, fmt="jsonl")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary.rows == len(rows) == 4 and all(r["segments"] == 1 and not r["token_drift"] for r in rows)
    t = figures[job_full]
    ids = t["prompt_ids"] + t["completion_ids"]
    print(f"\n[real-model tokens] {time.monotonic() - t0:.0f}s; full history: {t['steps']} steps, {t['prompt_ids']} "
          f"prompt ids + {t['completion_ids']} completion ids in {t['bytes']} bytes ({t['bytes'] / ids:.2f} bytes "
          f"per stored id; {t['bytes'] / t['completion_ids']:.1f} per sampled token with its turn's prompt; token "
          f"strings {t['text_bytes']} chars more); cut: {figures[job_cut]['drift_steps']} drifted steps in "
          f"{figures[job_cut]['drift_episodes']} episodes")


def test_a_resumed_episodes_token_stream_is_continuous(real_settings, procs, env_server, redis_client, tmp_path,
                                                       llama):
    """A full-history token-exact episode whose worker is stopped mid-episode (handed back at a
    call boundary, exactly where it stood) and continued by another worker on the same instance:
    its steps are 1..n once each and its token stream is one segment, no drift, the turns of
    both attempts joined (broker/resume.py carries the last turn's ids across)."""
    import signal

    from broker.ledger import Ledger
    from interactor.children import signal_group

    _, env_url = env_server
    s = real_settings.replace(message_cut=0, temperature=0.0, tokens="auto", shutdown_grace_s=0)
    procs.settings = s
    job = submit(redis_client, s, [guess_tasks(tmp_path, env_url, "tresume", guess=1, max_turns=8, arith=0)]).job
    ledger = Ledger.for_settings(redis_client, s)
    (episode,) = [e for e in ledger.states(job.job_id)]
    procs.consumer()
    procs.worker("w1")

    def stepped(n: int) -> bool:
        p = ledger.progress(job.job_id, episode)
        return p is not None and p.step > n

    from tests.conftest import wait_for

    wait_for(lambda: stepped(3), 600, what="three turns in")
    signal_group(procs.procs["w1"], signal.SIGTERM)  # grace 0: handed back at the next boundary
    wait_for(lambda: procs.procs["w1"].poll() is not None, 120, what="w1 handed back and exited")
    procs.worker("w2")
    wait_stored(s, job.job_id, 1, 900)
    with open_store(s.results_store, readonly=True) as store:
        (ep,) = store.list_episodes(job.job_id)
        assert ep["status"] == "completed"
        attempts = sorted(store.attempts(episode), key=lambda a: a["attempt"])
        assert attempts[-1]["resumed_at"] and attempts[-1]["resumed_at"] >= 4, attempts
        steps = [st["step_id"] for st in store.episode_trajectory(episode)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) > attempts[-1]["resumed_at"]
        rows = store.episode_tokens(episode)
        assert [r["step_id"] for r in rows] == steps and all(r["token_status"] == "ok" for r in rows)
        stream = build(rows)
        assert stream.single, [(x.first_step, x.starts_because, x.drift_at) for x in stream.segments]
        assert not any(r["token_drift"] for r in rows)
