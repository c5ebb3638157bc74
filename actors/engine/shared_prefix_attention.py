"""Attention over a compact stream of shared prefixes and their rows' suffixes (training too).

The stream (actors.engine.shared_prefix) is [prefixes | suffixes]: each prefix and each suffix
is causal within itself, and a suffix token also sees its group's whole prefix. On CUDA that is
one FlashAttention varlen call (`history_attention`): each suffix's keys are gathered as its
row whole (its group's prefix, then itself; `PrefixSpans.history`) and the mask is causal aligned
at the bottom right, so a prefix's queries run once and its keys once per row. Elsewhere (the
"sdpa" backend) one SDPA call with the stream's dense mask.

Until the fifteenth step of issue 27 the CUDA path was a cascade, kept here for
benchmarks/train_attention_bench.py to compare against (one peer-bench micro-batch on an H200,
forward + backward of one layer: the cascade 1.89 ms, FlashAttention over the rows whole 1.48 ms,
the one call's kernels on gathered K/V 1.46 ms, and the one call 2.10 ms while its gather's
backward widened every gathered row to float32; seventeenth step):

  self:  causal attention of every token within its own sequence of the stream -> (o_s, lse_s)
  cross: each group's suffix tokens (all its rows, one query sequence) over its prefix, no mask
         -> (o_x, lse_x)
  merge: lse = log(exp(lse_s) + exp(lse_x)); o = o_s exp(lse_s - lse) + o_x exp(lse_x - lse)

The backward needs no gradient of the lse: FlashAttention's backward of each part, given the
MERGED output and lse, recomputes exactly the probabilities of the full softmax over that part's
keys and the row term D = rowsum(dO * O) of the full attention, so the two backward calls' dQ
add up to the full dQ and each gives its keys' dK, dV (as ring attention does across devices).
`CascadeKernels` holds the forward and backward primitives: torch's FlashAttention ops on CUDA,
and a dense float32 reference (`REFERENCE_KERNELS`) that the CPU tests run the same cascade with.

Shapes: q [T_c, Hq, D]; k, v [T_c, Hkv, D]; lse [Hq, T] float32 (FlashAttention's varlen layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from actors.engine.attention import attention_over_history, packed_causal_mask, resolve_backend
from actors.engine.fusion import fused
from actors.engine.packing import PackedBatch, PrefixSpans

# (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse [Hq, T_q], rng state)
ForwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool, float], tuple[Tensor, Tensor, Tensor]]
# (d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng state) -> (dq, dk, dv)
BackwardFn = Callable[..., tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class CascadeKernels:
    """Varlen attention forward (with lse) and backward (given out and lse) primitives, and the
    merge of two partial results (`merge_partials`, or the same compiled into one kernel)."""

    forward: ForwardFn
    backward: BackwardFn
    merge: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def merge_partials(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two key sets from each set's output [T, H, D] and lse [H, T]:
    (output [T, H, D] in o_a's dtype, lse [H, T] in the lse's dtype)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = (lse_a - lse).exp().transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    weight_b = (lse_b - lse).exp().transpose(0, 1).unsqueeze(-1)
    work = _work_dtype(o_a)
    return (o_a.to(work) * weight_a + o_b.to(work) * weight_b).to(o_a.dtype), lse


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                   causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"FlashAttention returned lse of shape {tuple(lse.shape)}; the shared-prefix cascade "
                           f"expects [heads, tokens] = {(q.shape[1], q.shape[0])} (set the call's "
                           "share_prompts: false to run without it)")
    return out, lse, rng


def _flash_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                    cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                    rng: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)
    return dq, dk, dv


def _fused_merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    # Eager, the merge is ~10 elementwise passes over [T, H, D] (float32 copies, products, the
    # sum, the cast): 0.8 ms per layer and micro-batch at the peer bench's shape. Fused, one
    # kernel reads both partials and writes the result; tokens are dim 0 of the outputs [T, H, D]
    # and dim 1 of the lse [H, T].
    return fused(merge_partials, (0, 1, 0, 1))(o_a, lse_a, o_b, lse_b)


FLASH_KERNELS = CascadeKernels(_flash_forward, _flash_backward, _fused_merge)


def _work_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs (the tests), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reference_scores(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool,
                      scale: float) -> tuple[Tensor, Tensor]:
    """(scaled scores [Hq, T_q, T_k] in float32 or float64, -inf where hidden; k repeated to Hq heads) with
    FlashAttention's varlen masking: same sequence and, with `causal`, key j <= query i aligned
    at the bottom right."""
    seq_q = torch.searchsorted(cu_q[1:].contiguous(), torch.arange(q.shape[0], dtype=cu_q.dtype), right=True)
    seq_k = torch.searchsorted(cu_k[1:].contiguous(), torch.arange(k.shape[0], dtype=cu_k.dtype), right=True)
    n_q, n_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    pos_q = torch.arange(q.shape[0]) - cu_q[:-1].long()[seq_q] + (n_k - n_q)[seq_q]
    pos_k = torch.arange(k.shape[0]) - cu_k[:-1].long()[seq_k]
    visible = seq_q[:, None] == seq_k[None, :]
    if causal:
        visible &= pos_k[None, :] <= pos_q[:, None]
    k_full = k.to(_work_dtype(q)).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(_work_dtype(q)), k_full) * scale
    return scores.masked_fill(~visible, float("-inf")), k_full


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                       causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    scores, _ = _reference_scores(q, k, cu_q, cu_k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T_q]
    v_full = v.to(_work_dtype(q)).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", (scores - lse.unsqueeze(-1)).exp(), v_full)
    return out.to(q.dtype), lse, torch.zeros(2)


def _reference_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                        cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                        rng: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention's backward from the given out and lse: P = exp(S - lse), D = rowsum(dO * O),
    dS = P (dP - D); dK, dV summed over each KV head's query heads."""
    scores, k_full = _reference_scores(q, k, cu_q, cu_k, causal, scale)
    probs = (scores - lse.unsqueeze(-1)).exp()  # [Hq, T_q, T_k]
    group = q.shape[1] // k.shape[1]
    v_full = v.to(_work_dtype(q)).repeat_interleave(group, dim=1)
    d_o = d_out.to(_work_dtype(q))
    d_probs = torch.einsum("qhd,khd->hqk", d_o, v_full)
    row_term = (d_o * out.to(_work_dtype(q))).sum(-1).transpose(0, 1)  # D [Hq, T_q]
    d_scores = probs * (d_probs - row_term.unsqueeze(-1)) * scale
    dq = torch.einsum("hqk,khd->qhd", d_scores, k_full)
    dk = torch.einsum("hqk,qhd->khd", d_scores, q.to(_work_dtype(q))).unflatten(1, (k.shape[1], group)).sum(2)
    dv = torch.einsum("hqk,qhd->khd", probs, d_o).unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE_KERNELS = CascadeKernels(_reference_forward, _reference_backward, merge_partials)


