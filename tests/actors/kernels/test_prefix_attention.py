"""The shared-prompt partial softmax (actors.kernels.prefix_attention) and the decode kernel
starting from it, against the torch twin reading the prompt slots from the group's first row.
Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay tiny."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.kernels.decode_attention import gqa_decode_attention, gqa_decode_attention_reference
from actors.kernels.prefix_attention import prefix_partials
from actors.kernels.switch import triton_runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_runs(DEVICE), reason="Triton cannot run here (no CUDA, no interpreter)")


def grouped_case(seed: int = 0):
    """Six rows, 2 KV heads x group 2, head_dim 16: rows 0, 2, 3 share a 10-slot prompt held by
    row 0 (row 2 and 3's own copies differ, so the test sees where slots are read), rows 4 and 1
    a 7-slot one held by row 4, row 5 is alone."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q, k_new, v_new = rand(6, 4, 16), rand(6, 2, 16), rand(6, 2, 16)
    k_cache, v_cache = rand(6, 2, 40, 16), rand(6, 2, 40, 16)
    lengths = torch.tensor([10, 25, 18, 10, 30, 5], device=DEVICE)
    prefix_rows = torch.tensor([0, 4, 0, 0, 4, 5], device=DEVICE)
    prefix_lengths = torch.tensor([10, 7, 10, 10, 7, 0], device=DEVICE)
    group_rows = torch.tensor([[0, 2, 3], [4, 1, -1]], device=DEVICE)  # the second group has two rows
    return q, k_new, v_new, k_cache, v_cache, lengths, prefix_rows, prefix_lengths, group_rows


def test_decode_from_prefix_partials_matches_the_shared_read() -> None:
    q, k_new, v_new, k_cache, v_cache, lengths, prefix_rows, prefix_lengths, group_rows = grouped_case()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    partial = prefix_partials(q, k_cache, v_cache, group_rows, prefix_lengths, block_n=16)
    out = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, block_n=16, splits=1,
                               prefix_rows=prefix_rows, prefix_lengths=prefix_lengths, prefix_partial=partial)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths, None, prefix_rows, prefix_lengths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the new K/V went to each row's slot
    own = gqa_decode_attention_reference(q, k_new, v_new, k_ref.clone(), v_ref.clone(), lengths)
    torch.testing.assert_close(out[5], own[5], rtol=1e-5, atol=1e-5)  # ungrouped row: its own slots
    assert not torch.allclose(out[2], own[2], atol=1e-3)  # row 2 attended to row 0's prompt slots


def test_prefix_partials_are_the_softmax_over_the_prompt_slots() -> None:
    """m, l, acc of a grouped row equal the plain computation over its group's first row."""
    q, _, _, k_cache, v_cache, _, _, prefix_lengths, group_rows = grouped_case(seed=1)
    m, l_sum, acc = prefix_partials(q, k_cache, v_cache, group_rows, prefix_lengths, block_n=16)
    for row, owner, prefix in ((0, 0, 10), (3, 0, 10), (1, 4, 7), (4, 4, 7)):
        grouped = q[row].float().view(2, 2, 16)  # [Hkv, group, D]
        scores = grouped @ k_cache[owner, :, :prefix].float().transpose(-1, -2) * 16**-0.5  # [Hkv, group, P]
        top = scores.amax(dim=-1)
        weights = torch.exp(scores - top[..., None])
        torch.testing.assert_close(m[row], top.reshape(4), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l_sum[row], weights.sum(-1).reshape(4), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(acc[row], (weights @ v_cache[owner, :, :prefix].float()).reshape(4, 16),
                                   rtol=1e-5, atol=1e-5)


def test_an_empty_group_is_skipped() -> None:
    """A chunk whose rows all left the step (all -1, as compaction leaves it) reads no row (its
    owner would be index -1) and changes nothing for the other groups."""
    q, _, _, k_cache, v_cache, _, _, prefix_lengths, group_rows = grouped_case(seed=2)
    base = prefix_partials(q, k_cache, v_cache, group_rows, prefix_lengths, block_n=16)
    padded = torch.cat([torch.full((1, 3), -1, device=DEVICE), group_rows])
    with_empty = prefix_partials(q, k_cache, v_cache, padded, prefix_lengths, block_n=16)
    for got, want in zip(with_empty, base):
        torch.testing.assert_close(got[[0, 1, 2, 3, 4]], want[[0, 1, 2, 3, 4]], rtol=0, atol=0)


def test_prefix_partials_reject_bad_group_rows() -> None:
    q, _, _, k_cache, v_cache, _, _, prefix_lengths, group_rows = grouped_case()
    with pytest.raises(ValueError, match="group_rows"):
        prefix_partials(q, k_cache, v_cache, group_rows[0], prefix_lengths)
    with pytest.raises(ValueError, match="group_rows"):
        prefix_partials(q, k_cache, v_cache, group_rows.to(torch.int32), prefix_lengths)


def test_decode_refuses_a_partial_it_cannot_use() -> None:
    q, k_new, v_new, k_cache, v_cache, lengths, prefix_rows, prefix_lengths, group_rows = grouped_case()
    partial = prefix_partials(q, k_cache, v_cache, group_rows, prefix_lengths, block_n=16)
    with pytest.raises(ValueError, match="needs prefix_lengths and no sliding_window"):
        gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, block_n=16, prefix_partial=partial)
    with pytest.raises(ValueError, match="needs prefix_lengths and no sliding_window"):
        gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, 4, block_n=16, prefix_rows=prefix_rows,
                             prefix_lengths=prefix_lengths, prefix_partial=partial)
    with pytest.raises(ValueError, match="contiguous float32"):
        gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, block_n=16, prefix_rows=prefix_rows,
                             prefix_lengths=prefix_lengths, prefix_partial=(partial[0], partial[1], partial[2][:, :2]))
    with pytest.raises(ValueError, match="prefix_partials"):
        prefix_partials(q, k_cache[:, :, :, :8], v_cache[:, :, :, :8], group_rows, prefix_lengths)
