"""A shared prompt's part of a decode step's attention, computed once per group of rows.

Why: GRPO-style generation samples R rows per prompt (the peer bench: 64 prompts x 8 rows), and
every row's query attends over the same prompt K/V. The decode kernel
(actors.kernels.decode_attention) can read those slots from the group's first row, but each of
the R programs still streams them (through L2 at best). Here one program per (group, KV head)
reads the prompt's K/V once and attends all R rows' queries to it in one tile (R * group query
heads as the rows of each tl.dot), and stores the unnormalised partial softmax of every query
row; the decode kernel then starts from that partial and reads only the row's own slots
(cascade attention; the merge is the split-K merge of two parts). Measured at the peer bench's
shape on an H200: 89.7 us a decode attention call against 104.4 us reading the shared row
(docs/benchmarks.md, issue 27, sixth step).

    q            [B, Hq, D]        the step's queries
    cache        [B, Hkv, L, D]    head-major K and V
    group_rows   int64 [G, R]      the rows of each group, -1 where a group has fewer than R
                                   (after the first; a group of all -1 is skipped: the
                                   table keeps its shape as rows leave the step); the first
                                   row holds the prompt's K/V in its slots
    prefix_lengths int64 [B]       the shared slots of each row (equal within a group)
    -> m, l      float32 [B, Hq]   running max and normaliser over slots [0, prefix)
       acc       float32 [B, Hq, D] unnormalised sum of exp(s - m) v

Rows outside every group are left unwritten: the decode kernel reads a row's partial only when
its prefix length is > 0, and such a row must be in a group. Every grouped row holds at least its
prompt (its length >= its prefix length), as every decoding row does. Sliding windows are not handled
(a window may cut into the prompt); the caller takes the plain path for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.decode_launch import kernel_supports_head_dim
from actors.kernels.switch import triton_installed

if triton_installed():
    import triton
    import triton.language as tl

    from actors.kernels.online_softmax import attend_blocks

    @triton.jit
    def _prefix_partial_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, group_rows_ptr, prefix_lengths_ptr, m_ptr, l_ptr, acc_ptr,
        stride_qb, stride_qh, stride_cb, stride_ch, stride_cl, stride_gg, scale,
        GROUP: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One (group g, KV head h): tile row i is query head h * GROUP + i % GROUP of the group's
        # row i // GROUP; the prompt's slots [0, prefix) come from the group's first row.
        g, h = tl.program_id(0), tl.program_id(1)
        tile = tl.arange(0, TILE)
        dims = tl.arange(0, HEAD_DIM)
        member = tile // GROUP
        head = h * GROUP + tile % GROUP
        rows = tl.load(group_rows_ptr + g * stride_gg + member, mask=tile < ROWS * GROUP, other=-1)
        ok = rows >= 0
        rows = tl.where(ok, rows, 0)
        q = tl.load(q_ptr + rows[:, None] * stride_qb + head[:, None] * stride_qh + dims[None, :],
                    mask=ok[:, None], other=0.0)  # [TILE, D]
        first = tl.load(group_rows_ptr + g * stride_gg)
        owner = tl.maximum(first, 0)  # a group left with no rows (all -1) attends nothing, stores nothing
        prefix = tl.where(first >= 0, tl.load(prefix_lengths_ptr + owner), 0).to(tl.int32)
        m_i = tl.full([TILE], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE], tl.float32)
        acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
        m_i, l_i, acc = attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, owner * stride_cb + h * stride_ch,
                                      stride_cl, 0, prefix, scale, HEAD_DIM, IEEE, BLOCK_N)
        part = rows * tl.num_programs(1) * GROUP + head  # [TILE] into the contiguous [B, Hq]
        tl.store(m_ptr + part, m_i, mask=ok)
        tl.store(l_ptr + part, l_i, mask=ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=ok[:, None])


def prefix_partials(q: Tensor, k_cache: Tensor, v_cache: Tensor, group_rows: Tensor, prefix_lengths: Tensor,
                    block_n: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """The partial softmax of every grouped row's queries over its shared prompt slots (shapes in
    the module docstring); launches one program per (group, KV head)."""
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_cache.shape[1]
    if group_rows.dim() != 2 or group_rows.dtype != torch.int64:
        raise ValueError(f"group_rows: {tuple(group_rows.shape)} {group_rows.dtype}; expected int64 [G, R]")
    if (k_cache.dim() != 4 or k_cache.shape[0] != n_seqs or k_cache.shape[3] != head_dim
            or v_cache.shape != k_cache.shape or n_q % n_kv or prefix_lengths.shape != (n_seqs,)):
        raise ValueError(f"prefix_partials: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, prefix_lengths {tuple(prefix_lengths.shape)}; expected [B, Hq, D], [B, Hkv, L, D] with "
                         "Hq a multiple of Hkv, and [B]")
    if not kernel_supports_head_dim(head_dim):
        raise ValueError(f"head_dim={head_dim}: the Triton kernels need a power of two >= 16")
    if q.stride(2) != 1:
        q = q.contiguous()
    group = n_q // n_kv
    n_groups, rows_per_group = group_rows.shape
    m = torch.empty(n_seqs, n_q, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(n_seqs, n_q, head_dim, dtype=torch.float32, device=q.device)
    tile = max(16, triton.next_power_of_2(rows_per_group * group))
    _prefix_partial_kernel[(n_groups, n_kv)](
        q, k_cache, v_cache, group_rows, prefix_lengths, m, l_sum, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), group_rows.stride(0),
        head_dim**-0.5, GROUP=group, ROWS=rows_per_group, TILE=tile, HEAD_DIM=head_dim,
        IEEE=q.dtype == torch.float32, BLOCK_N=block_n)
    return m, l_sum, acc


__all__ = ["prefix_partials"]
