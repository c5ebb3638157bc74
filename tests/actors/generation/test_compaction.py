"""Dropping finished rows from the decode step (actors.generation.compaction): the cache rows'
move, the shared-prompt links rebuilt for the kept rows, when the loop compacts, and generation
with compaction against the same call keeping every row (same tokens and logprobs, per global
row). CPU, float64 tiny models; the CUDA graph path in the gpu tier."""

from __future__ import annotations

import pytest
import torch

from actors.engine import CacheLayerShape
from actors.engine.model import Transformer
from actors.generation.compaction import (
    MIN_ROW_STEPS_CAPTURED,
    MIN_STEPS_LEFT,
    RowCompactor,
    keep_cache_rows,
    remap_group_table,
    rows_dynamic,
)
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig, GenerationOutput
from actors.generation.kv_cache import HeadMajorKVCache
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from planning.models import ModelSpec
from tests.actors.generation import test_loop_phases as loop_phases

torch.set_num_threads(1)

# A small vocabulary makes the stop token likely enough that rows end at many different steps.
SPEC = ModelSpec(name="compaction", family="llama", vocab_size=24, hidden_size=32, intermediate_size=64, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=256)
EOS = 1


def tiny_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float64) -> Transformer:
    return loop_phases.tiny_model(seed, device, dtype, SPEC)


def grouped_prompts(n_prompts: int, group: int, device: str = "cpu") -> list[torch.Tensor]:
    """`group` rows per prompt, each row the same tensor object (so the prefill shares it)."""
    gen = torch.Generator().manual_seed(7)
    distinct = [torch.randint(3, SPEC.vocab_size, (3 + 2 * i,), generator=gen).to(device) for i in range(n_prompts)]
    return [prompt for prompt in distinct for _ in range(group)]


def cache_with_rows(n_rows: int, n_slots: int = 8) -> HeadMajorKVCache:
    """A CPU cache whose K/V value at (row, head, slot, dim) encodes row and slot."""
    cache = HeadMajorKVCache({0: CacheLayerShape(2, 4), 3: CacheLayerShape(2, 4)}, n_rows, n_slots, torch.float32,
                             "cpu", kernel="sdpa")
    code = torch.arange(n_rows, dtype=torch.float32)[:, None, None, None] * 100 \
        + torch.arange(n_slots, dtype=torch.float32)[None, None, :, None]
    for store in (cache.k, cache.v):
        for buf in store.values():
            buf.copy_(code.expand_as(buf))
    return cache


@pytest.mark.unit
def test_keep_cache_rows_moves_written_slots_lengths_and_prompt_links() -> None:
    cache = cache_with_rows(6)
    cache.lengths.copy_(torch.tensor([5, 6, 4, 6, 5, 3]))
    # Two prompts of 3 rows each (rows 0-2 read their prompt from row 0, rows 3-5 from row 3).
    cache.prefix_rows.copy_(torch.tensor([0, 0, 0, 3, 3, 3]))
    cache.prefix_lengths.copy_(torch.tensor([2, 2, 2, 3, 3, 3]))
    cache.prefix_groups = torch.tensor([[0, 1, 2], [3, 4, 5]])
    cache.prefix_chunk_rows = 8
    keep = torch.tensor([1, 2, 5])  # the first group's old first row is gone
    keep_cache_rows(cache, keep)
    assert cache.n_seqs == 3 and cache.lengths.tolist() == [6, 4, 3]
    assert cache.prefix_rows.tolist() == [0, 0, 2] and cache.prefix_lengths.tolist() == [2, 2, 3]
    # The table keeps its [G, R] shape (a compiled step would recompile for a new one).
    assert cache.prefix_groups.tolist() == [[0, 1, -1], [2, -1, -1]]
    assert cache.rows.tolist() == [0, 1, 2] and cache.step_increment.tolist() == [1, 1, 1]
    for store in (cache.k, cache.v):
        for buf in store.values():
            assert buf.shape == (3, 2, 8, 4)
            for new_row, old_row in enumerate(keep.tolist()):  # the slots written so far, [0, 6)
                assert torch.equal(buf[new_row, :, :6, 0], torch.full((2, 6), old_row * 100.0) + torch.arange(6.0))


