"""Token log-probabilities and entropy from vocab-parallel logits, without gathering the vocab.

Under tensor parallelism the head's logits stay split along the vocabulary: tp rank r holds
logits [T, V_local] for token ids [r * V_local, (r + 1) * V_local). The softmax statistics are
combined with three all-reduces over the tp group (max, sum of exponentials, the target's logit
picked on the rank that owns it) so memory stays [T, V_local] per rank. Both functions are custom
autograd Functions with hand-written backward passes; with group None (or tp size 1) they reduce
to the ordinary serial computation.

Sampling distribution: `temperature` divides the logits, and `allowed` (bool [T, V_local], True
where top-k/top-p sampling kept the token) masks the rest to -inf, so train-time logprobs can
use the distribution the tokens were sampled from. Every row must allow at least one token.

Fast path: on CUDA (actors.kernels.switch `triton_on`) the logprob uses the fused Triton kernels
of actors.kernels.fused_logprobs. They read the logits once per pass and return per-row (max, sum of
exp) of the local slice, combined across the tp group exactly; backward recomputes the
probabilities from the saved logits instead of keeping a float32 [T, V_local] probs tensor. The
torch code here is the reference and the CPU path. Neither path saves anything for backward
when no gradient is wanted (inference).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from actors.engine.process_groups import group_rank, group_size
from actors.kernels import triton_on, triton_runs


def _all_reduce(x: Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _check_temperature_and_mask(logits: Tensor, temperature: float, allowed: Tensor | None) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if allowed is not None and allowed.shape != logits.shape:
        raise ValueError(f"allowed: shape {tuple(allowed.shape)}; must match logits {tuple(logits.shape)}")


def _scaled_logits(logits: Tensor, temperature: float, allowed: Tensor | None) -> Tensor:
    """float32 [T, V_local] logits / temperature, -inf where not allowed."""
    _check_temperature_and_mask(logits, temperature, allowed)
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    return scaled


def _softmax_stats(scaled: Tensor, group: ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """(shifted [T, V_local] = scaled - global row max, log of the global sum of exp [T])."""
    row_max = scaled.max(dim=-1).values  # [T]
    _all_reduce(row_max, group, dist.ReduceOp.MAX)
    shifted = scaled - row_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)  # [T]
    _all_reduce(sum_exp, group)
    return shifted, sum_exp.log()


def combine_row_stats(local_max: Tensor, local_sumexp: Tensor, picked: Tensor,
                      group: ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """Exact log-normaliser across the tp group from per-rank statistics of the fused kernel.

    local_max m [T] (-inf where this rank's slice is all masked), local_sumexp s [T] = sum of
    exp(x - m) over the slice, picked [T] (the target's scaled logit on its owner, 0 elsewhere).
    Returns (picked summed over the group [T], log_z [T]) with M = max over ranks of m and
    log_z = M + log(sum over ranks of s * exp(m - M)); two all-reduces (MAX, then one SUM of both).
    """
    row_max = _all_reduce(local_max.clone(), group, dist.ReduceOp.MAX)  # M [T]
    # Shift by 0 where every rank is masked (M = -inf) so exp(m - M) is 0 there, not NaN.
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    both = torch.stack([local_sumexp * (local_max - shift).exp(), picked])  # [2, T]
    _all_reduce(both, group)
    return both[1], row_max + both[0].log()


def _torch_forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, local_target: Tensor,
                   group: ProcessGroup | None, temperature: float, allowed: Tensor | None, save: bool) -> Tensor:
    """The reference (and CPU) path: float32 [T, V_local] temporaries; probs saved for backward."""
    shifted, log_z = _softmax_stats(_scaled_logits(logits, temperature, allowed), group)
    local_vocab = logits.shape[-1]
    owned = (local_target >= 0) & (local_target < local_vocab)  # [T]: this rank holds the target
    index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)  # [T]
    _all_reduce(picked, group)
    if save:
        probs = (shifted - log_z.unsqueeze(-1)).exp()  # [T, V_local]; 0 where masked
        ctx.save_for_backward(probs, index, owned)
    return picked - log_z


def _fused_forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, local_target: Tensor,
                   group: ProcessGroup | None, temperature: float, allowed: Tensor | None, save: bool) -> Tensor:
    """The Triton path: one read of the logits for [T] statistics; backward recomputes probs."""
    from actors.kernels import logprob_row_stats  # imports triton: only when asked for

    logits = logits.contiguous()
    allowed = None if allowed is None else allowed.contiguous()
    local_max, local_sumexp, picked = logprob_row_stats(logits, local_target, temperature, allowed)
    picked, log_z = combine_row_stats(local_max, local_sumexp, picked, group)
    if save:
        ctx.save_for_backward(logits, local_target, allowed, log_z)
    return picked - log_z


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits / temperature)[t, target_t], vocab split over the tp group."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, targets: Tensor,
                group: ProcessGroup | None, temperature: float, allowed: Tensor | None, use_triton: bool,
                grad_wanted: bool) -> Tensor:
        _check_temperature_and_mask(logits, temperature, allowed)
        local_target = targets - group_rank(group) * logits.shape[-1]  # [T]; outside [0, V_local): not ours
        # needs_input_grad is True under no_grad too when logits require grad; grad_wanted is not.
        save = bool(ctx.needs_input_grad[0]) and grad_wanted
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        ctx.use_triton = use_triton
        forward_fn = _fused_forward if use_triton else _torch_forward
        return forward_fn(ctx, logits, local_target, group, temperature, allowed, save)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        # d logprob_t / d logit_tv = (onehot(target_t)_v - p_tv) / temperature.
        if ctx.use_triton:
            from actors.kernels import logprob_grad

            logits, local_target, allowed, log_z = ctx.saved_tensors
            grad_logits = logprob_grad(logits, local_target, log_z, grad, ctx.temperature, allowed)
            return grad_logits, None, None, None, None, None, None
        probs, index, owned = ctx.saved_tensors
        grad_logits = -probs
        grad_logits.scatter_add_(-1, index, owned.to(probs.dtype).unsqueeze(-1))
        grad_logits.mul_(grad.float().unsqueeze(-1) / ctx.temperature)
        return grad_logits.to(ctx.logits_dtype), None, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) per row, vocab split over the tp group."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, group: ProcessGroup | None,
                temperature: float, allowed: Tensor | None) -> Tensor:
        shifted, log_z = _softmax_stats(_scaled_logits(logits, temperature, allowed), group)
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        # sum_v p_v * shifted_v; masked entries have p = 0 and shifted = -inf, so zero them first.
        p_shifted = torch.where(probs > 0, probs * shifted, torch.zeros_like(probs))
        mean_shifted = p_shifted.sum(dim=-1)  # [T]
        _all_reduce(mean_shifted, group)
        ctx.save_for_backward(probs, shifted, mean_shifted)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        # H = -sum p log p = log Z - sum p * shifted (log p = shifted - log Z).
        return log_z - mean_shifted

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        # dH / d scaled_v = -p_v * (shifted_v - sum_u p_u shifted_u); zero where p_v = 0.
        probs, shifted, mean_shifted = ctx.saved_tensors
        centred = torch.where(probs > 0, shifted - mean_shifted.unsqueeze(-1), torch.zeros_like(shifted))
        grad_logits = -probs * centred * (grad.float().unsqueeze(-1) / ctx.temperature)
        return grad_logits.to(ctx.logits_dtype), None, None, None


def _resolve_use_triton(use_triton: bool | None, device: torch.device) -> bool:
    """None -> the default for the device (CUDA with triton); True -> checked that kernels can run."""
    if use_triton is None:
        return triton_on(device)
    if use_triton and not triton_runs(device):
        raise RuntimeError(f"use_triton=True: Triton kernels cannot run on {device} here (needs CUDA with "
                           "triton, or CPU with TRITON_INTERPRET=1 set before triton is imported)")
    return use_triton


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, group: ProcessGroup | None = None,
                            temperature: float = 1.0, allowed: Tensor | None = None,
                            use_triton: bool | None = None) -> Tensor:
    """float32 [T] log p(targets[t]) under softmax(logits[t] / temperature) over the full vocab.

    logits [T, V_local] (this rank's vocab slice), targets int64 [T] global token ids;
    differentiable with respect to logits. use_triton: the fused kernels of
    actors.kernels.fused_logprobs (None: on CUDA when triton is installed, see actors.kernels.switch).
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} / targets {tuple(targets.shape)}: need [T, V_local] and [T]")
    fused = _resolve_use_triton(use_triton, logits.device)
    grad_wanted = torch.is_grad_enabled() and logits.requires_grad
    return _VocabParallelLogprob.apply(logits, targets.long(), group, float(temperature), allowed, fused,
                                       grad_wanted)


def vocab_parallel_entropy(logits: Tensor, group: ProcessGroup | None = None, temperature: float = 1.0,
                           allowed: Tensor | None = None) -> Tensor:
    """float32 [T] entropy of softmax(logits[t] / temperature) over the full vocab; differentiable."""
    if logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)}: need [T, V_local]")
    return _VocabParallelEntropy.apply(logits, group, float(temperature), allowed)


