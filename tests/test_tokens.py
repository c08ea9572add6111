"""Token-exact trajectories (docs/protocol.md#token-options): each server's answer shape, the
checks that keep a step's text when its tokens are bad, drift, the stream and its loss mask,
storage on both backends, exports, and whole jobs through Redis, worker and consumer processes
against the stand-in (whose toy tokenizer answers like vLLM and like llama-server)."""

from __future__ import annotations

import json
import math
import struct
import textwrap
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from broker.records import SCHEMA_VERSION, JobSpec, StepRecord, unpack
from broker.tokens import (
    TOK_BAD_LOGPROB,
    TOK_IDS_NOT_TEXT,
    TOK_LENGTH_MISMATCH,
    TOK_NOT_INTEGER,
    TOK_PROMPT_IDS,
    TOKENS_INVALID,
    TOKENS_MISSING,
    TOKENS_NO_IDS,
    TOKENS_OK,
    first_difference,
    pack_ids,
    pack_logprobs,
    unpack_ids,
    unpack_logprobs,
    valid_id,
    valid_logprob,
)
from consumer.streams import START_AFTER_GAP, START_DRIFT, START_FIRST, build
from examples.standin_tokens import ToyTokenizer
from workers.hooks import NullHook
from workers.loop import LoopConfig, run_episode
from workers.token_answers import TOKEN_ANSWERS, TokenAnswer, read_tokens, request_fields

# --------------------------------------------------------------------------- recorded shapes
# Answers as the servers send them (ids and texts of their own tokenizers), cut to the fields read.

# vLLM 0.11, Qwen2.5-0.5B-Instruct, {"logprobs": true, "top_logprobs": 1, "return_token_ids": true}
VLLM_ANSWER = {
    "id": "chatcmpl-8f3c", "object": "chat.completion", "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!", "reasoning_content": None},
                 "logprobs": {"content": [
                     {"token": "Hello", "logprob": -0.0412, "bytes": [72, 101, 108, 108, 111],
                      "top_logprobs": [{"token": "Hello", "logprob": -0.0412, "bytes": [72, 101, 108, 108, 111]}]},
                     {"token": "!", "logprob": -0.6931, "bytes": [33], "top_logprobs": []},
                     {"token": "<|im_end|>", "logprob": -0.0003, "bytes": [60, 124, 105, 109, 95, 101, 110, 100, 124,
                                                                          62], "top_logprobs": []}]},
                 "finish_reason": "stop", "stop_reason": None, "token_ids": [9707, 0, 151645]}],
    "usage": {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3},
    "prompt_logprobs": None,
    "prompt_token_ids": [151644, 872, 198, 17360, 13, 151645, 198, 151644, 77091],
    "kv_transfer_params": None,
}

# SGLang 0.5, {"logprobs": true, "top_logprobs": 1}: the OpenAI shape, no ids on its chat route
SGLANG_ANSWER = {
    "id": "5a1e", "object": "chat.completion", "model": "qwen/qwen2.5-0.5b-instruct",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there", "tool_calls": None},
                 "logprobs": {"content": [
                     {"token": "Hi", "bytes": [72, 105], "logprob": -0.52, "top_logprobs": []},
                     {"token": " there", "bytes": [32, 116, 104, 101, 114, 101], "logprob": -1.2,
                      "top_logprobs": []}]},
                 "finish_reason": "stop", "matched_stop": 151645}],
    "usage": {"prompt_tokens": 12, "total_tokens": 14, "completion_tokens": 2},
}

# llama.cpp llama-server (b6xxx), SmolLM2-135M-Instruct, {"logprobs": true, "top_logprobs": 1}
LLAMA_ANSWER = {
    "choices": [{"finish_reason": "stop", "index": 0,
                 "message": {"role": "assistant", "content": "Hello! How"},
                 "logprobs": {"content": [
                     {"id": 19556, "token": "Hello", "bytes": [72, 101, 108, 108, 111], "logprob": -0.3589,
                      "top_logprobs": [{"id": 19556, "token": "Hello", "bytes": [72, 101, 108, 108, 111],
                                        "logprob": -0.3589}]},
                     {"id": 17, "token": "!", "bytes": [33], "logprob": -0.0931, "top_logprobs": []},
                     {"id": 1073, "token": " How", "bytes": [32, 72, 111, 119], "logprob": -1.0422,
                      "top_logprobs": []}]}}],
    "created": 1763900000, "model": "smollm2", "system_fingerprint": "b6000-xxxx", "object": "chat.completion",
    "usage": {"completion_tokens": 3, "prompt_tokens": 31, "total_tokens": 34}, "id": "chatcmpl-Xy",
    "timings": {"prompt_n": 31, "predicted_n": 3},
}

