"""The learning loop's honest checks against the real thing: llama-server serving SmolLM2-135M,
``interactor feed serve`` running the antonym task with token ids and logprobs, the trainer of
examples/learn/ holding the same weights in PyTorch. Each check is also shown failing when its
premise is broken on purpose (a wrong id, stale weights).

(a) before any update, the trainer's logprobs of the tokens the server sampled (as the feed
    hands them over) match the server's within the stated tolerance; one wrong id breaks it;
(b) after one update and the sync, the server's logprobs of a fixed sequence match the trainer's
    new ones and differ from the old ones; a server on the old file fails the check;
(c) steps of episodes started after a version was published carry it (or a later one), and
    their logprobs are the new weights';
(d) with the trainer's version moved past what is in flight, no group older than
    ``--max-staleness`` is delivered, nor admitted to the loss.

Skipped, with the reason, without llama-server and the model (make test-real-model installs
them) or without the learn extra (torch, transformers, gguf, accelerate: make test-real-model
installs it too).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.integration]

LEARN_HINT = "the learn extra is not installed (make test-real-model installs it: torch, transformers, gguf, accelerate)"
for _mod in ("torch", "transformers", "gguf", "accelerate"):
    pytest.importorskip(_mod, reason=LEARN_HINT)

from consumer.storage import open_store  # noqa: E402
from examples.learn.llama import INSTALL_HINT, LlamaServer, server_binary, smollm2_gguf  # noqa: E402
from examples.learn.task_files import SAMPLING  # noqa: E402
from examples.learn.trainer import (  # noqa: E402
    TOLERANCE,
    CheckFailed,
    Learner,
    admit,
    agreement,
    samples_of,
    staleness,
)
from interactor.children import spawn, terminate  # noqa: E402
from interactor.feed_client import Feed  # noqa: E402

MAX_STALENESS = 1
WORDS = ["hot", "up", "north", "summer", "buy", "win"]  # of the train split: answered right some of the time


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    binary, model = server_binary(), smollm2_gguf()
    if not binary:
        pytest.skip(f"llama-server is not installed; {INSTALL_HINT}")
    if not model:
        pytest.skip(f"the SmolLM2-135M-Instruct GGUF file is not installed; {INSTALL_HINT}")
    from examples.learn.policy import Policy

    folder = tmp_path_factory.mktemp("learn")
    t0 = time.monotonic()
    policy = Policy(model, threads=2)
    server = LlamaServer(binary, folder / "llama-server.log", parallel=4)
    # lr 1e-4: one step must move the fixed sequence's logprobs well past the tolerance
    learner = Learner(policy, server, None, folder / "weights", lr=1e-4, max_staleness=MAX_STALENESS, keep_files=5,
                      say=lambda line: print("\n[learn]", line))
    learner.start_check = learner.start("f32")
    print(f"\n[learn] trainer and server ready in {time.monotonic() - t0:.0f}s")
    yield learner
    server.stop()


@pytest.fixture(scope="module")
def feed(learner, tmp_path_factory):
    from examples.envserver import start_in_thread

    env, env_url = start_in_thread()
    folder = tmp_path_factory.mktemp("feed")
    rows = "\n".join(f"      - {{word: {w}}}" for w in WORDS)
    tasks = folder / "train.yaml"
    tasks.write_text(f"tokens: true\nenvironments:\n  - env_name: antonym\n    base_url: {env_url}\n    env_num: 4\n"
                     f"    dataset:\n{rows}\n")
    log = folder / "feed-serve.log"
    proc = spawn([sys.executable, "-m", "interactor.cli", "feed", "serve", str(tasks), "--llm-base-url",
                  learner.server.url + "/v1", "--model", "smollm2", *SAMPLING, "--run-dir", str(folder / "run"),
                  "--port", "0", "--max-ahead", "4", "--max-staleness", str(MAX_STALENESS), "--workers", "1",
                  "--concurrency", "4", "--seed", "1"], log_path=log, with_parent=False,
                 env={**os.environ, "INTERACTOR_LLM_BACKOFF_INITIAL_S": "0.2", "INTERACTOR_LLM_BACKOFF_MAX_S": "1"})
    url = None
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        for line in (log.read_text(errors="replace") if log.exists() else "").splitlines():
            if line.startswith("feed of job ") and " at http" in line:
                url = line.rsplit(" at ", 1)[1].strip()
        if proc.poll() is not None:
            raise AssertionError(f"feed serve exited:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    assert url, f"feed serve did not start:\n{log.read_text(errors='replace')[-3000:]}"
    f = Feed(url, trainer="test-learn")
    f.set_version(learner.version)
    learner.feed = f
    f.run_dir = folder / "run"
    yield f
    terminate([proc], 60)
    env.shutdown()


def take_groups(feed: Feed, n: int, want_signal: bool = False, timeout_s: float = 300) -> list[dict]:
    """``n`` groups (with ``want_signal``: at least one whose rewards differ, so that a step moves).

    Groups without signal beyond the first ``n - 1`` are acknowledged and let go: a taken group
    counts against the feed's max_ahead until it is acknowledged, so holding every uniform group
    while waiting for one with signal stops production once max_ahead of them are held (the feed
    then waits out the ack timeout, longer than this wait)."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out += feed.take(n, timeout=min(120, max(1, deadline - time.monotonic())))
        if want_signal:
            signal = [g for g in out if len(set(g["rewards"])) > 1]
            uniform = [g for g in out if g not in signal]
            if uniform[n - 1:]:
                feed.ack([g["group_id"] for g in uniform[n - 1:]])
            out = signal + uniform[:n - 1]
            if signal and len(out) >= n:
                return out
        elif len(out) >= n:
            return out
    raise AssertionError(f"{len(out)} groups within {timeout_s}s: {feed.stats()}")