class _CascadeAttention(torch.autograd.Function):
    """Self + cross attention of a compact stream, merged; backward from the merged out and lse."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch,
                kernels: CascadeKernels) -> Tensor:
        spans = batch.shared_prefix
        assert spans is not None
        n_p, scale = spans.n_prefix_tokens, q.shape[-1] ** -0.5
        out, lse, rng = kernels.forward(q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen,
                                        batch.max_seqlen, True, scale)
        o_x, lse_x, rng_x = kernels.forward(q[n_p:], k[:n_p], v[:n_p], spans.cu_suffix, spans.cu_prefix,
                                            spans.max_group_suffix, spans.max_prefix, False, scale)
        merged, merged_lse = kernels.merge(out[n_p:], lse[:, n_p:], o_x, lse_x)
        out[n_p:] = merged
        lse[:, n_p:] = merged_lse
        ctx.save_for_backward(q, k, v, out, lse, rng, rng_x)
        ctx.batch, ctx.kernels, ctx.scale = batch, kernels, scale
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, rng, rng_x = ctx.saved_tensors
        batch, kernels, scale = ctx.batch, ctx.kernels, ctx.scale
        spans = batch.shared_prefix
        n_p = spans.n_prefix_tokens
        d_out = d_out.contiguous()
        dq, dk, dv = kernels.backward(d_out, q, k, v, out, lse, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen,
                                      batch.max_seqlen, True, scale, rng)
        dq_x, dk_x, dv_x = kernels.backward(d_out[n_p:], q[n_p:], k[:n_p], v[:n_p], out[n_p:],
                                            lse[:, n_p:].contiguous(), spans.cu_suffix, spans.cu_prefix,
                                            spans.max_group_suffix, spans.max_prefix, False, scale, rng_x)
        dq[n_p:] += dq_x
        dk[:n_p] += dk_x
        dv[:n_p] += dv_x
        return dq, dk, dv, None, None


def cascade_attention(q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, kernels: CascadeKernels) -> Tensor:
    """[T_c, Hq, D] attention of a compact stream with these primitives (module docstring)."""
    if batch.shared_prefix is None:
        raise ValueError("cascade_attention: the packed batch has no shared_prefix spans")
    return _CascadeAttention.apply(q, k, v, batch, kernels)


class _GatherHistory(torch.autograd.Function):
    """(k[spans.history], v[spans.history]) along dim 0: every sequence's keys and values of the
    compact stream [T_c, H, D] -> [T_k, H, D], one node for both so the index work is done once.
    Backward: a suffix token occurs once, so its gradient is copied (in the gradient's dtype,
    exact); a prefix token occurs once per row of its group and once as its own sequence, so its
    gradients are summed in float32 (summed in bf16 they would round at each add). Only those
    T_k - (T_c - n_prefix) rows are widened: summing all T_k rows in float32 took ~0.2 ms of the
    layer's 1.8 ms on an H200 (issue 27, seventeenth step)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, k: Tensor, v: Tensor,
                spans: PrefixSpans) -> tuple[Tensor, Tensor]:
        ctx.spans, ctx.n_tokens = spans, k.shape[0]
        return k.index_select(0, spans.history), v.index_select(0, spans.history)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_k: Tensor,
                 grad_v: Tensor) -> tuple[Tensor, Tensor, None]:
        spans: PrefixSpans = ctx.spans
        n_p = spans.n_prefix_tokens
        n_repeated = grad_k.shape[0] - (ctx.n_tokens - n_p)  # occurrences of prefix tokens in `history`
        repeated, once = spans.history_order[:n_repeated], spans.history_order[n_repeated:]
        prefix_token = spans.history_sorted[:n_repeated]  # which token each of `repeated` is
        grads = []
        for grad in (grad_k, grad_v):
            out = grad.new_empty((ctx.n_tokens, *grad.shape[1:]))
            out[n_p:] = grad.index_select(0, once)  # suffix tokens, in stream order
            summed = torch.zeros((n_p, *grad.shape[1:]), dtype=_work_dtype(grad), device=grad.device)
            out[:n_p] = summed.index_add_(0, prefix_token, grad.index_select(0, repeated).to(summed.dtype))
            grads.append(out)
        return grads[0], grads[1], None


