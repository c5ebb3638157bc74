"""The decode step issues few kernels: per-step work (rope inverse frequencies, the attention
mask) is done once per step or once per model, not once per layer, and the single-stage
bookkeeping of sampled tokens writes columns in place. Ops are counted at the aten dispatch level
on CPU with a tiny model of Llama-3.2's layer structure (GQA, llama3 rope scaling, tied head)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.engine.model import Transformer
from actors.engine.rotary import rope_inv_freq
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig, ResponseRecorder, prepare_cache
from actors.generation.kv_cache import HeadMajorKVCache
from actors.generation.sampling import SampledTokens
from planning.models import model_preset

torch.set_num_threads(1)

# Ops that only make views (no kernel on a GPU).
VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "expand",
            "alias", "as_strided", "permute", "detach", "split", "unbind"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (by overload packet name) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny_llama32(n_layers: int) -> Transformer:
    spec = dataclasses.replace(model_preset("llama3.2-1b"), n_layers=n_layers, vocab_size=128, hidden_size=32,
                               intermediate_size=64, n_heads=4, n_kv_heads=2, head_dim=8)
    model = Transformer(spec)
    model.init_weights(seed=0)
    return model


def decode_step_ops(n_layers: int, kernel: str) -> collections.Counter[str]:
    """Non-view ops of the second eager decode step of a tiny model with `n_layers` layers."""
    model = tiny_llama32(n_layers)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
    config = GenerationConfig(max_new_tokens=8, decode_attention=kernel)
    with torch.no_grad():
        tokens, batch, cache = prepare_cache(model, prompts, config, torch.device("cpu"))
        model(tokens, batch, cache, head_indices=batch.last_token_indices())
        step = DecodeStep(model, cache, use_cuda_graph=False)
        step(torch.tensor([3, 4]), attend_len=9)
        with OpCounter() as counter:
            step(torch.tensor([5, 6]), attend_len=10)
    return collections.Counter({op: n for op, n in counter.ops.items() if op not in VIEW_OPS})


@pytest.mark.unit
@pytest.mark.parametrize("kernel", ["sdpa", "matmul"])
def test_per_step_work_is_not_repeated_per_layer(kernel: str) -> None:
    two, three = decode_step_ops(2, kernel), decode_step_ops(3, kernel)
    per_layer = three - two
    outside = two - per_layer - per_layer
    assert sum((two - three).values()) == 0  # a third layer only adds ops
    # Mask construction and cache index arithmetic happen once per step, outside the layers.
    for op in ("arange", "le", "where", "scalar_tensor", "full", "masked_fill", "masked_fill_", "bitwise_not"):
        assert per_layer[op] == 0, (op, dict(per_layer))
    assert outside["masked_fill_"] == 1 and outside["full"] == 1
    # Rope inverse frequencies are cached: no division, reciprocal or power outside the layers
    # except the final norm's one pow; cos and sin once per step.
    assert outside["div"] == 0 and outside["reciprocal"] == 0 and outside["pow"] == 1
    assert outside["cos"] == 1 and outside["sin"] == 1
    # q and k are rotated together: one negation per layer; K and V written once each.
    assert per_layer["neg"] == 1 and per_layer["index_put_"] == 2


@pytest.mark.unit
def test_decode_mask_is_shared_within_a_step_aligned_and_rebuilt_after_advance() -> None:
    cache = HeadMajorKVCache({0: _shape(), 1: _shape()}, n_seqs=3, max_len=21, dtype=torch.float32, device="cpu")
    cache.lengths.copy_(torch.tensor([0, 4, 20]))
    cache.prefilled = True
    mask = cache.decode_mask(torch.float32, None)
    assert cache.decode_mask(torch.float32, None) is mask  # the next layer reuses it
    slots = torch.arange(21)
    visible = slots[None, :] <= cache.lengths[:, None]
    expected = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]
    assert torch.equal(mask, expected)
    assert all(stride % 16 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    windowed = cache.decode_mask(torch.float32, 3)
    assert torch.equal(windowed[:, 0, 0].isfinite().sum(-1), torch.tensor([1, 3, 3]))
    cache.advance(cache.decode_batch())
    rebuilt = cache.decode_mask(torch.float32, None)
    assert rebuilt is not mask and torch.equal(rebuilt[1, 0, 0].isfinite().sum(), torch.tensor(6))


def _shape():  # type: ignore[no-untyped-def]
    from actors.engine.attention import CacheLayerShape

    return CacheLayerShape(n_kv_heads=2, head_dim=4)


@pytest.mark.unit
def test_cached_inv_freq_equals_a_fresh_computation() -> None:
    model = tiny_llama32(1)
    cached = model.rope_inv_freq(torch.device("cpu"))
    assert model.rope_inv_freq(torch.device("cpu")) is cached
    assert torch.equal(cached, rope_inv_freq(model.spec, "cpu"))


@pytest.mark.unit
def test_recording_all_rows_equals_recording_by_row_index() -> None:
    n_seqs, steps = 4, 5
    config = GenerationConfig(max_new_tokens=steps, eos_token_id=2)
    by_rows = ResponseRecorder(n_seqs, config, torch.device("cpu"))
    all_rows = ResponseRecorder(n_seqs, config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        sampled = SampledTokens(torch.randint(1, 5, (n_seqs,), generator=gen), torch.randn(n_seqs, generator=gen),
                                torch.randint(1, 9, (n_seqs,), generator=gen, dtype=torch.int32))
        expected_next = by_rows.record(torch.arange(n_seqs), step, sampled)
        assert torch.equal(all_rows.record(None, step, sampled), expected_next)
    for name in ("tokens", "logprobs", "kept_counts", "lengths", "finished"):
        assert torch.equal(getattr(all_rows, name), getattr(by_rows, name)), name
    assert bool(all_rows.finished.any()) and int(all_rows.lengths.min()) < steps  # EOS stopped some rows