def next_token_targets(tokens: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """Targets for next-token prediction on a packed stream.

    Returns (targets [T], valid [T] bool): targets[t] = tokens[t + 1] inside a sequence; at each
    sequence's last position there is no next token, so valid is False and the target is 0.
    """
    ends = cu_seqlens[1:].long() - 1
    targets = torch.roll(tokens, shifts=-1)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[ends] = False
    return targets.masked_fill(~valid, 0), valid


def shift_to_token_positions(per_position: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Move outputs computed at position t (about token t + 1) to index t + 1: [T] -> [T].

    This gives the convention of actors.rl.advantages: entry i is about token i
    (logprobs[i] = log p(token_i | tokens before it)); each sequence's first entry is 0.
    """
    out = torch.roll(per_position, shifts=1)
    starts = cu_seqlens[:-1].long()
    return out.index_fill(0, starts, 0.0)


def token_logprobs(logits: Tensor, tokens: Tensor, cu_seqlens: Tensor, group: ProcessGroup | None = None,
                   temperature: float = 1.0, allowed: Tensor | None = None,
                   use_triton: bool | None = None) -> Tensor:
    """float32 [T]: logprobs[i] = log p(tokens[i] | tokens before it in its sequence), 0 at each
    sequence's first token. logits [T, V_local] from the model on the packed `tokens` [T]."""
    targets, _ = next_token_targets(tokens, cu_seqlens)
    per_position = vocab_parallel_logprobs(logits, targets, group, temperature, allowed, use_triton)
    return shift_to_token_positions(per_position, cu_seqlens)


__all__ = [
    "combine_row_stats", "next_token_targets", "shift_to_token_positions", "token_logprobs", "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