# OpenAI gpt-4o-mini, {"logprobs": true}
OPENAI_ANSWER = {
    "id": "chatcmpl-B9", "object": "chat.completion", "model": "gpt-4o-mini-2024-07-18",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes.", "refusal": None},
                 "logprobs": {"content": [
                     {"token": "Yes", "logprob": -0.00012, "bytes": [89, 101, 115], "top_logprobs": []},
                     {"token": ".", "logprob": -0.31, "bytes": [46], "top_logprobs": []}], "refusal": None},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 14, "completion_tokens": 2, "total_tokens": 16},
}


def content(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def copy(answer: dict) -> dict:
    return json.loads(json.dumps(answer))


# --------------------------------------------------------------------------- the table


@pytest.mark.unit
def test_the_table_names_each_server_once_and_asks_for_logprobs():
    servers = [w.server for w in TOKEN_ANSWERS]
    assert sorted(servers) == sorted(set(servers)) == ["llama.cpp", "openai", "sglang", "vllm"]
    for w in TOKEN_ANSWERS:
        assert w.request["logprobs"] is True
    assert "return_token_ids" not in request_fields("openai")  # OpenAI refuses unknown fields
    assert request_fields("vllm")["return_token_ids"] is True
    assert request_fields("llama.cpp")["top_logprobs"] >= 1  # llama-server computes no probs at n_probs 0
    assert request_fields("") == {}
    assert request_fields("auto") == {"logprobs": True, "top_logprobs": 1, "return_token_ids": True}


@pytest.mark.parametrize("mode", ["vllm", "auto"])
@pytest.mark.unit
def test_vllm_answer(mode):
    t = read_tokens(mode, VLLM_ANSWER, content(VLLM_ANSWER))
    assert (t.source, t.status, t.error) == ("vllm", TOKENS_OK, "")
    assert t.prompt_ids == VLLM_ANSWER["prompt_token_ids"]
    assert t.completion_ids == [9707, 0, 151645]  # the end-of-turn token is the model's too
    assert t.logprobs == [-0.0412, -0.6931, -0.0003]
    assert not t.needs_prompt_tokenize


@pytest.mark.unit
def test_sglang_answer_without_ids_keeps_logprobs_and_strings_and_warns():
    for mode in ("sglang", "auto"):
        t = read_tokens(mode, SGLANG_ANSWER, content(SGLANG_ANSWER))
        assert t.status == TOKENS_NO_IDS and t.completion_ids is None and t.prompt_ids is None
        assert t.logprobs == [-0.52, -1.2] and t.token_texts == ["Hi", " there"]
        assert "no token ids" in t.warnings[0]
        fields = t.record_fields()
        assert unpack_logprobs(fields["completion_logprobs"]) == pytest.approx([-0.52, -1.2])
        assert fields["completion_token_texts"] == ["Hi", " there"] and "completion_ids" not in fields
    # a patched SGLang that answers vLLM's fields is read as such
    patched = copy(SGLANG_ANSWER)
    patched["prompt_token_ids"] = list(range(12))
    patched["choices"][0]["token_ids"] = [13048, 1052]
    t = read_tokens("sglang", patched, content(patched))
    assert t.status == TOKENS_OK and t.completion_ids == [13048, 1052] and t.source == "sglang"


@pytest.mark.parametrize("mode", ["llama.cpp", "auto"])
@pytest.mark.unit
def test_llama_cpp_answer_ids_from_logprobs_prompt_ids_asked_of_the_server(mode):
    t = read_tokens(mode, LLAMA_ANSWER, content(LLAMA_ANSWER))
    assert (t.source, t.status) == ("llama.cpp", TOKENS_OK)
    assert t.completion_ids == [19556, 17, 1073]
    assert t.needs_prompt_tokenize and t.prompt_ids is None  # the client asks /apply-template + /tokenize


@pytest.mark.unit
def test_openai_answer_no_ids():
    t = read_tokens("openai", OPENAI_ANSWER, content(OPENAI_ANSWER))
    assert t.status == TOKENS_NO_IDS and t.token_texts == ["Yes", "."] and t.logprobs == [-0.00012, -0.31]
    assert read_tokens("auto", OPENAI_ANSWER, content(OPENAI_ANSWER)).source == "openai"


@pytest.mark.unit
def test_an_answer_without_logprobs_is_missing_not_an_error():
    a = copy(OPENAI_ANSWER)
    del a["choices"][0]["logprobs"]
    t = read_tokens("auto", a, content(a))
    assert t.status == TOKENS_MISSING and "no choices[0].logprobs" in t.error


# --------------------------------------------------------------------------- bad input


def spoil(answer: dict, how) -> dict:
    a = copy(answer)
    how(a)
    return a


@pytest.mark.parametrize("name,answer,how,code", [
    ("ids not matching text", VLLM_ANSWER,
     lambda a: a["choices"][0]["logprobs"]["content"][0].update(token="Help", bytes=[72, 101, 108, 112]),
     TOK_IDS_NOT_TEXT),
    ("llama ids not matching text", LLAMA_ANSWER,
     lambda a: a["choices"][0]["message"].update(content="Goodbye"), TOK_IDS_NOT_TEXT),
    ("wrong-length lists", VLLM_ANSWER, lambda a: a["choices"][0]["token_ids"].append(5), TOK_LENGTH_MISMATCH),
    ("non-integer id", VLLM_ANSWER, lambda a: a["choices"][0]["token_ids"].__setitem__(1, 0.5), TOK_NOT_INTEGER),
    ("string id (llama)", LLAMA_ANSWER,
     lambda a: a["choices"][0]["logprobs"]["content"][1].update(id="17"), TOK_NOT_INTEGER),
    ("negative prompt id", VLLM_ANSWER, lambda a: a["prompt_token_ids"].__setitem__(0, -1), TOK_NOT_INTEGER),
    ("bool id", VLLM_ANSWER, lambda a: a["choices"][0]["token_ids"].__setitem__(0, True), TOK_NOT_INTEGER),
    ("logprob > 0", VLLM_ANSWER, lambda a: a["choices"][0]["logprobs"]["content"][1].update(logprob=0.2),
     TOK_BAD_LOGPROB),
    ("logprob NaN", LLAMA_ANSWER,
     lambda a: a["choices"][0]["logprobs"]["content"][0].update(logprob=float("nan")), TOK_BAD_LOGPROB),
    ("logprob null", OPENAI_ANSWER, lambda a: a["choices"][0]["logprobs"]["content"][0].update(logprob=None),
     TOK_BAD_LOGPROB),
    # finite, <= 0, and past what float32 holds: packing it raised OverflowError and failed the step
    ("logprob below float32", VLLM_ANSWER,
     lambda a: a["choices"][0]["logprobs"]["content"][1].update(logprob=-1e39), TOK_BAD_LOGPROB),
    ("logprob an int past float", LLAMA_ANSWER,
     lambda a: a["choices"][0]["logprobs"]["content"][0].update(logprob=-10**400), TOK_BAD_LOGPROB),
    ("id past int32", VLLM_ANSWER, lambda a: a["choices"][0]["token_ids"].__setitem__(0, 2**31), TOK_NOT_INTEGER),
    ("prompt ids disagree with usage", VLLM_ANSWER, lambda a: a["usage"].update(prompt_tokens=10), TOK_PROMPT_IDS),
])
@pytest.mark.unit
def test_bad_token_answers_are_marked_invalid_with_the_reason(name, answer, how, code):
    a = spoil(answer, how)
    t = read_tokens("auto", a, content(a))
    assert t.status == TOKENS_INVALID, name
    assert t.error.startswith(code + ": "), t.error
    fields = t.record_fields()
    # an invalid step keeps no numbers a trainer could pick up
    assert fields["token_status"] == TOKENS_INVALID and "completion_ids" not in fields and "prompt_ids" not in fields


def test_nan_written_as_a_bare_word_keeps_the_step(model_server):
    """A server writing NaN (not JSON) still gives the step its text; its tokens are invalid."""
    from broker.settings import Settings
    from workers.modelclient import ModelClient

    srv, url = model_server
    srv.token_fault = "nan"
    c = ModelClient(Settings()).complete(url + "/v1", [{"role": "user", "content": "hi"}], model="m",
                                         temperature=0.0, deadline=time.monotonic() + 10, tokens="auto")
    assert c.content == "I don't know"
    assert c.tokens.status == TOKENS_INVALID and c.tokens.error.startswith(TOK_BAD_LOGPROB)


def test_without_tokens_asked_nan_stays_malformed(model_server):
    from broker.errors import MODEL_MALFORMED, EpisodeError
    from broker.settings import Settings
    from workers.modelclient import ModelClient

    srv, url = model_server
    srv.token_fault = "nan"
    c = ModelClient(Settings(llm_params=json.dumps({"logprobs": True})))
    with pytest.raises(EpisodeError) as err:
        c.complete(url + "/v1", [{"role": "user", "content": "hi"}], model="m", temperature=0.0,
                   deadline=time.monotonic() + 10, params={"logprobs": True})
    assert err.value.reason == MODEL_MALFORMED


# --------------------------------------------------------------------------- packing, records


@pytest.mark.unit
def test_packing_is_little_endian_int32_and_float32():
    ids = [0, 1, 151645, 2**31 - 1]
    assert pack_ids(ids) == struct.pack("<4i", *ids) and len(pack_ids(ids)) == 16
    assert unpack_ids(memoryview(pack_ids(ids))) == ids
    lps = [0.0, -0.5, -12.25]
    assert unpack_logprobs(pack_logprobs(lps)) == lps  # exactly representable in float32
    assert len(pack_logprobs(lps)) == 12


@pytest.mark.unit
def test_the_checks_accept_only_what_the_packing_holds():
    """valid_id and valid_logprob use the packing's bounds: a value they accept packs (a value
    past them used to pass and then fail the step as it was packed)."""
    lowest_float32 = struct.unpack("<f", b"\xff\xff\x7f\xff")[0]
    accepted = [0, 1, 2**31 - 1]
    assert all(valid_id(v) for v in accepted) and unpack_ids(pack_ids(accepted)) == accepted
    for v in (-1, 2**31, 2**63, True, 1.0, "1"):
        assert not valid_id(v), v
    with pytest.raises(struct.error):
        pack_ids([2**31])
    accepted = [0.0, -0.0, 0, -5, -1e-300, lowest_float32, -(2**127)]
    assert all(valid_logprob(v) for v in accepted)
    assert unpack_logprobs(pack_logprobs(accepted))[5] == lowest_float32  # stored exactly
    for v in (-1e39, -3.5e38, float("-inf"), float("nan"), -10**400, 1e-9, False, None):
        assert not valid_logprob(v), v
    with pytest.raises(OverflowError):
        pack_logprobs([-1e39])


def step_record(**kw) -> StepRecord:
    base = dict(job_id="j", env_id="e", attempt=1, step_id=1, env_name="x", llm_model="m", group_id="g",
                messages_json=b"[]", response="r", step_reward=0.0, cumulative_reward=0.0, terminated=False,
                truncated=False, episode_finished=False, is_trainable=True, attempt_id="a1")
    base.update(kw)
    return StepRecord(**base)


@pytest.mark.unit
def test_records_v3_carry_tokens_and_v2_records_still_decode():
    assert SCHEMA_VERSION >= 3
    rec = step_record(token_source="vllm", token_status="ok", prompt_ids=pack_ids([1, 2]),
                      completion_ids=pack_ids([3]), completion_logprobs=pack_logprobs([-0.5]), token_drift=4)
    back = unpack(rec.pack())
    assert unpack_ids(back.prompt_ids) == [1, 2] and unpack_logprobs(back.completion_logprobs) == [-0.5]
    assert back.token_drift == 4 and back.token_status == "ok"
    v2 = {k: v for k, v in step_record().to_dict().items()
          if k not in ("token_source", "token_status", "token_error", "prompt_ids", "completion_ids",
                       "completion_logprobs", "completion_token_texts", "token_drift")}
    v2["v"] = 2
    old = unpack(msgpack.packb(v2, use_bin_type=True))
    assert old.token_status == "" and old.prompt_ids is None and old.token_drift is None
    job_v2 = {k: v for k, v in JobSpec(job_id="j", llm_base_url="u", model="m").to_dict().items() if k != "tokens"}
    job_v2["v"] = 2
    assert unpack(msgpack.packb(job_v2, use_bin_type=True)).tokens == ""


# --------------------------------------------------------------------------- drift in the loop


@dataclass
class Result:
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Any = None


class ChatEnv:
    """A conversation that grows by one user message a turn (the env's side of a game)."""

    def __init__(self, turns: int):
        self.turns, self.actions = turns, []
        self.history = [{"role": "system", "content": "play"}, {"role": "user", "content": "start"}]

    def reset(self):
        return {}

    def get_task_prompt(self):
        return list(self.history)

    def step(self, action):
        self.actions.append(action)
        self.history += [{"role": "assistant", "content": action},
                         {"role": "user", "content": f"feedback {len(self.actions)}"}]
        return Result(reward=1.0, terminated=len(self.actions) >= self.turns)

    def close(self):
        pass


@dataclass
class TokCompletion:
    content: str
    finish_reason: str = "stop"
    weight_version: str = "w7"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens: TokenAnswer | None = None


class ToyPolicy:
    """Answers with the toy tokenizer's ids, through a template that appends only, or one that
    rewrites history (a turn counter in the system header, as some templates stamp a date)."""

    def __init__(self, rewriting: bool = False):
        self.rewriting, self.calls = rewriting, 0

    def render(self, messages):
        if self.rewriting:
            messages = [dict(messages[0], content=f"{messages[0]['content']} (turn {self.calls})")] + messages[1:]
        return ToyTokenizer.render(messages)

    def complete(self, messages):
        self.calls += 1
        text = f"guess {self.calls}"
        ids = ToyTokenizer.encode(text) + [ToyTokenizer.END_OF_TURN]
        return TokCompletion(text, tokens=TokenAnswer(
            source="vllm", status=TOKENS_OK, prompt_ids=ToyTokenizer.encode(self.render(messages)),
            completion_ids=ids, logprobs=[-0.25] * len(ids)))


def run_toy(turns: int, *, rewriting: bool = False, message_cut: int = 0) -> list[StepRecord]:
    published: list[StepRecord] = []
    cfg = LoopConfig(job_id="j", episode_id="e", env_name="chat", group_id="g", llm_model="m",
                     message_cut=message_cut, attempt_id="a1")
    run_episode(cfg, env=ChatEnv(turns), policy=ToyPolicy(rewriting), publish=published.append, hook=NullHook())
    return published


def token_rows(steps: list[StepRecord]) -> list[dict]:
    return [{"step_id": s.step_id, "token_status": s.token_status, "token_drift": s.token_drift,
             "prompt_ids": unpack_ids(s.prompt_ids), "completion_ids": unpack_ids(s.completion_ids),
             "completion_logprobs": unpack_logprobs(s.completion_logprobs)} for s in steps]


@pytest.mark.unit
def test_append_only_template_no_drift():
    steps = run_toy(4)
    assert [s.token_drift for s in steps] == [None] * 4
    assert all(s.token_status == TOKENS_OK and s.weight_version == "w7" for s in steps)


@pytest.mark.unit
def test_rewriting_template_records_drift_at_the_first_differing_position():
    steps = run_toy(3, rewriting=True)
    assert steps[0].token_drift is None
    header = len(ToyTokenizer.encode("<|im_start|>system\nplay (turn "))
    assert [s.token_drift for s in steps[1:]] == [header, header]  # the counter's digit
    stream = build(token_rows(steps))
    assert [s.starts_because for s in stream.segments] == [START_FIRST, START_DRIFT, START_DRIFT]
    assert [s.drift_at for s in stream.segments] == [None, header, header]
    # every turn keeps its own ids: each segment is exactly that turn's prompt + completion
    for seg, s in zip(stream.segments, steps):
        assert seg.ids == unpack_ids(s.prompt_ids) + unpack_ids(s.completion_ids)


@pytest.mark.unit
def test_message_cut_trimming_records_drift_where_it_trims():
    steps = run_toy(4, message_cut=1)  # system + the last message: every later turn drops history
    assert steps[0].token_drift is None
    assert all(s.token_drift is not None for s in steps[1:])
    assert not build(token_rows(steps)).single


@pytest.mark.unit
def test_three_turn_episode_one_stream_and_its_mask():
    steps = run_toy(3)
    stream = build(token_rows(steps))
    assert stream.single
    (seg,) = stream.segments
    assert (seg.first_step, seg.last_step, seg.steps) == (1, 3, [1, 2, 3])
    # the stream is the last turn's prompt plus its completion, token for token
    last = steps[-1]
    assert seg.ids == unpack_ids(last.prompt_ids) + unpack_ids(last.completion_ids)
    # mask 1 exactly on the model's tokens: each turn's completion, end-of-turn token included
    ones = [i for i, m in enumerate(seg.mask) if m]
    expect = []
    for s in steps:
        start = len(unpack_ids(s.prompt_ids))
        expect += list(range(start, start + len(unpack_ids(s.completion_ids))))
    assert ones == expect
    assert ToyTokenizer.decode([seg.ids[i] for i in ones]) == "guess 1<|im_end|>guess 2<|im_end|>guess 3<|im_end|>"
    assert all(seg.logprobs[i] == -0.25 for i in ones) and all(seg.logprobs[i] == 0.0 for i in range(len(seg.ids))
                                                               if not seg.mask[i])
    assert len(seg.ids) == len(seg.mask) == len(seg.logprobs)


@pytest.mark.unit
def test_a_step_without_ids_cuts_the_stream():
    rows = token_rows(run_toy(3))
    rows[1] = {"step_id": 2, "token_status": TOKENS_INVALID, "token_drift": None, "prompt_ids": None,
               "completion_ids": None, "completion_logprobs": None}
    stream = build(rows)
    assert stream.steps_without_ids == [2] and not stream.single
    assert [s.starts_because for s in stream.segments] == [START_FIRST, START_AFTER_GAP]


@pytest.mark.unit
def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3, 4]) is None
    assert first_difference([1, 2, 3], [1, 9, 3, 4]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [5]) is None


