"""Decode attention as Triton kernels: append the step's K/V to the cache and attend over each
sequence's own length, reading every cached K/V byte once.

Why: a decode step is memory-bound, and its attention must read the whole valid KV cache. The
fused SDPA kernels, tuned for long queries, reached ~30% of HBM bandwidth on an H200 for this
shape (1 query token, GQA group of 4, cache of a few hundred slots), and they read the padded
cache up to a common length. Here one program handles one (sequence, KV head):

    q      [B, Hq, D]        the step's queries (rotary applied); Hq = Hkv * group
    k_new  [B, Hkv, D]       the step's keys / values, written to slot lengths[b] of the cache
    cache  [B, Hkv, L, D]    head-major K and V (actors.generation.kv_cache), slots [0, lengths[b]) valid
    out    [B, Hq, D]

The program stores k_new/v_new at slot lengths[b], then runs an online softmax over the new
token (kept in registers, so no store->load ordering is needed) and the cache blocks
[lo, lengths[b]) with lo > lengths[b] - window under a sliding window. The `group` query heads of
the KV head form the rows of a [group_pad, D] tile (padded to 16 for tl.dot), so each K/V block
is loaded once for all of them. Lengths live on the device and the loop bound is read there, so
the kernel is CUDA-graph safe and one graph serves every length.

Split-K (flash-decoding): B * Hkv programs fill the GPU for a large batch, but a few long
sequences leave most multiprocessors idle while one program walks a cache of thousands of slots.
With `splits` = S > 1 the grid is (B, Hkv, S): split s reads slots [s * chunk, (s+1) * chunk)
clipped to [lo, lengths[b]) (chunk from the cache capacity L, a multiple of the block size, so
the launch depends on no length), split 0 also writes and attends to the new token, and each
stores its unnormalised partial (running max m, normaliser l, accumulator acc) in float32. A
second kernel merges the S partials of each query row: M = max m_s, w_s = exp(m_s - M),
out = sum w_s acc_s / sum w_s l_s (an empty split has m = -inf, so w = 0). `decode_splits`
(actors.kernels.decode_launch)
picks S from the shape and the GPU's multiprocessor count when it is not given.

Shared prompts: rows sampled from one prompt hold equal K/V in their first slots (the
prefill copies one forward's K/V into every row, actors.generation.prefill). With `prefix_rows`
and `prefix_lengths` (int64 [B]) a program reads slots [0, prefix_lengths[b]) from row
prefix_rows[b]'s cache instead of its own: the rows of a group read one copy, which their
programs (adjacent in the grid, so running together) can find in L2 instead of HBM. Slots from
prefix_lengths[b] on, and the new token, are the row's own. Better still, `prefix_partial`
gives the unsplit kernel those slots' partial softmax, computed once per group by
actors.kernels.prefix_attention (PREFIX_DONE): it then reads only the row's own slots.

`gqa_decode_attention_reference` is the plain-torch twin (tests compare the two; on CPU the
kernels run only in Triton's interpreter, see actors.kernels.switch). Lengths are not
advanced here: the cache does that after the whole forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.decode_launch import default_splits, kernel_supports_head_dim, slots_class
from actors.kernels.switch import triton_installed

if triton_installed():
    import triton
    import triton.language as tl

    from actors.kernels.online_softmax import attend_blocks, merge_prefix

    # Block size and launch shape are tuned on first use (CUDA; the key is below). Re-running a
    # config is harmless (it rewrites the same slot).
    _CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                for n, w, st in ((32, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (64, 2, 3))]
    # Split chunks are multiples of the largest block, hence of every tuned block size.
    _TUNED_CHUNK_ALIGN = max(c.kwargs["BLOCK_N"] for c in _CONFIGS)

    @triton.jit
    def _gqa_decode_kernel(
        q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, lengths_ptr, prefix_rows_ptr, prefix_lengths_ptr,
        m_pre_ptr, l_pre_ptr, acc_pre_ptr, out_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_ch, stride_cl,
        stride_ob, stride_oh, scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
        SLOTS_CLASS: tl.constexpr, PREFIX_DONE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < GROUP
        q_rows = q_ptr + b * stride_qb + (h * GROUP + rows)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=row_ok[:, None], other=0.0)  # [GROUP_PAD, D]
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)  # [D]
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        length = tl.load(lengths_ptr + b).to(tl.int32)  # valid cache slots before this step
        cache = b * stride_cb + h * stride_ch
        tl.store(k_cache_ptr + cache + length * stride_cl + dims, k_new.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + cache + length * stride_cl + dims, v_new.to(v_cache_ptr.dtype.element_ty))
        # The new token first: running max m, normaliser l and accumulator start from it alone.
        # Rounded to the cache dtype like the cached keys/values the reference reads back.
        k_self = k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
        v_self = v_new.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
        m_i = (tl.sum(q.to(tl.float32) * k_self[None, :], axis=1) * scale).to(tl.float32)  # [GROUP_PAD]
        l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + v_self[None, :]
        lo = tl.maximum(length - window + 1, 0)  # no window: window is 2**30, so lo = 0
        # The shared prompt's slots from the row holding it, then the row's own slots.
        prefix = tl.minimum(tl.load(prefix_lengths_ptr + b).to(tl.int32), length)
        if PREFIX_DONE:  # the shared slots' partial softmax is given (actors.kernels.prefix_attention)
            m_i, l_i, acc = merge_prefix(m_i, l_i, acc, m_pre_ptr, l_pre_ptr, acc_pre_ptr,
                                         (b * tl.num_programs(1) + h) * GROUP + rows, row_ok & (rows * 0 + prefix > 0),
                                         HEAD_DIM)
        else:
            shared = tl.load(prefix_rows_ptr + b) * stride_cb + h * stride_ch  # int64: rows * stride may pass 2**31
            m_i, l_i, acc = attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, shared, stride_cl, lo, prefix,
                                          scale, HEAD_DIM, IEEE, BLOCK_N)
        m_i, l_i, acc = attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, cache, stride_cl,
                                      tl.maximum(lo, prefix), length, scale, HEAD_DIM, IEEE, BLOCK_N)
        out = acc / l_i[:, None]
        out_rows = out_ptr + b * stride_ob + (h * GROUP + rows)[:, None] * stride_oh + dims[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _gqa_decode_split_kernel(
        q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, lengths_ptr, prefix_rows_ptr, prefix_lengths_ptr,
        m_ptr, l_ptr, acc_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_ch, stride_cl,
        scale, window, chunk,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
        SLOTS_CLASS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One (sequence b, KV head h, split s): slots [s * chunk, (s+1) * chunk) of [lo, length).
        # Partials m, l [B, Hq, S] and acc [B, Hq, S, D] (float32, contiguous), unnormalised.
        b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_splits = tl.num_programs(2)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < GROUP
        q = tl.load(q_ptr + b * stride_qb + (h * GROUP + rows)[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [GROUP_PAD, D]
        k_new = tl.load(k_new_ptr + b * stride_kb + h * stride_kh + dims)  # [D]
        v_new = tl.load(v_new_ptr + b * stride_vb + h * stride_vh + dims)
        length = tl.load(lengths_ptr + b).to(tl.int32)
        cache = b * stride_cb + h * stride_ch
        first = split == 0
        if first:  # only split 0 writes slot `length`; the others read slots < length, so no race
            tl.store(k_cache_ptr + cache + length * stride_cl + dims, k_new.to(k_cache_ptr.dtype.element_ty))
            tl.store(v_cache_ptr + cache + length * stride_cl + dims, v_new.to(v_cache_ptr.dtype.element_ty))
        # Split 0 starts from the new token (as _gqa_decode_kernel does), the others empty.
        k_self = k_new.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
        v_self = v_new.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
        m_self = (tl.sum(q.to(tl.float32) * k_self[None, :], axis=1) * scale).to(tl.float32)
        m_i = tl.where(first, m_self, float("-inf"))  # [GROUP_PAD]
        l_i = tl.zeros([GROUP_PAD], tl.float32) + first.to(tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + tl.where(first, v_self, 0.0)[None, :]
        lo = tl.maximum(tl.maximum(length - window + 1, 0), split * chunk)
        hi = tl.minimum(length, (split + 1) * chunk)
        prefix = tl.minimum(tl.load(prefix_lengths_ptr + b).to(tl.int32), hi)
        shared = tl.load(prefix_rows_ptr + b) * stride_cb + h * stride_ch  # int64: rows * stride may pass 2**31
        m_i, l_i, acc = attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, shared, stride_cl, lo, prefix,
                                      scale, HEAD_DIM, IEEE, BLOCK_N)
        m_i, l_i, acc = attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, cache, stride_cl,
                                      tl.maximum(lo, prefix), hi, scale, HEAD_DIM, IEEE, BLOCK_N)
        part = ((b * tl.num_programs(1) + h) * GROUP + rows) * n_splits + split  # [GROUP_PAD]
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _combine_splits_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, n_splits,
                               HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
        # One query row (b * Hq + head) of the contiguous out [B, Hq, D]: merge its S partials.
        row = tl.program_id(0)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        ok = splits < n_splits
        part = row * n_splits + splits
        m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))  # [SPLITS_PAD]
        l_s = tl.load(l_ptr + part, mask=ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))  # split 0 holds the new token: the max is finite
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_s, axis=0)  # [D]
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))

    # Both tuned on their first call per (group, head_dim, slots class): the best block size moves
    # with the slots one program reads (benchmarks/decode_attention_bench.py). SLOTS_CLASS is the
    # bit length of that count (the capacity, or the split's chunk), so a new cache capacity
    # re-tunes only when it doubles, and the first shape's choice no longer serves every later one.
    _TUNE_KEY = ["GROUP", "HEAD_DIM", "SLOTS_CLASS"]
    _gqa_decode_tuned = triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)(_gqa_decode_kernel)
    # After a prefix partial the first call (a generation's first step, at the prompt's length)
    # reads no slots of its own, so tuning there picks by noise: the candidates are the ones
    # within 2.5% of the best across the peer bench's lengths (benchmarks/prefix_attention_bench.py).
    _AFTER_PREFIX_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=2, num_stages=st)
                             for n, st in ((32, 3), (32, 4), (64, 2), (64, 3))]
    _gqa_decode_after_prefix_tuned = triton.autotune(configs=_AFTER_PREFIX_CONFIGS, key=_TUNE_KEY)(_gqa_decode_kernel)
    _gqa_decode_split_tuned = triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)(_gqa_decode_split_kernel)


def _check_shapes(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> None:
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_new.shape[1]
    if k_new.shape != (n_seqs, n_kv, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new: shapes {tuple(k_new.shape)}/{tuple(v_new.shape)}; expected [{n_seqs}, Hkv, {head_dim}]")
    if k_cache.dim() != 4 or k_cache.shape[:2] != (n_seqs, n_kv) or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}; expected [{n_seqs}, {n_kv}, L, {head_dim}]")
    if v_cache.shape != k_cache.shape or lengths.shape != (n_seqs,):
        raise ValueError(f"v_cache {tuple(v_cache.shape)} / lengths {tuple(lengths.shape)}: must match k_cache / [{n_seqs}]")
    if n_q % n_kv:
        raise ValueError(f"query heads {n_q} not a multiple of KV heads {n_kv}")


def gqa_decode_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                         lengths: Tensor, sliding_window: int | None = None, block_n: int | None = None,
                         splits: int | None = None, prefix_rows: Tensor | None = None,
                         prefix_lengths: Tensor | None = None,
                         prefix_partial: tuple[Tensor, Tensor, Tensor] | None = None,
                         launch: dict[str, int] | None = None) -> Tensor:
    """Write k_new/v_new at slot lengths[b] of the caches and attend; returns [B, Hq, D] in q's
    dtype (shapes in the module docstring). Runs the Triton kernels (CUDA, or CPU under the
    interpreter); head_dim must be a power of two >= 16 and every cache must have room.
    block_n: cache slots per loop step; None autotunes on CUDA (64 in the interpreter).
    splits: programs per (sequence, KV head), 1 for the unsplit kernel; None: `decode_splits` of
    the shape on CUDA when autotuning, else 1. prefix_rows / prefix_lengths: int64 [B], the row
    whose cache slots [0, prefix_lengths[b]) row b reads (shared prompts; None: its own).
    prefix_partial: (m, l, acc) of those slots from actors.kernels.prefix_attention, which the
    unsplit kernel then starts from instead of reading them (the split kernel reads them itself).
    launch: num_warps / num_stages for an untuned launch (benchmarks' config sweeps)."""
    _check_shapes(q, k_new, v_new, k_cache, v_cache, lengths)
    _check_partial(q, prefix_partial, prefix_lengths, sliding_window)
    prefix_rows, prefix_lengths = _prefix_args(q.shape[0], lengths, prefix_rows, prefix_lengths)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits={splits!r}: must be a positive integer, or None to choose from the shape")
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_new.shape[1]
    if not kernel_supports_head_dim(head_dim):
        raise ValueError(f"head_dim={head_dim}: the Triton decode kernel needs a power of two >= 16")
    # Any batch/head strides (e.g. slices of a fused projection), but unit strides along head_dim.
    q, k_new, v_new = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k_new, v_new))
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("gqa_decode_attention: the K/V caches need the same strides and a unit last stride")
    tuned = block_n is None and q.device.type == "cuda"
    if splits is None:
        splits = default_splits(n_seqs, n_kv, k_cache.shape[2], q.device) if tuned else 1
    out = torch.empty(n_seqs, n_q, head_dim, dtype=q.dtype, device=q.device)
    inputs = (q, k_new, v_new, k_cache, v_cache, lengths, prefix_rows, prefix_lengths)
    strides = (q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    group = n_q // n_kv
    meta = {"GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "HEAD_DIM": head_dim,
            "IEEE": q.dtype == torch.float32, "SLOTS_CLASS": slots_class(k_cache.shape[2])}
    scale, window = head_dim**-0.5, sliding_window or 2**30
    if splits > 1:
        _split_decode(inputs, strides, out, scale, window, splits, block_n, tuned, meta)
        return out
    meta["PREFIX_DONE"] = prefix_partial is not None
    partial = prefix_partial if prefix_partial is not None else (lengths, lengths, lengths)  # unread when not done
    if tuned:
        tuner = _gqa_decode_tuned if prefix_partial is None else _gqa_decode_after_prefix_tuned
        tuner[(n_seqs, n_kv)](*inputs, *partial, out, *strides, out.stride(0), out.stride(1), scale, window, **meta)
    else:
        _gqa_decode_kernel[(n_seqs, n_kv)](*inputs, *partial, out, *strides, out.stride(0), out.stride(1), scale,
                                           window, **meta, BLOCK_N=block_n or 64, **(launch or {}))
    return out


def _check_partial(q: Tensor, partial: tuple[Tensor, Tensor, Tensor] | None, prefix_lengths: Tensor | None,
                   sliding_window: int | None) -> None:
    """A prefix partial needs the prefix lengths (which rows use it), no window (it covers the
    whole prompt) and float32 contiguous m, l [B, Hq] and acc [B, Hq, D]."""
    if partial is None:
        return
    if prefix_lengths is None or sliding_window is not None:
        raise ValueError("prefix_partial: needs prefix_lengths and no sliding_window "
                         f"(got prefix_lengths={'set' if prefix_lengths is not None else None}, "
                         f"sliding_window={sliding_window})")
    shapes = (q.shape[:2], q.shape[:2], q.shape)
    if any(t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous()
           for t, shape in zip(partial, shapes, strict=True)):
        raise ValueError(f"prefix_partial: m, l, acc must be contiguous float32 {list(q.shape[:2])}, "
                         f"{list(q.shape[:2])}, {list(q.shape)}; got "
                         + ", ".join(f"{t.dtype} {list(t.shape)}" for t in partial))


def _prefix_args(n_seqs: int, lengths: Tensor, prefix_rows: Tensor | None,
                 prefix_lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """The shared-prompt arguments, checked; without them every row reads only its own cache
    (its own row, no shared slots)."""
    if (prefix_rows is None) != (prefix_lengths is None):
        raise ValueError("prefix_rows and prefix_lengths: give both or neither")
    if prefix_rows is None or prefix_lengths is None:
        return torch.arange(n_seqs, device=lengths.device), torch.zeros_like(lengths)
    if prefix_rows.shape != (n_seqs,) or prefix_lengths.shape != (n_seqs,):
        raise ValueError(f"prefix_rows {tuple(prefix_rows.shape)} / prefix_lengths {tuple(prefix_lengths.shape)}: "
                         f"must be [{n_seqs}]")
    return prefix_rows, prefix_lengths


def _split_decode(inputs: tuple[Tensor, ...], strides: tuple[int, ...], out: Tensor, scale: float, window: int,
                  splits: int, block_n: int | None, tuned: bool, meta: dict[str, object]) -> None:
    """The split-K path into `out` (contiguous [B, Hq, D]): partials of every split, then the merge."""
    n_seqs, n_q, head_dim = out.shape
    n_kv, capacity = inputs[3].shape[1], inputs[3].shape[2]  # k_cache [B, Hkv, L, D]
    # chunk: ceil(capacity / splits) slots rounded up to the block size (the largest tuned one on
    # CUDA), so every split but the last starts on a block boundary; fixed by the capacity alone.
    align = _TUNED_CHUNK_ALIGN if tuned else block_n or 64
    per_split = -(-capacity // splits)
    chunk = -(-per_split // align) * align
    m_part = torch.empty(n_seqs, n_q, splits, dtype=torch.float32, device=out.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(n_seqs, n_q, splits, head_dim, dtype=torch.float32, device=out.device)
    grid = (n_seqs, n_kv, splits)
    meta = {**meta, "SLOTS_CLASS": slots_class(chunk)}
    if tuned:
        _gqa_decode_split_tuned[grid](*inputs, m_part, l_part, acc_part, *strides, scale, window, chunk, **meta)
    else:
        _gqa_decode_split_kernel[grid](*inputs, m_part, l_part, acc_part, *strides, scale, window, chunk, **meta,
                                       BLOCK_N=block_n or 64)
    _combine_splits_kernel[(n_seqs * n_q,)](m_part, l_part, acc_part, out, splits,
                                            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits))


def gqa_decode_attention_reference(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                                   lengths: Tensor, sliding_window: int | None = None,
                                   prefix_rows: Tensor | None = None, prefix_lengths: Tensor | None = None) -> Tensor:
    """The plain-torch twin of `gqa_decode_attention` (same writes, same result)."""
    _check_shapes(q, k_new, v_new, k_cache, v_cache, lengths)
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_new.shape[1]
    prefix_rows, prefix_lengths = _prefix_args(n_seqs, lengths, prefix_rows, prefix_lengths)
    rows = torch.arange(n_seqs, device=q.device)
    k_cache[rows, :, lengths] = k_new.to(k_cache.dtype)
    v_cache[rows, :, lengths] = v_new.to(v_cache.dtype)
    slots = torch.arange(k_cache.shape[2], device=q.device)
    # What each row reads: slots below its prefix length (never the new token's) from its
    # prefix row, [B, Hkv, L, D].
    from_prefix = (slots[None, :] < torch.minimum(prefix_lengths, lengths)[:, None])[:, None, :, None]
    k_cache = torch.where(from_prefix, k_cache[prefix_rows], k_cache)
    v_cache = torch.where(from_prefix, v_cache[prefix_rows], v_cache)
    visible = slots[None, :] <= lengths[:, None]  # [B, L]
    if sliding_window is not None:
        visible &= slots[None, :] > lengths[:, None] - sliding_window
    grouped = q.float().view(n_seqs, n_kv, n_q // n_kv, head_dim)  # [B, Hkv, group, D]
    scores = torch.matmul(grouped, k_cache.float().transpose(-1, -2)) * head_dim**-0.5  # [B, Hkv, group, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v_cache.float())  # [B, Hkv, group, D]
    return out.reshape(n_seqs, n_q, head_dim).to(q.dtype)


__all__ = [
    "gqa_decode_attention", "gqa_decode_attention_reference",
]
