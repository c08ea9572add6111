"""The GRPO loss on what the server sampled: its token ids, its logprobs as the behaviour policy.

    ratio_t = exp(logp_trainer(t) - logp_server(t))
    loss    = - mean over every completion token of min(ratio_t * A, clip(ratio_t, 1-eps_low, 1+eps_high) * A)

with A the sample's group-normalised advantage as the feed hands it ((r - mean) / std within its
group). Token-level mean over the batch (as DAPO), no KL term and no reference model (as DAPO
and Dr. GRPO: at a few dozen updates the clip is what keeps a step small, and a reference model
would double the forward passes on two cores).

Why not TRL's GRPOTrainer: it owns the loop. It generates its own completions (or asks its own
vLLM server), re-tokenizes prompts with its tokenizer and computes the old logprobs itself; our
loop pulls groups someone else sampled, with the sampler's ids and logprobs, whenever they are
complete. What is left to borrow is the dozen lines below, written out so that each term can
be read against the server's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor
    tokens: int
    clipped: float  # share of tokens whose ratio was clipped (the clip chose the term)
    ratio_mean: float
    ratio_max: float


def grpo_loss(new_logprobs: list[torch.Tensor], behaviour_logprobs: list[list[float]],
              advantages: list[float], eps_low: float = 0.2, eps_high: float = 0.28) -> LossTerms:
    """``new_logprobs``: the trainer's, with grad, one tensor per sample; ``behaviour_logprobs``:
    the server's for the same ids; ``advantages``: one per sample."""
    if not (len(new_logprobs) == len(behaviour_logprobs) == len(advantages)) or not new_logprobs:
        raise ValueError("one logprob tensor, one list of server logprobs and one advantage per sample")
    new = torch.cat(new_logprobs)
    old = torch.tensor([x for lp in behaviour_logprobs for x in lp], dtype=new.dtype)
    if new.shape != old.shape:
        raise ValueError(f"{new.numel()} trainer logprobs for {old.numel()} server logprobs: not the same ids")
    adv = torch.cat([torch.full((len(lp),), float(a), dtype=new.dtype)
                     for lp, a in zip(behaviour_logprobs, advantages)])
    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).float().mean().item()
    return LossTerms(per_token.mean(), int(new.numel()), was_clipped, ratio.detach().mean().item(),
                     ratio.detach().max().item())
