"""Fused Triton kernels for token log-probabilities over (vocab-parallel) logits.

Why: over packed micro-batches of ~16k tokens and a 128k vocabulary, the torch path of
actors.engine.logprobs materialises several float32 [T, V_local] temporaries (logits.float(),
/ temperature, the max-shifted logits, their exp, the probabilities saved for backward), each a
full pass over ~8 GB of memory; together ~25 ms per micro-batch on an H200 in the forward pass
alone, and as much again in backward. These kernels read the bf16/fp16/fp32 logits once per pass:

- `logprob_row_stats` (forward): one program per row (token) walks the row in blocks with an
  online max / sum of exponentials in float32 over logits / temperature (entries where `allowed`
  is False count as -inf), and picks the target's scaled logit when this rank owns it. It returns
  per-row statistics only, [T] float32 each, so the tp group can combine them exactly
  (actors.engine.logprobs does: all-reduce MAX of m, then s * exp(m - M) all-reduce SUM).
- `logprob_grad` (backward): recomputes the probabilities from the logits and the global
  log-normaliser instead of keeping a float32 [T, V_local] probs tensor, and writes
  d logprob / d logits in the logits' dtype in the same pass.

The kernels need CUDA, or CPU tensors under Triton's interpreter (tests); see
actors.kernels.switch. The torch code in actors.engine.logprobs is the reference and CPU path.
Importing this module needs no triton: the kernels are defined only where it is installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.switch import triton_installed

# Columns per block: a [4096] float32 block is 16 KB of registers per program on the GPU, and a
# 128k-256k vocab row takes 32-64 iterations. Tests pass small blocks to keep the interpreter fast.
DEFAULT_BLOCK = 4096


# triton is optional (a CPU-only install has none): the kernels exist only where it imports, and
# the launchers below say so clearly when asked without it.
if triton_installed():
    import triton
    import triton.language as tl

    @triton.jit
    def _logprob_fwd_kernel(
        logits_ptr, allowed_ptr, target_ptr,  # [T, V] logits, [T, V] uint8 mask (if HAS_ALLOWED), [T] int64
        max_ptr, sumexp_ptr, picked_ptr,  # outputs, [T] float32 each
        n_cols, stride_logits, stride_allowed, temperature,
        HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits_ptr + row * stride_logits
        row_allowed = allowed_ptr + row * stride_allowed
        cols = tl.arange(0, BLOCK)
        m = float("-inf")  # running max of the scaled row
        s = 0.0  # running sum of exp(x - m)
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            in_row = idx < n_cols
            x = tl.load(row_logits + idx, mask=in_row, other=float("-inf")).to(tl.float32) / temperature
            if HAS_ALLOWED:
                keep = tl.load(row_allowed + idx, mask=in_row, other=0) != 0
                x = tl.where(keep, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # While every entry so far is masked, m_new = -inf: shift by 0 instead (exp(-inf) = 0, no NaN).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
            m = m_new
        tl.store(max_ptr + row, m)
        tl.store(sumexp_ptr + row, s)

        # The target's scaled logit, if its id falls in this rank's slice [0, n_cols); 0 otherwise.
        target = tl.load(target_ptr + row)
        owned = (target >= 0) & (target < n_cols)
        safe_target = tl.where(owned, target, 0)
        picked = tl.load(row_logits + safe_target, mask=owned, other=0.0).to(tl.float32) / temperature
        if HAS_ALLOWED:
            target_kept = tl.load(row_allowed + safe_target, mask=owned, other=1) != 0
            picked = tl.where(target_kept, picked, float("-inf"))
        tl.store(picked_ptr + row, picked)


    @triton.jit
    def _logprob_bwd_kernel(
        logits_ptr, allowed_ptr, target_ptr,  # [T, V] logits, [T, V] uint8 mask (if HAS_ALLOWED), [T] int64
        log_z_ptr, grad_ptr,  # [T] float32: global log-normaliser, incoming gradient
        out_ptr,  # [T, V] gradient w.r.t. the logits, logits dtype, contiguous
        n_cols, stride_logits, stride_allowed, stride_out, temperature,
        HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits_ptr + row * stride_logits
        row_allowed = allowed_ptr + row * stride_allowed
        row_out = out_ptr + row * stride_out
        log_z = tl.load(log_z_ptr + row)
        scale = tl.load(grad_ptr + row) / temperature  # d logprob / d scaled logit -> d / d logit
        target = tl.load(target_ptr + row)  # local index; outside [0, n_cols) when not owned
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            in_row = idx < n_cols
            x = tl.load(row_logits + idx, mask=in_row, other=0.0).to(tl.float32) / temperature
            p = tl.exp(x - log_z)
            if HAS_ALLOWED:
                keep = tl.load(row_allowed + idx, mask=in_row, other=0) != 0
                p = tl.where(keep, p, 0.0)
            onehot = tl.where(idx == target, 1.0, 0.0)
            g = (onehot - p) * scale
            tl.store(row_out + idx, g.to(out_ptr.dtype.element_ty), mask=in_row)


def _check_inputs(logits: Tensor, local_target: Tensor, allowed: Tensor | None) -> Tensor:
    """Validate shapes/layout; return the mask as a uint8 view (or the logits as a dummy pointer)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)}: need a 2-D tensor with contiguous rows")
    if local_target.shape != logits.shape[:1] or local_target.dtype != torch.int64:
        raise ValueError(f"local_target {tuple(local_target.shape)} {local_target.dtype}: need int64 [T]")
    if allowed is None:
        return logits  # never read: HAS_ALLOWED is False
    if allowed.shape != logits.shape or allowed.dtype != torch.bool or allowed.stride(-1) != 1:
        raise ValueError(f"allowed {tuple(allowed.shape)} {allowed.dtype}: need bool {tuple(logits.shape)}, "
                         "contiguous rows")
    return allowed.view(torch.uint8)


