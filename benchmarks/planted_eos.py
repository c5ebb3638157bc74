"""An EOS planted in random weights, so that responses end at different lengths as they do on a
real task (random weights never emit EOS on their own). Used by benchmarks/compaction_bench.py
(our model) and benchmarks/peer_setup.py --mean-len (the HF checkpoint both systems of the peer
bench read): the two models name their weights alike (model.embed_tokens, model.layers[i].
self_attn.o_proj, .mlp.down_proj, lm_head).

How: coordinate 0 of the residual stream holds a constant (the embedding's column 0; the
attention and MLP outputs scaled down and kept off coordinate 0, so it dominates the final norm),
and the head's EOS row has a larger entry there, so the EOS logit sits a fixed `b` above the
others and every step ends a row with probability p = e^b / (e^b + V - 1): response lengths are
geometric with mean about `mean_len`, cut at the budget. The compute of a step is that of any
weights of this shape.
"""

from __future__ import annotations

import math

import torch
from torch import nn

RESIDUAL_CONSTANT = 2.0  # bf16 steps of 2**-6 around it: the EOS offset below is representable


def expected_length(offset: float, vocab_size: int) -> float:
    """Mean steps to the first EOS when its logit sits `offset` above the rest (no budget)."""
    return (math.exp(offset) + vocab_size - 1) / math.exp(offset)


@torch.no_grad()
def plant_eos(model: nn.Module, eos: int, mean_len: float) -> float:
    """Make every step of `model` (ours or an HF Llama, final norm weights 1) end a row with
    probability about 1 / mean_len; returns the EOS logit's offset b as planted (after rounding
    to the weights' dtype)."""
    if mean_len <= 1:
        raise ValueError(f"plant_eos: mean_len={mean_len}; must be > 1")
    embedding = model.model.embed_tokens.weight  # [V, H]
    lm_head = getattr(model, "lm_head", None)
    head = lm_head.weight if lm_head is not None else embedding  # a tied head is the embedding
    tied = head.data_ptr() == embedding.data_ptr()
    vocab, hidden = embedding.shape
    # A tied head's column 0 is the constant itself (the same shift of every logit); an untied one's is 0.
    base = RESIDUAL_CONSTANT if tied else 0.0
    embedding.mul_(0.1)  # the other coordinates small against the constant
    embedding[:, 0] = RESIDUAL_CONSTANT
    if not tied:
        head.mul_(0.1)
        head[:, 0] = base
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        for writer in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):  # [H, in]
            writer.mul_(1e-3)
            writer[0] = 0.0  # coordinate 0 of the residual stays constant
    # The final norm maps coordinate 0 to about sqrt(hidden); the head adds offset * that.
    offset = math.log((vocab - 1) / (mean_len - 1))
    head[eos, 0] = base + offset / math.sqrt(hidden)
    return (float(head[eos, 0]) - base) * math.sqrt(hidden)


__all__ = ["RESIDUAL_CONSTANT", "expected_length", "plant_eos"]
