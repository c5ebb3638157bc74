"""Shared prompts held once per micro-batch: the layout, the cascade attention and its backward,
and the engine's outputs and gradients against the same rows packed one by one (serial, CPU)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.attention import packed_attention
from actors.engine.model_engine import ModelEngine, SequenceBatch
from actors.engine.packing import PackedBatch
from actors.engine.process_groups import ParallelGroups
from actors.engine.shared_prefix import prefix_groups, shared_layout
from actors.engine.shared_prefix_attention import (
    REFERENCE_KERNELS,
    cascade_attention,
    _GatherHistory,
    history_attention,
    merge_partials,
    shared_prefix_attention,
)
from actors.rl.losses import LossSums, value_loss
from planning.models import ModelSpec

SPEC = ModelSpec("tiny-gqa", "llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
# Prompts: A (4 tokens) x 3 rows, B (5 tokens) x 2, C (3 tokens) x 1, and D, a 4-token prompt
# after A's rows with the same length but other ids (must not join A's group).
PROMPTS = {"A": [3, 9, 4, 1], "B": [7, 7, 2, 5, 8], "C": [11, 12, 13], "D": [3, 9, 4, 2]}
ROWS = [("A", 5), ("A", 2), ("A", 7), ("D", 3), ("B", 1), ("B", 6), ("C", 4)]


def make_rows(seed: int = 0) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(tokens int64 [T], row lengths, prompt lengths) of ROWS with random responses."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.tensor(PROMPTS[p] + torch.randint(0, 64, (n,), generator=gen).tolist()) for p, n in ROWS]
    return torch.cat(rows), tuple(r.numel() for r in rows), tuple(len(PROMPTS[p]) for p, _ in ROWS)


def test_prefix_groups_join_equal_prompts_only() -> None:
    tokens, lengths, prompts = make_rows()
    assert prefix_groups(tokens, lengths, prompts) == [(0, 3, 4), (3, 4, 4), (4, 6, 5), (6, 7, 3)]
    # A group shares at most its shortest row's length - 1 (every row keeps a suffix).
    assert prefix_groups(torch.tensor([3, 9, 4, 1, 5, 3, 9, 4, 1]), (5, 4), (4, 4)) == [(0, 2, 3)]


def test_layout_holds_each_prompt_once_and_maps_back_to_rows() -> None:
    tokens, lengths, prompts = make_rows()
    compact, packed, rows = shared_layout(tokens, lengths, prompts, "cpu")
    assert compact.numel() == tokens.numel() - 2 * 4 - 1 * 5  # A's prompt twice and B's once fewer
    assert torch.equal(compact[rows.compact_index], tokens)
    spans = packed.shared_prefix
    assert spans.n_prefix_tokens == 4 + 4 + 5 + 3 and spans.cu_prefix.tolist() == [0, 4, 8, 13, 16]
    assert spans.cu_suffix.tolist() == [0, 14, 17, 24, 28]
    # Positions: each token keeps the one it has in its row.
    row_positions = PackedBatch.from_lengths(list(lengths)).positions
    assert torch.equal(packed.positions[rows.compact_index], row_positions)
    # The extra head rows are each row's group's last prompt token; their targets the first answers.
    assert spans.head_rows.tolist() == [3, 3, 3, 7, 12, 12, 15]
    # Keys per sequence: the 4 prefixes, then each row whole (its group's prefix and its suffix).
    assert torch.equal(spans.history, torch.cat((torch.arange(16), rows.compact_index)))
    assert spans.cu_history.tolist() == [0, 4, 8, 13, 16, *(16 + torch.tensor(lengths).cumsum(0)).tolist()]
    assert spans.max_history == max(lengths)
    # history_order: every prefix token's occurrences (sorted by token), then each suffix token once.
    held = spans.history[spans.history_order]
    n_repeated = spans.history.numel() - (compact.numel() - 16)
    assert torch.equal(held[n_repeated:], torch.arange(16, compact.numel()))
    assert bool((held[:n_repeated] < 16).all()) and bool((held[:n_repeated].diff() >= 0).all())
    assert torch.equal(spans.history_sorted, held)  # what the gather's backward reads
    assert torch.equal(rows.first_targets, tokens[rows.first_suffix])
    assert shared_layout(tokens[:8], (4, 4), (4, 4), "cpu") is None  # A and D: nothing shared


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...],
                   index: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of the rows, each packed whole; q/k/v given on the compact stream."""
    return packed_attention(q[index], k[index], v[index], PackedBatch.from_lengths(list(lengths)), "sdpa")


