"""A compiled decode step traces the cache's slot count (the call's longest prompt plus its new
tokens) symbolically, so the calls of a run, whose longest prompts differ, share one compile:
which tensors are marked (CPU), and the compile count over calls of different lengths (CUDA,
where the Triton decode attention reads no host-side length)."""

from __future__ import annotations

import pytest
import torch

from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig
from actors.generation.kv_cache import HeadMajorKVCache
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from actors.kernels.decode_launch import default_splits, slots_class
from planning.models import ModelSpec
from tests.actors.generation import test_loop_phases as loop_phases
from tests.actors.generation.test_compaction import SPEC, tiny_model

torch.set_num_threads(1)

# head_dim 16: the smallest the Triton decode attention takes (the production path on CUDA).
TRITON_SPEC = ModelSpec(name="decode-compile", family="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=1024)


def slot_marked(tensor: torch.Tensor, dim: int) -> bool:
    return dim in getattr(tensor, "_dynamo_weak_dynamic_indices", set())


@pytest.mark.unit
def test_a_compiled_step_marks_the_cache_slot_count_dynamic() -> None:
    """K/V buffers along their slot dim (2) and the slot numbers; a compacted step's new cache
    too; an eager step marks nothing (it never traces)."""
    model = tiny_model()
    cache = HeadMajorKVCache.for_model(model, n_seqs=3, max_len=21)
    step = DecodeStep(model, cache, use_cuda_graph=False, compile_model=True)
    assert all(slot_marked(buffer, 2) for buffer in (*cache.k.values(), *cache.v.values()))
    assert slot_marked(cache.slots, 0) and [t.shape[d] for t, d in cache.slot_dims()] == [21] * (2 * SPEC.n_layers + 1)
    smaller = HeadMajorKVCache.for_model(model, n_seqs=2, max_len=21)
    step.for_cache(smaller)
    assert all(slot_marked(t, d) for t, d in smaller.slot_dims())
    eager = HeadMajorKVCache.for_model(model, n_seqs=3, max_len=25)
    DecodeStep(model, eager, use_cuda_graph=False)
    assert not any(slot_marked(t, d) for t, d in eager.slot_dims())


@pytest.mark.unit
def test_the_tuning_key_of_a_symbolic_slot_count_guards_its_class_only() -> None:
    """slots_class is int.bit_length by comparisons: traced over a symbolic count (mark_dynamic
    raises if anything pins it) it leaves range guards, so 21 and 25 slots share a trace and 40
    slots (a longer class) traces once more."""
    from torch._dynamo.utils import counters

    assert [slots_class(n) for n in range(1, 300)] == [n.bit_length() for n in range(1, 300)]

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * slots_class(x.shape[0])

    torch._dynamo.reset()
    counters.clear()
    for n, bits in ((21, 5), (25, 5), (40, 6)):
        x = torch.ones(n)
        torch._dynamo.mark_dynamic(x, 0)
        assert scaled(x).tolist() == [float(bits)] * n
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def prompts_up_to(longest: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(longest)
    return [torch.randint(3, TRITON_SPEC.vocab_size, (n,), generator=gen).to(device) for n in (3, longest, 5, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("longest", [(5, 9, 13), (500, 510, 520)], ids=["unsplit", "split"])
def test_calls_with_different_longest_prompts_compile_the_step_once(longest: tuple[int, ...]) -> None:
    """Three calls of CUDA graph + compile whose caches differ in slots within one tuning class of
    the decode attention (`slots_class`): 21-29 slots (the unsplit kernel), and 516-536 (4 rows
    x 2 KV heads over >= 512 slots: the split-K kernel, whose chunk follows the symbolic count).
    One graph, where before each call compiled its own (the kernel's tuning key pinned the count),
    and each call samples the same tokens as the uncompiled graph path (float32: the Triton
    kernel's IEEE path, so no bf16 rounding flips a sample), logprobs within float32 rounding."""
    from torch._dynamo.utils import counters

    model = loop_phases.tiny_model(2, "cuda", torch.float32, TRITON_SPEC)
    base = dict(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=5, use_cuda_graph=True)
    splits = {default_splits(4, TRITON_SPEC.n_kv_heads, n + 16, torch.device("cuda")) for n in longest}
    assert len(splits) == 1 and (splits.pop() > 1) == (longest[0] >= 500)
    torch._dynamo.reset()
    counters.clear()
    for n in longest:
        prompts = prompts_up_to(n, "cuda")
        compiled = generate(model, prompts, GenerationConfig(**base, compile_decode=True))
        plain = generate(model, prompts, GenerationConfig(**base))
        assert [r.tolist() for r in compiled.responses()] == [r.tolist() for r in plain.responses()], n
        torch.testing.assert_close(compiled.logprobs, plain.logprobs, rtol=0, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