def _num_warps(block: int) -> int:
    """Warps per program for a block width (a power of two): 8 for wide blocks (16 float32 values
    per thread at 4096), else 4."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block}: must be a power of two")
    return 8 if block >= 2048 else 4


def logprob_row_stats(logits: Tensor, local_target: Tensor, temperature: float = 1.0,
                      allowed: Tensor | None = None, block: int = DEFAULT_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row softmax statistics of this rank's slice, in one read of the logits.

    logits [T, V_local] (bf16/fp16/fp32, rows contiguous), local_target int64 [T] (target id minus
    this rank's vocab offset; outside [0, V_local) when another rank owns it), allowed bool
    [T, V_local] or None. Returns float32 [T] each:
      m: max over allowed v of logits[t, v] / temperature (-inf if the whole slice is masked),
      s: sum over allowed v of exp(logits[t, v] / temperature - m) (0 if the whole slice is masked),
      picked: logits[t, target] / temperature where owned (-inf if the target is masked), else 0.
    """
    mask = _check_inputs(logits, local_target, allowed)
    rows, cols = logits.shape
    block = min(block, triton.next_power_of_2(max(cols, 1)))  # no wider than the row
    local_target = local_target.contiguous()
    m = torch.empty(rows, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    picked = torch.empty_like(m)
    if rows == 0:
        return m, s, picked
    _logprob_fwd_kernel[(rows,)](
        logits, mask, local_target, m, s, picked,
        cols, logits.stride(0), mask.stride(0), float(temperature),
        HAS_ALLOWED=allowed is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return m, s, picked


def logprob_grad(logits: Tensor, local_target: Tensor, log_z: Tensor, grad: Tensor, temperature: float = 1.0,
                 allowed: Tensor | None = None, block: int = DEFAULT_BLOCK) -> Tensor:
    """d (sum_t grad[t] * logprob[t]) / d logits, [T, V_local] in the logits' dtype.

    grad_logits[t, v] = (onehot(target_t)_v * owned_t - p_tv) * grad[t] / temperature with
    p_tv = exp(logits[t, v] / temperature - log_z[t]) (0 where not allowed). log_z float32 [T] is the
    log-normaliser over the full (all tp ranks) vocab; grad [T] the gradient of the logprobs.
    """
    mask = _check_inputs(logits, local_target, allowed)
    rows, cols = logits.shape
    block = min(block, triton.next_power_of_2(max(cols, 1)))
    out = torch.empty(rows, cols, dtype=logits.dtype, device=logits.device)
    if rows == 0 or cols == 0:
        return out
    _logprob_bwd_kernel[(rows,)](
        logits, mask, local_target.contiguous(), log_z.float().contiguous(), grad.float().contiguous(), out,
        cols, logits.stride(0), mask.stride(0), out.stride(0), float(temperature),
        HAS_ALLOWED=allowed is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return out


__all__ = ["DEFAULT_BLOCK", "logprob_grad", "logprob_row_stats"]
