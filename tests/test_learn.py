"""The learning demo's parts that need no model server (examples/learn/): the staleness gate, the
samples a group yields, the loss, and the q/k permutation written back. Skipped, with the
reason, where the learn extra (torch, gguf) is not installed: make test-real-model installs it
and runs them (marked ``learn``), make test does not."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.learn

torch = pytest.importorskip("torch", reason="the learn extra is not installed (make install-learn)")
np = pytest.importorskip("numpy")
pytest.importorskip("gguf", reason="the learn extra is not installed (make install-learn)")

from examples.learn.gguf_weights import permute_qk  # noqa: E402
from examples.learn.grpo import grpo_loss  # noqa: E402
from examples.learn.trainer import admit, agreement, samples_of, staleness  # noqa: E402


def group(gid: str, versions: list, rewards=(1.0, 0.0), advantages=(1.0, -1.0), token_status="ok") -> dict:
    samples = []
    for i, (v, r, a) in enumerate(zip(versions, rewards, advantages)):
        samples.append({"episode_id": f"{gid}-{i}", "reward": r, "advantage": a, "steps": [
            {"step_id": 1, "is_trainable": True, "weight_version": None if v is None else str(v),
             "token_status": token_status, "prompt_ids": [1, 2, 3], "completion_ids": [4, 5],
             "completion_logprobs": [-0.5, -1.0]}]})
    return {"group_id": gid, "samples": samples}


def test_a_groups_age_is_counted_from_its_own_steps_stamps():
    assert staleness(group("g", [3, 5]), 5) == 2  # its oldest step
    assert staleness(group("g", [5, 5]), 5) == 0
    assert staleness(group("g", [None, 5]), 5) is None  # an unstamped step: no age to trust


def test_no_group_older_than_max_staleness_reaches_the_loss():
    fresh, old, unstamped, ahead = group("fresh", [4, 5]), group("old", [2, 5]), group("none", [None, 5]), \
        group("ahead", [6, 6])
    kept, refused = admit([fresh, old, unstamped, ahead], version=5, max_staleness=1)
    assert [g["group_id"] for g in kept] == ["fresh"]
    assert dict(refused) == {"old": 3, "none": None, "ahead": -1}


def test_a_group_yields_the_servers_ids_and_logprobs_and_nothing_without_them():
    samples, unusable = samples_of(group("g", [1, 1]))
    assert unusable == 0 and [s.advantage for s in samples] == [1.0, -1.0]
    assert samples[0].completion_ids == [4, 5] and samples[0].logprobs == [-0.5, -1.0] and samples[0].version == 1
    samples, unusable = samples_of(group("g", [1, 1], token_status="invalid"))
    assert samples == [] and unusable == 2
    g = group("g", [1, 1])
    g["samples"][0]["steps"][0]["response"] = "HalῩ"  # split over byte tokens: ids not to be trusted
    samples, unusable = samples_of(g)
    assert len(samples) == 1 and unusable == 1


def test_the_loss_pushes_up_what_was_better_than_its_group_and_clips_far_ratios():
    new = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    terms = grpo_loss(new, [[-1.0, -2.0], [-0.5]], [1.0, -1.0])
    terms.loss.backward()
    assert terms.ratio_mean == pytest.approx(1.0) and terms.clipped == 0.0
    assert (new[0].grad < 0).all() and (new[1].grad > 0).all()  # descent raises the first, lowers the second
    far = [torch.tensor([0.0], requires_grad=True)]  # ratio e^1 with a positive advantage: clipped, no gradient
    terms = grpo_loss(far, [[-1.0]], [1.0])
    terms.loss.backward()
    assert terms.clipped == 1.0 and far[0].grad.abs().sum() == 0
    with pytest.raises(ValueError):
        grpo_loss([torch.tensor([-1.0])], [[-1.0, -2.0]], [1.0])  # not the same ids


def test_agreement_sees_one_wrong_token():
    same = agreement([torch.tensor([-1.0, -2.0])], [[-1.001, -2.002]])
    assert same.within() and same.tokens == 2
    assert not agreement([torch.tensor([-1.0, -2.0])], [[-1.0, -6.0]]).within()


def test_the_qk_permutation_written_back_is_the_one_transformers_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    for n_head, n_kv, rows in ((9, 9, 576), (9, 3, 192)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        undone = LlamaTensorProcessor()._reverse_permute_weights(permute_qk(w, n_head, n_kv), n_head, n_kv)
        assert np.array_equal(undone, w)
        assert not np.array_equal(permute_qk(w, n_head, n_kv), w)