def test_a_before_any_update_trainer_and_server_logprobs_agree(learner, feed):
    assert learner.version == 0
    groups = take_groups(feed, 2)
    samples = [s for g in groups for s in samples_of(g)[0] if s.version == 0]
    assert len(samples) >= 4, [samples_of(g) for g in groups]
    ours = learner.policy.token_logprobs([(s.prompt_ids, s.completion_ids) for s in samples])
    a = agreement(ours, [s.logprobs for s in samples])
    print(f"\n[learn] (a) {len(samples)} samples, {a.tokens} sampled tokens: |trainer - server| mean {a.mean:.5f}, "
          f"max {a.max:.5f} (tolerance {TOLERANCE.mean} / {TOLERANCE.max}); version 0 on the fixed sequence: "
          f"{learner.start_check}")
    assert a.within(), a
    # one wrong id: the token after the first of one completion (the trainer scores another sequence)
    bad = [dataclasses.replace(s) for s in samples]
    bad[0] = dataclasses.replace(bad[0], completion_ids=[(bad[0].completion_ids[0] + 1) % 49152,
                                                         *bad[0].completion_ids[1:]])
    wrong = agreement(learner.policy.token_logprobs([(s.prompt_ids, s.completion_ids) for s in bad]),
                      [s.logprobs for s in bad])
    print(f"[learn] (a) one wrong id: mean {wrong.mean:.4f}, max {wrong.max:.4f}")
    assert not wrong.within()
    feed.ack([g["group_id"] for g in groups])