@pytest.mark.unit
def test_group_table_keeps_its_shape_and_empties_a_dropped_group() -> None:
    table = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7]])
    remapped = remap_group_table(table, torch.tensor([2, 5, 7]), 8)  # group 1 loses both rows
    assert remapped.tolist() == [[0, -1, -1], [-1, -1, -1], [1, 2, -1]]


@pytest.mark.unit
def test_keep_cache_rows_of_an_e4m3_cache_and_bad_row_counts() -> None:
    cache = HeadMajorKVCache({0: CacheLayerShape(1, 4)}, 3, 4, torch.float8_e4m3fn, "cpu", kernel="sdpa")
    values = torch.tensor([1.0, 2.0, 4.0])[:, None, None, None].expand(3, 1, 4, 4)
    cache.k[0].copy_(values.to(torch.float8_e4m3fn))
    cache.v[0].copy_((2 * values).to(torch.float8_e4m3fn))
    cache.lengths.fill_(4)
    keep_cache_rows(cache, torch.tensor([2]))
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.k[0].float().unique().tolist() == [4.0]
    assert cache.v[0].float().unique().tolist() == [8.0]
    with pytest.raises(ValueError, match="1 rows of a cache of 1|0 rows"):
        keep_cache_rows(cache, torch.tensor([], dtype=torch.int64))


@pytest.mark.unit
def test_compactor_waits_for_the_fraction_and_enough_steps() -> None:
    config = GenerationConfig(100, compact_fraction=0.5)
    compactor = RowCompactor(8, config)
    assert not compactor.due(None, 99) and not compactor.due(5, 99) and compactor.due(4, 99)
    assert not compactor.due(0, 99)  # nothing live: the loop ends instead
    assert compactor.due(4, MIN_STEPS_LEFT) and not compactor.due(4, MIN_STEPS_LEFT - 1)
    assert not RowCompactor(8, GenerationConfig(100, compact_fraction=0.0)).due(1, 99)
    finished = torch.tensor([True, False, True, False, False, True, True, True])
    cache = cache_with_rows(8)
    assert compactor.compact(finished, cache).tolist() == [1, 3, 4] and compactor.active.tolist() == [1, 3, 4]
    finished[3] = True  # global row 3: step row 1
    assert compactor.compact(finished, cache).tolist() == [0, 2] and compactor.active.tolist() == [1, 4]
    assert compactor.n_step_rows == 2 and cache.n_seqs == 2 and compactor.compactions == 2
    assert compactor.compact(torch.ones(8, dtype=torch.bool), cache) is None