# --------------------------------------------------------------------------- storage


def token_steps(attempt_id: str = "a1", n: int = 3, job: str = "j1", episode: str = "e1") -> list[StepRecord]:
    steps = run_toy(n)
    for s in steps:
        s.job_id, s.env_id, s.attempt_id, s.group_id = job, episode, attempt_id, "g1"
    return steps


def test_store_keeps_token_rows_and_reads_them_back(store_url):
    from broker.records import AttemptRecord
    from consumer.storage import open_store

    with open_store(store_url) as store:
        first = token_steps("a1", 2)
        store.write_batch(first)
        second = token_steps("a2", 3)
        for s in second:
            s.attempt = 2
        store.write_batch(second + [AttemptRecord(job_id="j1", episode_id="e1", attempt=2, status="completed",
                                                  group_id="g1", group_size=1, env_name="chat", llm_model="m",
                                                  steps=3, attempt_id="a2", started_at=second[0].created_at)])
        rows = store.episode_tokens("e1")
        assert [r["step_id"] for r in rows] == [1, 2, 3] and {r["attempt_id"] for r in rows} == {"a2"}
        assert rows[2]["prompt_ids"] == unpack_ids(second[2].prompt_ids)
        assert rows[2]["completion_logprobs"] == unpack_logprobs(second[2].completion_logprobs)
        assert rows[0]["weight_version"] == "w7" and rows[0]["token_source"] == "vllm"
        # the superseded attempt's token rows stay, keyed by their attempt
        assert store.sql("SELECT COUNT(*) FROM step_tokens WHERE attempt_id = 'a1'")[0][0] == 2
        one = store.episode_tokens("e1", step_id=2)
        assert len(one) == 1 and one[0]["step_id"] == 2
        summary = store.results("j1")["token_ids"]
        assert summary["by_status"] == {"ok": 3} and summary["drift_steps"] == 0
        assert summary["bytes"] == 4 * (summary["prompt_ids"] + summary["completion_ids"]) + 4 * summary[
            "completion_ids"]
        # storing the batch again changes nothing
        store.write_batch(second)
        assert store.sql("SELECT COUNT(*) FROM step_tokens")[0][0] == 5


