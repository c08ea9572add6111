"""The policy in PyTorch: the GGUF file llama-server serves, loaded by transformers (dequantized
to fp32), and the logprobs of token ids it is given, never of text it tokenizes itself.

Trained: every transformer block and the final norm. Not trained: the token embedding, which is
also the output head (tied) and the largest tensor (49152 x 576): left as it is, its Q8_0 bytes
are never rewritten, and AdamW keeps state for 106 M parameters instead of 134 M.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch

from examples.learn.gguf_weights import GGUFWeights

# How the trained tensors are written: in their own type, or as F32 / F16 (gguf_weights.py).
AS_TYPES = {"keep": None, "f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16}


class Policy:
    def __init__(self, gguf_path: str | os.PathLike, threads: int | None = None):
        from transformers import AutoModelForCausalLM  # the learn extra

        if threads:
            torch.set_num_threads(threads)
        path = Path(gguf_path)
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32)
        self.model.eval()  # no dropout: the logprobs are the served model's
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.model.get_input_embeddings().weight.requires_grad_(False)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.gguf = GGUFWeights(path, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        # the keys and values of earlier ids: `cache` since transformers 5, `past_key_values` before
        params = inspect.signature(self.model.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def parameters(self):
        return list(self.trainable.values())

    def token_logprobs(self, seqs: list[tuple[list[int], list[int]]], grad: bool = False) -> list[torch.Tensor]:
        """For each (prompt ids, completion ids): the logprob of each completion id given all the
        ids before it.

        The ids every prompt starts with (the chat template, the system prompt, the question up
        to its word: most of each prompt here) run once, and the rest of each sequence runs on
        their keys and values, right-padded in one batch; gradients flow back through the shared
        part as through a sum. The output head runs only where a completion id is predicted (the
        vocabulary is 49152 wide: on every position it would cost more than the blocks)."""
        for p, c in seqs:
            if not p or not c:
                raise ValueError("a sequence needs prompt ids and completion ids")
        common = _common_prefix([p for p, _ in seqs])
        common = min(common, min(len(p) for p, _ in seqs) - 1)  # each keeps the id that predicts its first
        with torch.set_grad_enabled(grad):
            cache = None
            if len(seqs) > 1 and common >= 4:
                out = self.model.model(input_ids=torch.tensor([seqs[0][0][:common]]), use_cache=True)
                cache = getattr(out, self._cache_kw)
                for layer in cache.layers:
                    layer.keys = layer.keys.expand(len(seqs), -1, -1, -1)
                    layer.values = layer.values.expand(len(seqs), -1, -1, -1)
            else:
                common = 0
            rest = [list(p[common:]) + list(c) for p, c in seqs]
            width = max(len(r) for r in rest)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), common + width), dtype=torch.long)
            mask[:, :common] = 1
            rows, cols, targets = [], [], []
            for i, ((p, c), r) in enumerate(zip(seqs, rest)):
                ids[i, :len(r)] = torch.tensor(r)
                mask[i, common:common + len(r)] = 1
                rows += [i] * len(c)
                cols += range(len(p) - 1 - common, len(p) + len(c) - 1 - common)
                targets += list(c)
            positions = torch.arange(common, common + width)[None].expand(len(seqs), -1)
            hidden = self.model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                      use_cache=cache is not None, **{self._cache_kw: cache}).last_hidden_state
            picked = hidden[torch.tensor(rows), torch.tensor(cols)]
            logits = self.model.lm_head(picked).float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets)[:, None])[:, 0]
        return list(lp.split([len(c) for _, c in seqs]))

    def weights(self) -> dict[str, np.ndarray]:
        """The trained parameters, as transformers names them."""
        return {n: p.detach().cpu().numpy() for n, p in self.trainable.items()}

    def serve_as(self, out: str | os.PathLike, as_type: str = "f32") -> Path:
        """Version 0 of the served file: the loaded file with the trained tensors in ``as_type``
        (``keep``: their own; gguf_weights.py says why F32), which every later version then
        overwrites in place (same types, same offsets)."""
        cfg = self.model.config
        if AS_TYPES[as_type] is None:
            path = Path(out)
            shutil.copyfile(self.path, path)
        else:
            path = self.gguf.write(self.weights(), out, AS_TYPES[as_type])
        self.gguf = GGUFWeights(path, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        return path

    def write_gguf(self, out: str | os.PathLike) -> Path:
        """The current weights as a new served file (the template :meth:`serve_as` made, else
        the loaded file, with the trained tensors overwritten)."""
        return self.gguf.write(self.weights(), out)


def _common_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = min(n, len(p))
        for i in range(n):
            if p[i] != first[i]:
                n = i
                break
    return n