@pytest.mark.parametrize("way", ["mask", "cascade", "history"])
def test_shared_attention_and_grads_match_rows_packed_whole(way: str) -> None:
    tokens, lengths, prompts = make_rows(1)
    _, packed, rows = shared_layout(tokens, lengths, prompts, "cpu")
    gen = torch.Generator().manual_seed(2)
    n = packed.n_tokens
    q, k, v = (torch.randn(n, heads, 8, dtype=torch.float64, generator=gen).requires_grad_() for heads in (4, 2, 2))
    if way == "mask":
        out = shared_prefix_attention(q, k, v, packed, "sdpa")
    elif way == "history":  # the CUDA path's gather and bounds, through SDPA with their mask here
        out = history_attention(q, k, v, packed)
    else:
        out = cascade_attention(q, k, v, packed, REFERENCE_KERNELS)
    expected = _row_attention(q, k, v, lengths, rows.compact_index)
    torch.testing.assert_close(out[rows.compact_index], expected)
    weights = torch.randn(tokens.numel(), 4, 8, dtype=torch.float64, generator=gen)
    grads = torch.autograd.grad((out[rows.compact_index] * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_history_gather_backward_copies_suffixes_and_sums_prefixes_in_float32(dtype: torch.dtype) -> None:
    tokens, lengths, prompts = make_rows(3)
    _, packed, _ = shared_layout(tokens, lengths, prompts, "cpu")
    spans = packed.shared_prefix
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(packed.n_tokens, 2, 8, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(spans.history.numel(), 2, 8, generator=gen).to(dtype)
    y = torch.randn(packed.n_tokens, 2, 8, generator=gen).to(dtype).requires_grad_()
    got, got_y = torch.autograd.grad(_GatherHistory.apply(x, y, spans), (x, y), (grad, 2 * grad))
    torch.testing.assert_close(got_y, 2 * got)  # the values' gradient goes the same way
    # Reference: every occurrence summed in float64, rounded once to the gradient's dtype.
    want = torch.zeros(x.shape, dtype=torch.float64).index_add_(0, spans.history, grad.double()).to(dtype)
    n_p = spans.n_prefix_tokens
    assert torch.equal(got[n_p:], want[n_p:])  # a suffix token occurs once: copied exactly
    # A prefix token's sum: float32 rounding, then at most one rounding to bf16 (2^-8 relative).
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got[:n_p].float(), want[:n_p].float(), rtol=tolerance, atol=1e-6)


def test_merge_partials_is_attention_over_both_key_sets() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    cu_all, cu_a, cu_b = (torch.tensor(c, dtype=torch.int32) for c in ([0, 6], [0, 2], [0, 4]))
    full, full_lse, _ = REFERENCE_KERNELS.forward(q[:1], k, v, torch.tensor([0, 1], dtype=torch.int32), cu_all,
                                                  1, 6, False, 0.5)
    one = torch.tensor([0, 1], dtype=torch.int32)
    o_a, lse_a, _ = REFERENCE_KERNELS.forward(q[:1], k[:2], v[:2], one, cu_a, 1, 2, False, 0.5)
    o_b, lse_b, _ = REFERENCE_KERNELS.forward(q[:1], k[2:], v[2:], one, cu_b, 1, 4, False, 0.5)
    merged, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(lse, full_lse)
    assert cu_all.numel() == 2


def _policy_loss(logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    mask = data["mask"]
    per_token = -logprobs * data["adv"] - 0.01 * data["entropy"]
    return LossSums((per_token * mask).sum(), mask.sum(), {})


def _critic_loss(values: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    return value_loss(values, data["old_values"], data["returns"], data["mask"], clip_range=0.2)


def make_batch(shared: bool) -> SequenceBatch:
    tokens, lengths, prompts = make_rows(4)
    gen = torch.Generator().manual_seed(5)
    total = tokens.numel()
    mask = (torch.rand(total, generator=gen) < 0.8).float()
    return SequenceBatch(tokens, lengths, {"mask": mask, "adv": torch.randn(total, generator=gen),
                                           "old_values": torch.randn(total, generator=gen) * 0.1,
                                           "returns": torch.randn(total, generator=gen)},
                         prefix_lengths=prompts if shared else None)


@pytest.mark.parametrize("critic", [False, True])
@pytest.mark.parametrize("n_micro", [1, 3])
def test_engine_outputs_and_grads_match_unshared(critic: bool, n_micro: int) -> None:
    results = []
    for shared in (False, True):
        engine = ModelEngine(SPEC, critic, ParallelGroups.serial(), "cpu", torch.float64, seed=0)
        batch = make_batch(shared)
        if critic:
            out = torch.stack([engine.forward_values(batch, n_micro), engine.forward_values(batch, n_micro, shift=False)])
        else:
            out = engine.forward_logprobs(batch, n_micro, temperature=0.7)
        metrics, count = engine.backward_step(batch, _critic_loss if critic else _policy_loss, n_micro,
                                              temperature=0.7, with_entropy=not critic)
        grads = {name: p.grad.clone() for name, p in engine.model.named_parameters()}
        results.append((out, metrics, count, grads))
    (out, metrics, count, grads), (s_out, s_metrics, s_count, s_grads) = results
    torch.testing.assert_close(s_out, out)
    assert s_count == count and s_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-9)
    # The head's logprob and entropy work in float32 (actors.engine.logprobs), summed in another order.
    for name, grad in grads.items():
        torch.testing.assert_close(s_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_sliding_window_model_runs_rows_whole() -> None:
    spec = ModelSpec("tiny-window", "mistral", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64, sliding_window=4)
    engine = ModelEngine(spec, False, ParallelGroups.serial(), "cpu", torch.float64, seed=0)
    plain, shared = (engine.forward_logprobs(make_batch(s)) for s in (False, True))
    torch.testing.assert_close(shared, plain)


def _rel_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-12))


@pytest.mark.gpu
def test_cuda_cascade_matches_float32_rows() -> None:
    """The FlashAttention cascade (bf16, GQA) against float32 SDPA over the rows packed whole:
    output and the gradients of q, k and v within bf16 rounding."""
    tokens, lengths, prompts = make_rows(6)
    _, packed, rows = shared_layout(tokens, lengths, prompts, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(packed.n_tokens, heads, 64, device="cuda", generator=gen) for heads in (8, 2, 2)]
    weights = torch.randn(tokens.numel(), 8, 64, device="cuda", generator=gen)
    results = {}
    for way, dtype in (("cascade", torch.bfloat16), ("rows", torch.float32)):
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        if way == "cascade":
            out = shared_prefix_attention(q, k, v, packed, "varlen")[rows.compact_index]
        else:
            rows_batch = PackedBatch.from_lengths(list(lengths), "cuda")
            index = rows.compact_index
            out = packed_attention(q[index], k[index], v[index], rows_batch, "sdpa")
        grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
        results[way] = [out, *grads]
    for name, got, exact in zip("out dq dk dv".split(), results["cascade"], results["rows"], strict=True):
        assert _rel_error(got, exact) < 2e-2, (name, _rel_error(got, exact))


@pytest.mark.gpu
def test_cuda_engine_shared_prompts_match_rows() -> None:
    """A bf16 train step's logprobs and gradients with shared prompts against the same rows whole."""
    results = []
    for shared in (False, True):
        engine = ModelEngine(SPEC, False, ParallelGroups.serial(), "cuda", torch.bfloat16, seed=0)
        batch = make_batch(shared)
        out = engine.forward_logprobs(batch, 2)
        engine.backward_step(batch, _policy_loss, 2, with_entropy=True)
        results.append([out, *(p.grad.float() for p in engine.model.parameters())])
    for index, (plain, shared) in enumerate(zip(*results, strict=True)):
        assert _rel_error(shared, plain) < 3e-2, (index, _rel_error(shared, plain))