@pytest.mark.unit
def test_a_store_made_before_step_tokens_is_read_and_upgraded(tmp_path):
    from consumer.storage import open_store

    path = str(tmp_path / "old.sqlite")
    with open_store(path) as store:
        store.execute("DROP TABLE step_tokens")
    with open_store(path, readonly=True) as ro:
        assert not ro.has_step_tokens() and ro.episode_tokens("e1") == [] and ro.token_summary("j1") is None
    with open_store(path) as store:  # a writer adds the table (the additive schema step)
        assert store.has_step_tokens()
        store.write_batch(token_steps())
        assert len(store.episode_tokens("e1")) == 3


@pytest.mark.unit
def test_bytes_per_token_measured(tmp_path, capsys):
    """Stored bytes per token id: 4 per id, 4 per completion logprob, the row's other columns
    on top; measured on a 3-turn full-history episode (ids of every turn's prompt kept)."""
    from consumer.storage import open_store

    with open_store(str(tmp_path / "m.sqlite")) as store:
        store.write_batch(token_steps())
        t = store.results("j1")["token_ids"]
        per_id = t["bytes"] / (t["prompt_ids"] + t["completion_ids"])
        per_completion = t["bytes"] / t["completion_ids"]
    print(f"\n[tokens] {t['prompt_ids']} prompt ids + {t['completion_ids']} completion ids in {t['bytes']} bytes: "
          f"{per_id:.2f} bytes per stored id, {per_completion:.1f} bytes per sampled token (JSON text of the "
          f"same numbers: ~{len(json.dumps(list(range(100000, 100000 + 1000)))) / 1000:.1f} bytes an id)")
    assert 4.0 < per_id < 5.0