def history_attention(q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch) -> Tensor:
    """[T_c, Hq, D] attention of a compact stream in one varlen call: K/V gathered per sequence
    (a suffix's keys are its group's prefix, then its own tokens: `PrefixSpans.history`), causal
    aligned at the bottom right. Against the cascade (two FlashAttention calls and a merge) it
    computes the prefix keys' scores once per row instead of once per group, in one kernel whose
    backward has every row's work in parallel; the cascade's cross call over a group's 4,096
    completion tokens and 128 prompt keys is what made it slower (fifteenth step's bench)."""
    spans = batch.shared_prefix
    if spans is None:
        raise ValueError("history_attention: the packed batch has no shared_prefix spans")
    k_rows, v_rows = _GatherHistory.apply(k, v, spans)  # [T_k, Hkv, D] each
    return attention_over_history(q, k_rows, v_rows, batch.cu_seqlens, spans.cu_history, batch.max_seqlen,
                                  spans.max_history)


def shared_prefix_mask(batch: PackedBatch) -> Tensor:
    """bool [T_c, T_c]: causal within each sequence of the stream, plus suffix -> own group's prefix."""
    spans = batch.shared_prefix
    assert spans is not None
    n_p = spans.n_prefix_tokens
    index = torch.arange(batch.n_tokens, device=batch.device, dtype=torch.int32)
    is_prefix = index < n_p
    group = torch.where(is_prefix,
                        torch.searchsorted(spans.cu_prefix[1:].contiguous(), index, right=True),
                        torch.searchsorted(spans.cu_suffix[1:].contiguous(), index - n_p, right=True))
    cross = ~is_prefix[:, None] & is_prefix[None, :] & (group[:, None] == group[None, :])
    return packed_causal_mask(batch) | cross


def shared_prefix_attention(q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, backend: str = "auto",
                            kv_index: Tensor | None = None) -> Tensor:
    """Attention of a compact stream of shared prefixes and suffixes; q [T_c, Hq, D], k, v
    [T_c, Hkv, D] (or any Hkv with `kv_index` [Hq]). Returns [T_c, Hq, D]."""
    if kv_index is not None:
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    name = resolve_backend(backend, q.device, q.dtype)
    if name in ("varlen", "flash"):
        return history_attention(q, k, v, batch)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=shared_prefix_mask(batch), scale=q.shape[-1] ** -0.5, enable_gqa=k.shape[1] != q.shape[1])
    return out.squeeze(0).transpose(0, 1)


__all__ = [
    "FLASH_KERNELS", "REFERENCE_KERNELS", "CascadeKernels", "cascade_attention", "merge_partials",
    "history_attention", "shared_prefix_attention", "shared_prefix_mask",
]
