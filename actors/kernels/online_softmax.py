"""The online-softmax steps the decode attention kernels share (Triton device functions).

`attend_blocks` walks cache slots [lo, hi) of one (sequence, KV head) in blocks of BLOCK_N and
folds them into a running softmax of a tile of query rows: max m [ROWS], normaliser l [ROWS],
unnormalised accumulator acc [ROWS, D], all float32. `merge_prefix` folds a partial computed
elsewhere (the shared prompt's, actors.kernels.prefix_attention) into such a running softmax.
Both run inside actors.kernels.decode_attention's and actors.kernels.prefix_attention's kernels.
"""

from __future__ import annotations

from actors.kernels.switch import triton_installed

if triton_installed():
    import triton
    import triton.language as tl

    @triton.jit
    def attend_blocks(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, cache, stride_cl, lo, hi, scale,
                       HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online softmax of the rows q [GROUP_PAD, D] over cache slots [lo, hi), carrying the running
        max m_i and normaliser l_i [GROUP_PAD] and the accumulator acc [GROUP_PAD, D] (float32).
        Every visited block holds slot `start` < hi, so each row's block max is finite and m_new is
        too: exp(m_i - m_new) is exp(-inf) = 0, never NaN, when m_i starts at -inf (empty split)."""
        dims = tl.arange(0, HEAD_DIM)
        for start in range(lo, hi, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            slot_ok = slots < hi
            offs = cache + slots[:, None] * stride_cl + dims[None, :]
            # An FP8 cache (GenerationConfig.kv_cache_dtype) is widened to the queries' dtype
            # as it is read: half the bytes from HBM, the products as with a bf16 cache.
            k = tl.load(k_cache_ptr + offs, mask=slot_ok[:, None], other=0.0).to(q.dtype)  # [BLOCK_N, D]
            v = tl.load(v_cache_ptr + offs, mask=slot_ok[:, None], other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            # Every product with `scale` is cast back: under torch.compile a float argument may
            # arrive as a float64 scalar, which would promote the loop-carried values.
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
        return m_i, l_i, acc

    @triton.jit
    def merge_prefix(m_i, l_i, acc, m_pre_ptr, l_pre_ptr, acc_pre_ptr, part, use, HEAD_DIM: tl.constexpr):
        """Fold a precomputed partial softmax (m, l, acc of query rows `part`, float32, where `use`)
        into the running one: M = max(m_i, m_pre), both scaled by exp(m - M) and added."""
        dims = tl.arange(0, HEAD_DIM)
        m_pre = tl.load(m_pre_ptr + part, mask=use, other=float("-inf"))
        l_pre = tl.load(l_pre_ptr + part, mask=use, other=0.0)
        acc_pre = tl.load(acc_pre_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=use[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_pre)  # m_i is finite (the new token), so no -inf - -inf
        alpha, beta = tl.exp(m_i - m_new), tl.exp(m_pre - m_new)
        return m_new, l_i * alpha + l_pre * beta, acc * alpha[:, None] + acc_pre * beta[:, None]
