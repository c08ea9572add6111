"""What a model or env server answers never stops the pipeline: a property test.

One loopback HTTP server speaks both protocols (docs/protocol.md "Environment server", "Model
endpoint", "Token options") and answers each episode from a script Hypothesis draws: every
field a server returns (versions, usage, logprobs, ids, rewards, flags, info, prompts, the
llama.cpp /apply-template and /tokenize answers) is either well-formed or an arbitrary JSON
value (huge integers, inf/nan written as bare words, non-ASCII digits, very long strings,
deep nesting, lone surrogates). Each example is a fresh job with tokens asked for and a feed,
run through the real worker runtime, a real consumer writing a real SQLite store, and the
real feed service. Properties: nothing raises out of the worker or the consumer; every episode
ends completed (store and ledger) or dead-lettered with a reason (ledger, dead letter, store);
its group reaches the feed once, delivered or reported failed; and whatever the feed answers
is strict JSON with finite rewards and advantages.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from broker import errors, feed
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.records import EpisodeSpec, JobSpec
from broker.states import LEDGER_FINAL, FeedGroupStatus, LedgerState, StoredStatus
from consumer.ingest import Ingestor
from consumer.storage import open_store
from interactor.feed_service import COMPAT_TRAINER, FeedService
from workers.runner import WorkerRuntime

pytestmark = pytest.mark.integration

MISSING = "<absent>"  # a field the server leaves out (a marker string no strategy draws)


# --------------------------------------------------------------------------- arbitrary JSON
class Nested:
    """A list nested ``depth`` deep, written out by the server without recursion (json.dumps
    would hit Python's recursion limit): past orjson's limits on writing (255) and reading
    (1024), and msgpack's (511)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.placeholder = f"@@nested-{depth}-{uuid.uuid4().hex}@@"

    def __repr__(self) -> str:
        return f"Nested({self.depth})"


HUGE_INTS = [2**70, -2**70, 2**64, 2**63, -2**63 - 1, 2**31, -1]
ODD_FLOATS = [math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, -0.0, 3.4e38, -3.5e38]
ODD_TEXTS = ["²", "٣", "①", "v7", "", " ", "\x00", "\ud800", "NaN", "-Infinity", "1e999", "<|im_end|>",
             "9" * 5000, "x" * 200_000, "é" * 1000]
ODD_VALUES = [MISSING, None, True, False, 0, {}, [], *HUGE_INTS, *ODD_FLOATS, *ODD_TEXTS]
NESTS = [Nested(d) for d in (50, 300, 600, 1100)]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
# A third each: the odd values most likely to break something, deep nests, anything.
json_values = st.one_of(
    st.sampled_from(ODD_VALUES),
    st.sampled_from(NESTS),
    st.recursive(scalars | st.sampled_from(ODD_VALUES),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                 max_leaves=8),
)


def maybe(good: st.SearchStrategy, rate: int) -> st.SearchStrategy:
    """``good`` or, ``rate`` times in a hundred, an arbitrary JSON value (or the field left out).
    Shrinks towards the well-formed value."""
    return st.integers(0, 99).flatmap(lambda k: json_values if k >= 100 - rate else good)


# --------------------------------------------------------------------------- scripts
def spelled(content: str) -> list[str]:
    """The answer's tokens: one per character, as a toy tokenizer would."""
    return list(content) if content else []


@st.composite
def turn(draw, rate: int) -> dict:
    """One turn's answers: the env's prompt and step, the model's chat answer, and llama.cpp's
    prompt template and tokenization. A whole object is replaced less often than a field, or
    few episodes would get far enough to use the fields."""
    m = lambda good: draw(maybe(good, rate))  # noqa: E731
    whole = lambda good: draw(maybe(good, rate // 4))  # noqa: E731
    content = draw(st.sampled_from(["guess 5", "Hello!", "ok", "", " é²"]))
    shape = draw(st.sampled_from(["vllm", "llama.cpp", "openai"]))
    tokens = spelled(content)
    n_prompt = 5
    entries = []
    for tok in tokens:
        entry = {"token": m(st.just(tok)), "logprob": m(st.sampled_from([-0.1, 0.0, -3.4e38, -12])),
                 "bytes": m(st.just(list(tok.encode()))), "top_logprobs": []}
        if shape == "llama.cpp":
            entry["id"] = m(st.integers(0, 2**31 - 1))
        entries.append(entry)
    choice: dict = {"index": 0,
                    "message": whole(st.just({"role": "assistant", "content": m(st.just(content) | st.none())})),
                    "logprobs": whole(st.just({"content": m(st.just(entries))})),
                    "finish_reason": m(st.sampled_from(["stop", None, "stop", "length"]))}
    chat: dict = {"id": m(st.just("chatcmpl-1")), "object": "chat.completion", "choices": whole(st.just([choice])),
                  "usage": whole(st.just({"prompt_tokens": m(st.just(n_prompt)),
                                          "completion_tokens": m(st.just(len(tokens)))})),
                  "metadata": whole(st.just({"weight_version": m(st.integers(0, 9) | st.sampled_from(["3", "v4"]))}))}
    if shape == "vllm":
        choice["token_ids"] = m(st.just([ord(c) for c in content]))
        chat["prompt_token_ids"] = m(st.just(list(range(n_prompt))))
    message = {"role": m(st.sampled_from(["user", "system"])),
               "content": m(st.just("Guess a number.") | st.just([{"type": "text", "text": "Guess."}]))}
    # an empty prompt (the episode is over) is well-formed too, but rarer
    prompt = whole(st.integers(0, 9).map(lambda k: [] if k == 4 else [{"role": "system", "content": "Play."}, message]))
    step = whole(st.just({"observation": m(st.just({})),
                          "reward": m(st.sampled_from([0, 1, -1, 0.5, None, 1e308, 1.7e308, -1.7e308])),
                          "terminated": m(st.sampled_from([True, False, 0, 1, "true", "false", None])),
                          "truncated": m(st.sampled_from([False, True, None])),
                          "info": m(st.just({}) | st.just({"turn": 1}))}))
    return {"prompt": prompt, "chat": chat, "step": step,
            "template": whole(st.just({"prompt": m(st.just("<|user|>Guess a number.<|assistant|>"))})),
            "tokenize": whole(st.just({"tokens": m(st.just(list(range(n_prompt))))}))}


@st.composite
def scripts(draw) -> dict:
    """One job: a group of 1 or 2 episodes of 1 or 2 turns each, answered as drawn."""
    rate = draw(st.sampled_from([0, 10, 20, 35]))  # percent of fields that are hostile
    max_steps = draw(st.integers(1, 2))
    reset = lambda: draw(maybe(st.just({"observation": draw(maybe(st.just({}), rate)),  # noqa: E731
                                        "info": draw(maybe(st.just({}), rate))}), rate // 4))
    members = [{"reset": reset(), "turns": [draw(turn(rate)) for _ in range(max_steps)]}
               for _ in range(draw(st.integers(1, 2)))]
    return {"members": members, "max_steps": max_steps, "max_attempts": draw(st.integers(1, 2)),
            "ensure_ascii": draw(st.booleans())}


def without_missing(value: Any, deep: dict[str, int]) -> Any:
    """The answer as sent: fields drawn as absent left out, deep nests as placeholders
    (``deep``: placeholder -> depth)."""
    if isinstance(value, Nested):
        deep[value.placeholder] = value.depth
        return value.placeholder
    if isinstance(value, dict):
        return {k: without_missing(v, deep) for k, v in value.items() if not (isinstance(v, str) and v == MISSING)}
    if isinstance(value, list):
        return [without_missing(v, deep) for v in value]
    return value


def to_json(value: Any, ascii_only: bool) -> bytes:
    """What a hostile server sends: NaN and Infinity as bare words (allow_nan), and without
    ensure_ascii a lone surrogate as the invalid UTF-8 it encodes to."""
    deep: dict[str, int] = {}
    text = json.dumps(without_missing(value, deep), allow_nan=True, ensure_ascii=ascii_only)
    for placeholder, depth in deep.items():
        text = text.replace(f'"{placeholder}"', "[" * depth + "1" + "]" * depth)
    return text.encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------- the server
class ScriptedServers:
    """Both servers' state: each episode's script, and which turn each instance is at."""

    def __init__(self):
        self.scripts: dict[str, dict] = {}
        self.steps_done: dict[str, int] = {}  # env instance id -> step calls answered
        self.turn: dict[str, int] = {}  # episode id -> the turn its model calls are answered from
        self.lock = threading.Lock()
        self.faults: list[str] = []  # the scripted server's own failures: the test's bug, not ours

    def answer(self, method: str, path: str) -> Any:
        parts = [p for p in path.split("?")[0].split("/") if p]
        if parts == ["envs"] or parts == ["v1", "models"]:  # readiness probes
            return []
        if parts[:1] == ["v1"] and len(parts) >= 3:  # /v1/<episode>/<route> (session routing)
            episode, route = parts[1], "/".join(parts[2:])
            if route == "models":
                return {"data": []}
            script = self.scripts[episode]
            with self.lock:
                t = script["turns"][min(self.turn.get(episode, 0), len(script["turns"]) - 1)]
            return {"chat/completions": t["chat"], "apply-template": t["template"], "tokenize": t["tokenize"]}[route]
        env_id = parts[1]
        episode = env_id.split("~", 1)[0]
        script = self.scripts[episode]
        call = parts[2] if len(parts) > 2 else ""
        with self.lock:
            if method == "DELETE" or call == "close":
                return {"status": "ok"}
            if call == "reset":
                self.steps_done[env_id] = 0
                return script["reset"]
            k = min(self.steps_done.get(env_id, 0), len(script["turns"]) - 1)
            if call == "get_task_prompt":
                self.turn[episode] = k
                return script["turns"][k]["prompt"]
            self.steps_done[env_id] = self.steps_done.get(env_id, 0) + 1
            return script["turns"][k]["step"]

    def body(self, method: str, path: str) -> bytes:
        episode = next((s for s in self.scripts if s in path), None)
        return to_json(self.answer(method, path), self.scripts[episode]["ensure_ascii"] if episode else True)


def make_handler(servers: ScriptedServers):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _serve(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            try:
                data, status = servers.body(self.command, self.path), 200
            except KeyError:
                data, status = b'{"error": "unknown"}', 404
            except Exception as exc:  # noqa: BLE001 - said by the test, not a dropped connection
                servers.faults.append(f"{self.command} {self.path}: {type(exc).__name__}: {exc}")
                data, status = b'{"error": "scripted server fault"}', 418
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

    return Handler


@pytest.fixture(scope="module")
def scripted():
    servers = ScriptedServers()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(servers))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield servers, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def pipeline(settings, redis_client):
    """One worker runtime, one consumer and one store for all the examples of a test: a fleet
    living through job after job of hostile answers."""
    runtime = WorkerRuntime(settings, name="prop-worker")
    store = open_store(settings.db_path)
    ingestor = Ingestor(redis_client, settings, store, name="prop-consumer")
    yield runtime, ingestor, store
    runtime.stop()
    store.close()


# --------------------------------------------------------------------------- one example
def create_job(client, settings, servers: ScriptedServers, base_url: str, script: dict) -> tuple[JobSpec, list]:
    job_id = f"prop-{uuid.uuid4().hex[:10]}"
    gid = f"{job_id}.1.1.1"
    n = len(script["members"])
    job = JobSpec(job_id=job_id, llm_base_url=f"{base_url}/v1", model="m", max_attempts=script["max_attempts"],
                  max_steps=script["max_steps"], episode_budget_s=30, session_routing=True, tokens="auto",
                  episodes=n, groups=1)
    eps = [EpisodeSpec(job_id=job_id, episode_id=f"{gid}.{k}", group_id=gid, group_size=n, env_name="scripted",
                       base_url=base_url, env_params={}, seed=k, queue=settings.queue) for k in range(1, n + 1)]
    for ep, member in zip(eps, script["members"]):
        servers.scripts[ep.episode_id] = member | {"ensure_ascii": script["ensure_ascii"]}
    keys = Keys(settings.key_prefix)
    Ledger(client, keys).create_job(job, eps)
    feed.enable(client, keys, job_id, feed.FeedConfig(max_ahead=4, ack_timeout_s=60.0))
    return job, eps


def run_to_the_end(runtime, ingestor, store, ledger, job: JobSpec, eps: list, timeout: float = 90.0) -> None:
    """Run every episode (again, when the ledger re-queues it) and poll the consumer until the
    ledger and the store both say each one ended. Nothing may raise on the way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ep in eps:
            if ledger.state(job.job_id, ep.episode_id) == LedgerState.QUEUED:
                runtime.run(job.job_id, ep.episode_id)  # an exception escaping is a bug
        ingestor.poll_once(block_ms=50)  # likewise
        stored = [(store.episode(ep.episode_id) or {}).get("status") for ep in eps]
        states = [ledger.state(job.job_id, ep.episode_id) for ep in eps]
        if all(s in (StoredStatus.COMPLETED, StoredStatus.FAILED) for s in stored) \
                and all(s in LEDGER_FINAL for s in states) and not ingestor.pending():
            return
        if any(s == LedgerState.RETRYING for s in states):
            time.sleep(0.1)  # the runtime's sweeper re-queues it once its back-off is over
    raise AssertionError(f"episodes of {job.job_id} did not end: ledger {states}, store {stored}")


def check_episode_ends(client, settings, store, ledger, job: JobSpec, eps: list) -> dict[str, str]:
    """Each episode completed (store and ledger) or dead-lettered with a reason (ledger, dead
    letter, store), never failed by an exception of ours; the stored totals and the group's
    statistics are finite. Returns episode -> stored status."""
    letters = {d.episode_id: d for d in DeadLetterQueue(client, settings).list(job_id=job.job_id)}
    out = {}
    for ep in eps:
        row = store.episode(ep.episode_id)
        state = ledger.state(job.job_id, ep.episode_id)
        if row["status"] == StoredStatus.COMPLETED:
            assert state == LedgerState.DONE and ep.episode_id not in letters, (row, state)
        else:
            assert row["status"] == StoredStatus.FAILED and state == LedgerState.FAILED, (row, state)
            letter = letters.get(ep.episode_id)
            assert letter is not None, f"{ep.episode_id} failed without a dead letter: {row}"
            assert letter.reason and letter.error, letter
            assert letter.reason != errors.INTERNAL_ERROR, f"{letter.error}\n{letter.traceback}"
        out[ep.episode_id] = row["status"]
        assert row["total_reward"] is None or finite(row["total_reward"]), row
    group = store.group(eps[0].group_id)
    assert all(group[k] is None or finite(group[k]) for k in ("reward_mean", "reward_std")), group
    return out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_feed(client, settings, store, job: JobSpec, eps: list, stored: dict[str, str], route: str) -> None:
    """The group reaches the feed once: delivered (every member completed) or reported failed,
    and every answer is strict JSON with finite rewards and advantages."""
    gid = eps[0].group_id
    svc = FeedService(client, settings, job.job_id, store)
    if route == "take":
        got = svc.take("prop-trainer", 2, 0.5)
        json.dumps(got, allow_nan=False)
        delivered = [g["group_id"] for g in got]
        for g in got:
            assert g["status"] == FeedGroupStatus.READY and all(finite(r) for r in g["rewards"]), g["rewards"]
            for s in g["samples"]:
                assert finite(s["reward"]) and finite(s["advantage"]), s
        if delivered:
            svc.ack("prop-trainer", delivered)
    else:
        answer, delivered = svc.rollout_data(2, 0.5)
        json.dumps(answer, allow_nan=False)  # meta_info's avg_reward too (inf once, of 1e308 twice)
        assert all(finite(item["reward"]) for item in answer["data"]["data"])
        if delivered:
            svc.ack(COMPAT_TRAINER, delivered)
    stats = svc.stats()
    json.dumps(stats, allow_nan=False)
    failed = [f["group_id"] for f in stats["recent_failures"]]
    assert stats["announced"] == 1, stats
    assert sorted(delivered + failed) == [gid], (delivered, stats)
    if delivered:
        assert set(stored.values()) == {StoredStatus.COMPLETED}
    assert svc.take("prop-trainer", 1, 0) == []  # nothing comes twice


# --------------------------------------------------------------------------- regressions
def good_turn(content: str = "ok", reward: Any = 1.0, terminated: Any = True, weight_version: Any = 3) -> dict:
    """A turn whose every answer is well-formed (vLLM's shape), to change one field of."""
    entries = [{"token": c, "logprob": -0.1, "bytes": list(c.encode()), "top_logprobs": []} for c in content]
    chat = {"id": "chatcmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": {"content": entries}, "finish_reason": "stop",
                         "token_ids": [ord(c) for c in content]}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(content)},
            "metadata": {"weight_version": weight_version}, "prompt_token_ids": list(range(5))}
    return {"prompt": [{"role": "system", "content": "Play."}, {"role": "user", "content": "Guess."}], "chat": chat,
            "step": {"observation": {}, "reward": reward, "terminated": terminated, "truncated": False, "info": {}},
            "template": {"prompt": "<|user|>Guess.<|assistant|>"}, "tokenize": {"tokens": list(range(5))}}


def job_of(*members: list[dict]) -> dict:
    """A script whose members play the given turns, each a member's list."""
    return {"members": [{"reset": {"observation": {}, "info": {}}, "turns": turns} for turns in members],
            "max_steps": max(len(t) for t in members), "max_attempts": 1, "ensure_ascii": True}


# What the property found, each failing before its fix (the commit that fixed it says which).
REGRESSIONS = {
    # A weight version nested deeper than orjson writes (255) raised out of the answer's parsing:
    # the episode was dead-lettered as internal_error. Now the step is stored unversioned.
    "version_nested_too_deep": (job_of([good_turn(weight_version=Nested(300))]), "take"),
    # Two finite rewards summing past the largest float: an infinite total reward reached the
    # group's rewards and advantages, and the feed's answer was no JSON. Now env_malformed.
    "two_steps_of_huge_rewards": (job_of([good_turn(reward=1e308, terminated=False), good_turn(reward=1e308)]),
                                  "take"),
    # Two members whose rewards' deviations square past the largest float: the store refused the
    # closing record (OverflowError in the group's statistics) and parked it; the episode stayed
    # running in the store for good, its group never announced.
    "group_spread_past_the_largest_float": (job_of([good_turn(reward=1e308)], [good_turn(reward=0)]), "take"),
    "group_std_past_the_largest_float": (job_of([good_turn(reward=1.7e308)], [good_turn(reward=-1.7e308)]),
                                         "rollout_data"),
    # ... or whose rewards sum past it: the group's stored mean and std were inf.
    "group_mean_past_the_largest_float": (job_of([good_turn(reward=1e308)], [good_turn(reward=1e308)]), "take"),
}


def with_regressions(test):
    for script, route in REGRESSIONS.values():
        test = example(script=script, route=route)(test)
    return test


def test_group_statistics_of_rewards_near_the_float_limit_are_finite():
    """Group statistics of any finite rewards are finite, and the usual ones are as they were."""
    from consumer.storage.group_stats import group_stats, reward_mean_std

    assert reward_mean_std([0.3, 0.7]) == (0.5, math.sqrt(((0.3 - 0.5) ** 2 + (0.7 - 0.5) ** 2) / 2))
    for rewards in ([1e308, 1e308], [1.7e308, -1.7e308], [1e308, 0.0], [1.7e308, -1.7e308, -1.7e308],
                    [1.7976931348623157e308] * 3):
        mean, std, adv, _ = group_stats(rewards)
        assert all(map(math.isfinite, [mean, std, *adv])), (rewards, mean, std, adv)
        assert min(rewards) <= mean <= max(rewards)
    assert group_stats([1.7e308, -1.7e308])[2] == pytest.approx([1.0, -1.0])
    assert group_stats([1.7e308, -1.7e308, -1.7e308])[2] == pytest.approx([2**0.5, -(2**-0.5), -(2**-0.5)])


# --------------------------------------------------------------------------- the property
@hsettings(max_examples=60, deadline=None, derandomize=True, database=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                  HealthCheck.data_too_large])
@given(script=scripts(), route=st.sampled_from(["take", "rollout_data"]))
@with_regressions
def test_no_answer_stops_the_pipeline(script, route, scripted, pipeline, settings, redis_client):
    servers, base_url = scripted
    runtime, ingestor, store = pipeline
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = create_job(redis_client, settings, servers, base_url, script)
    run_to_the_end(runtime, ingestor, store, ledger, job, eps)
    assert not servers.faults, servers.faults
    stored = check_episode_ends(redis_client, settings, store, ledger, job, eps)
    check_feed(redis_client, settings, store, job, eps, stored, route)