# --------------------------------------------------------------------------- settings and task files


@pytest.mark.unit
def test_settings_and_task_file_key(tmp_path):
    from broker.settings import Settings, SettingsError
    from producer.planning import plan_job
    from producer.taskfile import TaskFileError

    assert Settings(tokens="true").tokens == "auto" and Settings(tokens="0").tokens == ""
    with pytest.raises(SettingsError, match="tokens must be one of"):
        Settings(tokens="gpt").validated()

    def task(name, tokens):
        p = tmp_path / name
        p.write_text(f"tokens: {tokens}\nenvironments:\n  - env_name: a\n    base_url: http://e:1\n")
        return str(p)

    assert plan_job([task("a.yaml", "true")], job_id="j").tokens == "auto"
    assert plan_job([task("b.yaml", "llama.cpp")], job_id="j").tokens == "llama.cpp"
    with pytest.raises(TaskFileError, match="'tokens' must be"):
        plan_job([task("c.yaml", "gpt")], job_id="j")
    with pytest.raises(TaskFileError, match="disagree"):
        plan_job([task("d.yaml", "vllm"), task("e.yaml", "openai")], job_id="j")


@pytest.mark.unit
def test_the_flag_takes_a_server_or_stands_alone():
    from interactor.cli import build_parser

    assert build_parser().parse_args(["submit", "t.yaml", "--tokens"]).tokens == "auto"
    assert build_parser().parse_args(["submit", "--tokens=vllm", "t.yaml"]).tokens == "vllm"
    # bare before a task file, it does not take the file for its value
    args = build_parser().parse_args(["run", "--tokens", "t.yaml"])
    assert args.tokens == "auto" and args.tasks == ["t.yaml"]