def test_b_after_one_update_and_sync_the_server_has_the_new_weights(learner, feed):
    prompt, completion = learner.probe
    old = learner.policy.token_logprobs([(prompt, completion)])[0]
    old_file = learner.files[-1]
    rec = learner.update(take_groups(feed, 2, want_signal=True))
    assert rec.version == 1 and rec.trained_samples > 0, rec
    new = learner.policy.token_logprobs([(prompt, completion)])[0]
    server = learner.server.score(prompt, completion)
    matched = agreement([new], [server])
    moved = agreement([old], [server])
    print(f"\n[learn] (b) update {rec.train_s:.1f}s, write {rec.write_s:.1f}s, reload {rec.load_s:.1f}s; fixed sequence "
          f"({matched.tokens} tokens): server vs trainer new mean {matched.mean:.5f} max {matched.max:.5f}; vs old "
          f"mean {moved.mean:.4f} max {moved.max:.4f}")
    assert matched.within()
    assert not moved.within(), "the step did not move the fixed sequence past the tolerance: the check would be vacuous"
    # stale weights: a server left on the previous file fails the same check. A second server:
    # the feed's workers keep sampling from the first, already stamping the new version, and
    # reloading the old file there handed them old weights under the new stamp (test (c)'s
    # on-policy check then failed on those samples)
    stale = LlamaServer(learner.server.binary, learner.workdir / "stale-server.log", parallel=1)
    serving = learner.server
    try:
        stale.load(old_file)
        learner.server = stale
        with pytest.raises(CheckFailed):
            learner.check_sync()
    finally:
        learner.server = serving
        stale.stop()
    learner.check_sync()


def test_c_steps_sampled_after_a_version_was_published_carry_it(learner, feed):
    rec = learner.update(take_groups(feed, 2, want_signal=True))
    published_at = time.time()  # update published rec.version before it returned
    version = rec.version
    after: list[dict] = []  # episodes whose attempt started after the publication
    with open_store(str(feed.run_dir / "results.sqlite"), readonly=True) as store:
        deadline = time.monotonic() + 300
        while len(after) < 4 and time.monotonic() < deadline:
            groups = feed.take(2, timeout=120)
            for g in groups:
                for s in g["samples"]:
                    started = min(a["started_at"] for a in store.attempts(s["episode_id"]))
                    if started > published_at:
                        after.append(s)
            feed.ack([g["group_id"] for g in groups])
    assert len(after) >= 4, "no episode started after the publication within 300s"
    stamps = [st["weight_version"] for s in after for st in s["steps"]]
    print(f"\n[learn] (c) {len(after)} episodes started after version {version} was published: stamps {sorted(set(stamps))}")
    assert all(int(v) >= version for v in stamps), stamps
    # and they were sampled by those weights: their logprobs are the trainer's at this version
    group = {"group_id": "after", "samples": after}
    samples = [s for s in samples_of(group)[0] if s.version == version]
    a = agreement(learner.policy.token_logprobs([(s.prompt_ids, s.completion_ids) for s in samples]),
                  [s.logprobs for s in samples])
    print(f"[learn] (c) their {a.tokens} tokens against the trainer's version {version}: mean {a.mean:.5f}, max {a.max:.5f}")
    assert a.within()


def test_d_no_group_older_than_max_staleness_reaches_the_loss(learner, feed):
    before = feed.stats()
    # the trainer's version jumps 3 ahead of everything in flight (the weights stay: only age is tested)
    learner.version += 3
    feed.set_version(learner.version)
    groups = take_groups(feed, 2)
    ages = [staleness(g, learner.version) for g in groups]
    after = feed.stats()
    print(f"\n[learn] (d) version {learner.version}: delivered groups {ages} versions behind; re-queued as stale "
          f"{after['stale_requeued'] - before['stale_requeued']}, dropped {after['stale_dropped'] - before['stale_dropped']}")
    assert all(a is not None and a <= MAX_STALENESS for a in ages), ages
    assert after["stale_requeued"] + after["stale_dropped"] > before["stale_requeued"] + before["stale_dropped"], \
        "nothing was in flight to go stale: the check would be vacuous"
    kept, refused = admit(groups, learner.version, MAX_STALENESS)
    assert refused == [] and len(kept) == len(groups)
    # the trainer's own gate, as for a feed without the bound: the same groups, the trainer two
    # versions further, are refused by update and never reach the loss (nothing trained, no new version)
    learner.version += MAX_STALENESS + 1
    rec = learner.update(groups)
    assert rec.trained_samples == 0 and rec.loss is None and rec.version == learner.version
    assert sorted(gid for gid, _ in rec.refused) == sorted(g["group_id"] for g in groups), rec.refused
