"""Decode attention as one Triton kernel: append the step's K/V to the cache and attend over each
sequence's own length, reading every cached K/V byte once.

Why: a decode step is memory-bound, and its attention must read the whole valid KV cache. The
fused SDPA kernels, tuned for long queries, reached ~30% of HBM bandwidth on an H200 for this
shape (1 query token, GQA group of 4, cache of a few hundred slots), and they read the padded
cache up to a common length. Here one program handles one (sequence, KV head):

    q      [B, Hq, D]        the step's queries (rotary applied); Hq = Hkv * group
    k_new  [B, Hkv, D]       the step's keys / values, written to slot lengths[b] of the cache
    cache  [B, Hkv, L, D]    head-major K and V (actors.generation.kv_cache), slots [0, lengths[b]) valid
    out    [B, Hq, D]

The program stores k_new/v_new at slot lengths[b], then runs an online softmax (flash-decoding
without the split) over the new token (kept in registers, so no store->load ordering is needed)
and the cache blocks [lo, lengths[b]) with lo > lengths[b] - window under a sliding window. The
`group` query heads of the KV head form the rows of a [group_pad, D] tile (padded to 16 for
tl.dot), so each K/V block is loaded once for all of them. Lengths live on the device and the
loop bound is read there, so the kernel is CUDA-graph safe and one graph serves every length.

`gqa_decode_attention_reference` is the plain-torch twin (tests compare the two; on CPU the
kernel runs only in Triton's interpreter, see actors.kernels.switch). Lengths are not
advanced here: the cache does that after the whole forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.switch import triton_installed

if triton_installed():
    import triton
    import triton.language as tl

    # Block size and launch shape are tuned once per (group, head_dim) on first use (CUDA): the
    # best choice moves with the GPU. Re-running a config is harmless (it rewrites the same slot).
    _CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                for n, w, st in ((32, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (64, 2, 3))]

    @triton.jit
    def _gqa_decode_kernel(
        q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, lengths_ptr, out_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_ch, stride_cl,
        stride_ob, stride_oh, scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_N: tl.constexpr,
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
        # Every product with `scale` is cast back: under torch.compile a float argument may
        # arrive as a float64 scalar, which would promote the loop-carried values.
        m_i = (tl.sum(q.to(tl.float32) * k_self[None, :], axis=1) * scale).to(tl.float32)  # [GROUP_PAD]
        l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + v_self[None, :]
        lo = tl.maximum(length - window + 1, 0)  # no window: window is 2**30, so lo = 0
        for start in range(lo, length, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            slot_ok = slots < length
            offs = cache + slots[:, None] * stride_cl + dims[None, :]
            k = tl.load(k_cache_ptr + offs, mask=slot_ok[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_cache_ptr + offs, mask=slot_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where(slot_ok[None, :], (s * scale).to(tl.float32), float("-inf"))  # [GROUP_PAD, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        out_rows = out_ptr + b * stride_ob + (h * GROUP + rows)[:, None] * stride_oh + dims[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    _gqa_decode_tuned = triton.autotune(configs=_CONFIGS, key=["GROUP", "HEAD_DIM"])(_gqa_decode_kernel)


def kernel_supports_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernel handles `head_dim` (tl.arange needs a power of two; the MMA a
    size of at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


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
                         lengths: Tensor, sliding_window: int | None = None, block_n: int | None = None) -> Tensor:
    """Write k_new/v_new at slot lengths[b] of the caches and attend; returns [B, Hq, D] in q's
    dtype (shapes in the module docstring). Runs the Triton kernel (CUDA, or CPU under the
    interpreter); head_dim must be a power of two >= 16 and every cache must have room.
    block_n: cache slots per loop step; None autotunes on CUDA (64 in the interpreter)."""
    _check_shapes(q, k_new, v_new, k_cache, v_cache, lengths)
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_new.shape[1]
    group = n_q // n_kv
    if not kernel_supports_head_dim(head_dim):
        raise ValueError(f"head_dim={head_dim}: the Triton decode kernel needs a power of two >= 16")
    # Any batch/head strides (e.g. slices of a fused projection), but unit strides along head_dim.
    q, k_new, v_new = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k_new, v_new))
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("gqa_decode_attention: the K/V caches need the same strides and a unit last stride")
    out = torch.empty(n_seqs, n_q, head_dim, dtype=q.dtype, device=q.device)
    args = (q, k_new, v_new, k_cache, v_cache, lengths, out,
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
            head_dim**-0.5, sliding_window or 2**30)
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                IEEE=k_cache.dtype == torch.float32)
    if block_n is None and q.device.type == "cuda":
        _gqa_decode_tuned[(n_seqs, n_kv)](*args, **meta)
    else:
        _gqa_decode_kernel[(n_seqs, n_kv)](*args, **meta, BLOCK_N=block_n or 64)
    return out


def gqa_decode_attention_reference(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                                   lengths: Tensor, sliding_window: int | None = None) -> Tensor:
    """The plain-torch twin of `gqa_decode_attention` (same writes, same result)."""
    _check_shapes(q, k_new, v_new, k_cache, v_cache, lengths)
    n_seqs, n_q, head_dim = q.shape
    n_kv = k_new.shape[1]
    rows = torch.arange(n_seqs, device=q.device)
    k_cache[rows, :, lengths] = k_new.to(k_cache.dtype)
    v_cache[rows, :, lengths] = v_new.to(v_cache.dtype)
    slots = torch.arange(k_cache.shape[2], device=q.device)
    visible = slots[None, :] <= lengths[:, None]  # [B, L]
    if sliding_window is not None:
        visible &= slots[None, :] > lengths[:, None] - sliding_window
    grouped = q.float().view(n_seqs, n_kv, n_q // n_kv, head_dim)  # [B, Hkv, group, D]
    scores = torch.matmul(grouped, k_cache.float().transpose(-1, -2)) * head_dim**-0.5  # [B, Hkv, group, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v_cache.float())  # [B, Hkv, group, D]
    return out.reshape(n_seqs, n_q, head_dim).to(q.dtype)


__all__ = ["gqa_decode_attention", "gqa_decode_attention_reference"]
