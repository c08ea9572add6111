"""The trainer's weights written back into a GGUF file that llama-server loads.

The new file is the served file with the trained tensors replaced: the metadata, the tokenizer
and every tensor not trained stay as they were. A trained tensor is written either in its own
type (``as_type=None``: Q4_1 stays Q4_1, quantized from the trainer's fp32 weights by ``gguf``'s
own quantizers; same sizes, so the file is the template with those bytes overwritten) or in
the type asked for (F32 or F16; the file is then laid out anew by ``gguf``'s writer).

Why not always the file's own type: Q4_1 has 16 levels per block of 32 weights, about 0.01
apart here, and an AdamW step moves a weight by about its learning rate (1e-5 to 1e-4): most of
a step rounds away, and what is left is a few weights jumping a whole level. Measured on this
model (examples/learn, one step of lr 3e-4 on four sequences, its logprobs read back through
transformers from the written file): the requantized model kept about half of the step's change
in logprob and missed the trainer's new logprobs by 1.7 per token on average. Written as F32 the
server runs the trainer's weights exactly (the embedding, not trained, keeps its Q8_0 bytes).

llama.cpp stores q and k with the rotary halves interleaved per head, where transformers keeps
them split: its GGUF loader undoes llama.cpp's permutation (``LlamaTensorProcessor``), so
writing back redoes it (:func:`permute_qk`, llama.cpp's own ``convert_hf_to_gguf`` permute).
The logprob checks after a sync are what show it was done right (tests/test_real_model_learn.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


def permute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """transformers' q/k layout to llama.cpp's (convert_hf_to_gguf.py LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


@dataclass(frozen=True)
class Slot:
    gguf_name: str
    qtype: gguf.GGMLQuantizationType
    offset: int  # of the tensor's data, in the file
    n_bytes: int
    data_shape: tuple  # the raw array's shape (rows, bytes per row for quantized types)


class GGUFWeights:
    """Where each of a transformers Llama model's parameters lives in a GGUF file."""

    def __init__(self, template: str | os.PathLike, n_layers: int, n_head: int, n_head_kv: int):
        self.template = Path(template)
        self.n_head, self.n_head_kv = n_head, n_head_kv
        reader = gguf.GGUFReader(str(self.template))
        arch = str(reader.fields["general.architecture"].contents())
        if arch != "llama":
            raise ValueError(f"{self.template}: architecture {arch!r}, this writer knows llama's names only")
        self.slots = {t.name: Slot(t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes), tuple(t.data.shape))
                      for t in reader.tensors}
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)

    def slot(self, hf_name: str) -> Slot:
        base, _, suffix = hf_name.rpartition(".")
        name = self.names.get_name(base)
        if name is None or f"{name}.{suffix}" not in self.slots:
            raise KeyError(f"{hf_name}: no tensor of {self.template.name} holds it")
        return self.slots[f"{name}.{suffix}"]

    def encode(self, hf_name: str, weight: np.ndarray, as_type: gguf.GGMLQuantizationType | None = None) -> np.ndarray:
        """One parameter as its tensor's data: llama.cpp's layout, in its own type (or ``as_type``)."""
        slot = self.slot(hf_name)
        qtype = slot.qtype if as_type is None else as_type
        w = np.ascontiguousarray(weight, dtype=np.float32)
        if slot.gguf_name.endswith(".attn_q.weight"):
            w = permute_qk(w, self.n_head, self.n_head)
        elif slot.gguf_name.endswith(".attn_k.weight"):
            w = permute_qk(w, self.n_head, self.n_head_kv)
        if qtype == gguf.GGMLQuantizationType.F32:
            data = w
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = w.astype(np.float16)
        else:
            data = gguf.quants.quantize(w, qtype)
        data = np.ascontiguousarray(data)
        if as_type is None and data.nbytes != slot.n_bytes:
            raise ValueError(f"{hf_name}: {data.nbytes} bytes for a {slot.n_bytes}-byte {slot.qtype.name} tensor "
                             f"{slot.gguf_name}")
        return data

    def write(self, weights: dict[str, np.ndarray], out: str | os.PathLike,
              as_type: gguf.GGMLQuantizationType | None = None) -> Path:
        """The template with these parameters' tensors replaced, as a new file (written beside
        ``out`` and renamed onto it: a server still reading the old file keeps its own)."""
        out = Path(out)
        tmp = out.with_name(out.name + ".part")
        if as_type is None:
            shutil.copyfile(self.template, tmp)
            with open(tmp, "r+b") as f:
                for hf_name, w in weights.items():
                    slot = self.slot(hf_name)
                    f.seek(slot.offset)
                    f.write(self.encode(hf_name, w).tobytes())
        else:
            self._rewrite(weights, tmp, as_type)
        os.replace(tmp, out)
        return out

    def _rewrite(self, weights: dict[str, np.ndarray], path: Path, as_type: gguf.GGMLQuantizationType) -> None:
        """A new layout: the template's metadata copied field by field (as gguf's own
        gguf_new_metadata.py copies them), the trained tensors in ``as_type``."""
        reader = gguf.GGUFReader(str(self.template))
        by_gguf = {self.slot(n).gguf_name: n for n in weights}
        writer = gguf.GGUFWriter(str(path), arch=str(reader.fields["general.architecture"].contents()),
                                 endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
        data = []
        for t in reader.tensors:
            if t.name in by_gguf:
                w = self.encode(by_gguf[t.name], weights[by_gguf[t.name]], as_type)
                writer.add_tensor_info(t.name, w.shape, w.dtype, w.nbytes, as_type)
            else:
                w = t.data
                writer.add_tensor_info(t.name, w.shape, w.dtype, w.nbytes, t.tensor_type)
            data.append(w)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for w in data:
            writer.write_tensor_data(w, tensor_endianess=reader.endianess)
        writer.close()