# --------------------------------------------------------------------------- whole jobs


def guess_tasks(tmp_path, env_url: str, name: str, n: int = 3, max_turns: int = 6, tokens: str | None = None) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text((f"tokens: {tokens}\n" if tokens else "") + textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 1000, max_turns: {max_turns}}}
            env_num: {n}
        """))
    return str(path)


def run_job(settings, procs, redis_client, tasks: list[str], total: int) -> str:
    from consumer.storage import open_store
    from producer.enqueue import submit
    from tests.conftest import wait_for

    job = submit(redis_client, settings, tasks).job.job_id
    procs.settings = settings
    procs.worker("w1")
    procs.consumer()
    store = open_store(settings.results_store)
    try:
        def done():
            res = store.results(job)["job"]
            return res["completed"] + res["failed"] >= total and store.results(job)["job"]["completing"] == 0

        wait_for(done, 90, interval=0.3, what=f"{total} episodes of {job}")
    finally:
        store.close()
    return job


@pytest.mark.integration
@pytest.mark.parametrize("style", ["vllm", "llama.cpp"])
def test_full_history_and_cut_jobs_through_worker_and_consumer(settings, procs, redis_client, env_server,
                                                               model_server, tmp_path, style):
    """Real Redis, worker and consumer processes, the stand-in answering like vLLM or like
    llama-server: full-history episodes give one stream each and no drift; message_cut 1 gives
    drift on every trimmed turn; exports carry the ids per step and the streams per episode."""
    import pyarrow.parquet as pq

    from consumer.export import export_streams, export_training
    from consumer.storage import open_store

    srv, model_url = model_server
    srv.tokens_style = style
    _, env_url = env_server
    s = settings.replace(llm_base_url=model_url + "/v1", message_cut=0, tokens="auto")
    full = run_job(s, procs, redis_client, [guess_tasks(tmp_path, env_url, "full")], 3)
    procs.stop_all()
    cut_settings = s.replace(message_cut=1, tokens="")  # the task file asks this time
    cut = run_job(cut_settings, procs, redis_client,
                  [guess_tasks(tmp_path, env_url, "cut", tokens=style)], 3)
    assert srv.stats()["token_answers"] > 0
    with open_store(s.results_store, readonly=True) as store:
        res_full, res_cut = store.results(full), store.results(cut)
        assert res_full["job"]["completed"] == 3 and res_cut["job"]["completed"] == 3
        t = res_full["token_ids"]
        assert t["by_status"] == {"ok": res_full["job"]["steps"]} and t["drift_steps"] == 0, t
        assert res_cut["token_ids"]["drift_steps"] > 0
        for ep in store.list_episodes(full):
            rows = store.episode_tokens(ep["episode_id"])
            steps = store.episode_trajectory(ep["episode_id"])
            assert len(rows) == len(steps) > 1
            for r, st in zip(rows, steps):
                # the stored completion ids spell the stored answer (the toy tokenizer is exact)
                text = ToyTokenizer.decode(r["completion_ids"])
                assert text.removesuffix("<|im_end|>") == st["response"]
                assert all(math.isfinite(x) and x <= 0 for x in r["completion_logprobs"])
                assert r["weight_version"] == st["weight_version"] == "v1"
            stream = build(rows)
            assert stream.single, [(x.starts_because, x.drift_at) for x in stream.segments]
    out = tmp_path / "steps.parquet"
    export_training(s.results_store, full, out, fmt="parquet", trainable_only=False)
    table = pq.read_table(out).to_pylist()
    assert all(r["token_status"] == "ok" and r["completion_ids"] and r["prompt_ids"] for r in table)
    assert str(pq.read_schema(out).field("completion_logprobs").type) == "list<element: float>"
    streams = tmp_path / "streams.parquet"
    summary = export_streams(s.results_store, full, streams)
    srows = pq.read_table(streams).to_pylist()
    assert summary.rows == len(srows) == 3 and all(r["segments"] == 1 and not r["token_drift"] for r in srows)
    for r in srows:
        assert len(r["token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"]) and 0 < sum(r["loss_mask"])
        assert r["weight_versions"] == ["v1"] * (r["last_step"] - r["first_step"] + 1)
    cut_streams = tmp_path / "cut.jsonl"
    export_streams(s.results_store, cut, cut_streams, fmt="jsonl")
    crow = [json.loads(x) for x in cut_streams.read_text().splitlines()]
    assert any(r["token_drift"] and r["starts_because"] == "token_drift" and r["drift_at"] is not None
               for r in crow)


@pytest.mark.integration
@pytest.mark.parametrize("fault,code", [("length", TOK_LENGTH_MISMATCH), ("below_float32", TOK_BAD_LOGPROB)])
def test_bad_token_answers_keep_the_steps_and_warn_once(settings, procs, redis_client, env_server, model_server,
                                                        tmp_path, fault, code):
    """A spoiled token answer keeps the step and its text; its tokens are invalid. A logprob
    past float32 (-1e39) passed the check and then failed the packing: the episodes were
    dead-lettered as internal_error."""
    from consumer.storage import open_store

    srv, model_url = model_server
    srv.token_fault = fault
    _, env_url = env_server
    s = settings.replace(llm_base_url=model_url + "/v1", message_cut=0, tokens="vllm")
    job = run_job(s, procs, redis_client, [guess_tasks(tmp_path, env_url, "bad")], 3)
    with open_store(s.results_store, readonly=True) as store:
        res = store.results(job)
        assert res["job"]["completed"] == 3, res["job"]
        assert res["token_ids"]["by_status"] == {"invalid": res["job"]["steps"]}
        rows = store.sql("SELECT token_error, prompt_ids, completion_logprobs FROM step_tokens")
        assert rows and all(e.startswith(f"{code}: ") and p is None and lp is None for e, p, lp in rows)
        for ep in store.list_episodes(job):
            assert all(st["response"] for st in store.episode_trajectory(ep["episode_id"]))  # the text is kept
    log = procs.log("w1")
    assert log.count(f"token answers invalid ({code})") == 1, log[-3000:]


# --------------------------------------------------------------------------- the results browser


@pytest.mark.unit
def test_browser_shows_a_steps_tokens_on_demand(tmp_path):
    from broker.records import AttemptRecord
    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import Source

    path = str(tmp_path / "ui.sqlite")
    steps = token_steps(n=3)
    drifted = run_toy(3, rewriting=True)
    for s in drifted:
        s.job_id, s.env_id, s.attempt_id, s.group_id = "j1", "e2", "b1", "g2"
    for s in steps + drifted:
        s.completion_token_texts = [ToyTokenizer.piece(i).decode() for i in unpack_ids(s.completion_ids)]
        s.messages_json = json.dumps([{"role": "user", "content": "<b>hi</b>"}]).encode()
    steps[1].completion_token_texts[0] = "<script>x</script>"  # a token's text is text, never markup
    closes = [AttemptRecord(job_id="j1", episode_id=e, attempt=1, status="completed", group_id=g, group_size=1,
                            env_name="chat", llm_model="m", steps=3, attempt_id=a)
              for e, g, a in (("e1", "g1", "a1"), ("e2", "g2", "b1"))]
    with open_store(path) as store:
        store.write_batch(steps + drifted + closes)
    client = create_app(Source(open_store(path, readonly=True), store_shown=path)).test_client()
    page = client.get("/episodes/e1").get_data(as_text=True)
    assert "one token stream" in page and "/episodes/e1/steps/2/tokens" in page
    resp = client.get("/episodes/e1/steps/2/tokens")
    assert resp.status_code == 200
    html = resp.get_data(as_text=True)
    assert 'id="completion-tokens"' in html and "<script>x</script>" not in html and "&lt;script&gt;" in html
    # ids, their text, the logprob (title) and its shade (a class), the mask
    first = unpack_ids(steps[1].completion_ids)[0]
    assert f"id {first} · logprob -0.2500" in html and "tok m1 p8" in html  # exp(-0.25) = 0.78
    assert "tok m0" in html and "one stream, no drift" in html
    # earlier turns' sampled tokens are shown with their text inside this prompt
    assert '<span class="tt">u</span>' in html
    job_page = client.get("/jobs/j1").get_data(as_text=True)
    assert 'id="token-ids"' in job_page and "token drift in 2 steps of 1 episodes" in job_page
    drift_page = client.get("/episodes/e2").get_data(as_text=True)
    assert "token drift at 2 steps" in drift_page
    dhtml = client.get("/episodes/e2/steps/3/tokens").get_data(as_text=True)
    assert 'id="token-drift"' in dhtml and "is cut here" in dhtml and "tok m0 drift" in dhtml
    assert client.get("/episodes/e1/steps/9/tokens").status_code == 404


class NoIdsPolicy(ToyPolicy):
    """An OpenAI-style server: logprobs and token strings, no ids."""

    def complete(self, messages):
        c = super().complete(messages)
        c.tokens = read_tokens("openai", {"choices": [{"message": {"content": c.content}, "logprobs": {"content": [
            {"token": ch, "logprob": -0.1} for ch in c.content]}}]}, c.content)
        return c


@pytest.mark.unit
def test_a_server_without_ids_warns_once_per_job_not_per_step(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="interactor.tokens")
    job = f"job-noids-{time.monotonic_ns()}"
    for episode in ("e1", "e2"):
        published: list[StepRecord] = []
        cfg = LoopConfig(job_id=job, episode_id=episode, env_name="chat", group_id="g", llm_model="m",
                         message_cut=0)
        run_episode(cfg, env=ChatEnv(3), policy=NoIdsPolicy(), publish=published.append, hook=NullHook())
        assert [s.token_status for s in published] == [TOKENS_NO_IDS] * 3
        assert all(s.prompt_ids is None and s.completion_ids is None and s.token_drift is None for s in published)
        assert unpack_logprobs(published[0].completion_logprobs) == pytest.approx([-0.1] * len("guess 1"))
    warnings = [r for r in caplog.records if job in r.getMessage()]
    assert len(warnings) == 1 and "no token ids" in warnings[0].getMessage()


@pytest.mark.unit
def test_results_line_says_how_many_steps_have_ids_and_where_they_drifted():
    from interactor.report import token_ids_line

    line = token_ids_line({"steps": 10, "by_status": {"ok": 9, "invalid": 1}, "drift_steps": 2, "drift_episodes": 1,
                           "prompt_ids": 900, "completion_ids": 100, "bytes": 4400, "text_bytes": 300})
    assert "10 steps (invalid 1, ok 9)" in line and "4.40 bytes per id" in line
    assert "token drift in 2 steps of 1 episodes" in line
    assert "no token drift" in token_ids_line({"steps": 1, "by_status": {"ok": 1}, "drift_steps": 0,
                                               "drift_episodes": 0, "prompt_ids": 1, "completion_ids": 1,
                                               "bytes": 12, "text_bytes": 0})