@pytest.mark.unit
def test_compactor_with_graphs_waits_until_enough_row_steps_are_dropped() -> None:
    """With CUDA graphs a compaction captures a graph: by default it waits until the rows dropped
    times the steps left reach MIN_ROW_STEPS_CAPTURED; eager steps compact at the fraction alone;
    an explicit compact_min_row_steps overrides either."""
    graphs = RowCompactor(512, GenerationConfig(512, use_cuda_graph=True))
    assert graphs.min_row_steps == MIN_ROW_STEPS_CAPTURED
    assert graphs.due(384, MIN_ROW_STEPS_CAPTURED // 128)  # 128 rows dropped x 32 steps
    assert not graphs.due(384, MIN_ROW_STEPS_CAPTURED // 128 - 1)
    assert graphs.due(256, MIN_ROW_STEPS_CAPTURED // 256)  # more rows finished: fewer steps suffice
    assert RowCompactor(512, GenerationConfig(512)).due(384, MIN_STEPS_LEFT)  # eager: the fraction alone
    explicit = GenerationConfig(512, use_cuda_graph=True, compact_min_row_steps=0)
    assert RowCompactor(512, explicit).due(384, MIN_STEPS_LEFT)
    assert not RowCompactor(512, GenerationConfig(512, compact_min_row_steps=10_000)).due(384, 60)
    with pytest.raises(ValueError, match=r"compact_min_row_steps=-1: must be >= 0"):
        GenerationConfig(8, compact_min_row_steps=-1)


@pytest.mark.unit
def test_a_call_that_may_compact_compiles_its_rows_symbolically() -> None:
    """compile_dynamic_rows None: symbolic rows where rows may end early and compaction is on, or
    where a pipeline's micro-batches start at unequal row counts; an explicit value overrides. The step marks dim 0 of its input, its batch and every per-row
    tensor of the cache (and of a compacted step's cache), never the slot index."""
    assert rows_dynamic(GenerationConfig(8), rows_may_end=True)
    assert not rows_dynamic(GenerationConfig(8), rows_may_end=False)
    assert not rows_dynamic(GenerationConfig(8, compact_fraction=0.0), rows_may_end=True)
    assert rows_dynamic(GenerationConfig(8, compile_dynamic_rows=True), rows_may_end=False)
    assert not rows_dynamic(GenerationConfig(8, compile_dynamic_rows=False), rows_may_end=True)
    # A pipeline's micro-batches of unequal size share one compiled model: symbolic too.
    assert rows_dynamic(GenerationConfig(8, compact_fraction=0.0), False, step_row_counts=(4, 3, 3))
    assert not rows_dynamic(GenerationConfig(8), False, step_row_counts=(3, 3, 3))
    assert not rows_dynamic(GenerationConfig(8, compile_dynamic_rows=False), False, step_row_counts=(4, 3))

    def marked(tensor: torch.Tensor) -> bool:
        return 0 in getattr(tensor, "_dynamo_weak_dynamic_indices", set())

    model = tiny_model()
    cache = HeadMajorKVCache.for_model(model, n_seqs=6, max_len=16)
    step = DecodeStep(model, cache, use_cuda_graph=False, compile_model=True, dynamic_rows=True)
    per_row = [step.static_input, step.batch.cu_seqlens, step.batch.positions, cache.lengths, cache.step_increment,
               cache.rows, cache.prefix_rows, cache.prefix_lengths, *cache.k.values(), *cache.v.values()]
    assert all(marked(t) for t in per_row) and cache.slots.shape[0] != cache.n_seqs  # slots: their own count
    keep_cache_rows(cache, torch.tensor([0, 2, 5]))
    smaller = step.for_cache(cache)
    assert smaller.dynamic_rows and all(marked(t) for t in (smaller.static_input, cache.lengths, *cache.k.values()))
    assert not DecodeStep(model, HeadMajorKVCache.for_model(model, 6, 16), False, compile_model=True).dynamic_rows


@pytest.mark.unit
@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_compact_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"compact_fraction=.*\[0, 1\)"):
        GenerationConfig(8, compact_fraction=fraction)


def same_rows(a: GenerationOutput, b: GenerationOutput) -> None:
    assert a.response_lengths.tolist() == b.response_lengths.tolist()
    assert [r.tolist() for r in a.responses()] == [r.tolist() for r in b.responses()]
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
    assert a.no_eos.tolist() == b.no_eos.tolist()


@pytest.mark.unit
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompts", "distinct-prompts"])
def test_generation_with_compaction_equals_keeping_every_row(shared: bool) -> None:
    """Sampling at temperature 1 with a likely stop token: rows end at many steps, the loop
    compacts several times, and every row's tokens and logprobs are those of the call that keeps
    all rows (its own cache, positions and random draws)."""
    model = tiny_model(seed=2)
    rows = grouped_prompts(4, 4) if shared else [p.clone() for p in grouped_prompts(4, 4)]
    base = dict(max_new_tokens=60, sampling=SamplingParams(temperature=1.0), seed=11, eos_token_id=EOS)
    kept = generate(model, rows, GenerationConfig(**base, compact_fraction=0.0))
    compacted = generate(model, rows, GenerationConfig(**base, compact_fraction=0.75))
    lengths = kept.response_lengths.tolist()
    assert len(set(lengths)) >= 4 and min(lengths) < 60 - MIN_STEPS_LEFT  # rows end at different steps
    assert kept.stats["compactions"] == 0.0 and compacted.stats["compactions"] >= 2.0
    same_rows(compacted, kept)


@pytest.mark.unit
def test_greedy_compaction_keeps_rows_and_pads_finished_ones() -> None:
    """Greedy (no random draws), a fraction that compacts after the first row stops: the same
    output as keeping every row."""
    model = tiny_model(seed=4)
    rows = [prompt.clone() for prompt in grouped_prompts(6, 1)]
    base = dict(max_new_tokens=40, sampling=SamplingParams(temperature=0.0), eos_token_id=2, pad_token_id=0)
    kept = generate(model, rows, GenerationConfig(**base, compact_fraction=0.0))
    compacted = generate(model, rows, GenerationConfig(**base, compact_fraction=0.9))
    assert kept.response_lengths.tolist() == [2, 31, 40, 11, 7, 40] and compacted.stats["compactions"] == 3.0
    same_rows(compacted, kept)


@pytest.mark.unit
def test_compiled_decode_step_compiles_once_for_every_row_count() -> None:
    """torch.compile (inductor on CPU): a call that may compact traces its step with the row count
    symbolic from the first call (compile_dynamic_rows None), so the compacted steps reuse that
    compile (plus one for a single row, which dynamo specialises), and it samples what eager does."""
    from torch._dynamo.utils import counters

    model = tiny_model(seed=2, dtype=torch.float32)
    rows = grouped_prompts(4, 4)
    base = dict(max_new_tokens=60, sampling=SamplingParams(temperature=1.0), seed=11, eos_token_id=EOS)
    eager = generate(model, rows, GenerationConfig(**base))
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, rows, GenerationConfig(**base, compile_decode=True))
    assert compiled.stats["compactions"] >= 4.0
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert compiled.response_lengths.tolist() == eager.response_lengths.tolist()
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_decode", [False, True], ids=["graph", "graph+compile"])
def test_cuda_graph_steps_with_compaction_equal_keeping_every_row(compile_decode: bool) -> None:
    """On CUDA: the Triton decode attention with the shared prompts' partials (the group table
    remapped at each compaction, its shape kept), a CUDA graph per step size; under torch.compile
    no recompile per compaction; the same tokens as keeping every row, logprobs within bf16
    rounding of a different row count's GEMMs."""
    model = tiny_model(seed=2, device="cuda", dtype=torch.bfloat16)
    rows = grouped_prompts(4, 8, device="cuda")
    base = dict(max_new_tokens=60, sampling=SamplingParams(temperature=1.0), seed=11, eos_token_id=EOS,
                use_cuda_graph=True, compile_decode=compile_decode,
                compact_min_row_steps=0)  # a tiny call: compact whatever a capture costs
    from torch._dynamo.utils import counters

    from actors.kernels import decode_launch

    decode_launch._SM_COUNTS.clear()  # as in a fresh process: the first step's trace must not fill it
    torch._dynamo.reset()
    counters.clear()
    kept = generate(model, rows, GenerationConfig(**base, compact_fraction=0.0))
    if compile_decode:  # one graph for a step of fixed rows
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
    counters.clear()
    compacted = generate(model, rows, GenerationConfig(**base))
    assert compacted.stats["compactions"] >= 2.0
    if compile_decode:  # one compile, the row count symbolic from the start (+ one row)
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert compacted.response_lengths.tolist() == kept.response_lengths.tolist()
    assert [r.tolist() for r in compacted.responses()] == [r.tolist() for r in kept.responses()]
    torch.testing.assert_close(compacted.logprobs, kept.logprobs, rtol=0, atol=3e-2)
