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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from actors.distributed import group_rank, group_size


def _all_reduce(x: Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _scaled_logits(logits: Tensor, temperature: float, allowed: Tensor | None) -> Tensor:
    """float32 [T, V_local] logits / temperature, -inf where not allowed."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    scaled = logits.float() / temperature
    if allowed is not None:
        if allowed.shape != logits.shape:
            raise ValueError(f"allowed: shape {tuple(allowed.shape)}; must match logits {tuple(logits.shape)}")
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


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits / temperature)[t, target_t], vocab split over the tp group."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, targets: Tensor,
                group: ProcessGroup | None, temperature: float, allowed: Tensor | None) -> Tensor:
        shifted, log_z = _softmax_stats(_scaled_logits(logits, temperature, allowed), group)
        local_vocab = logits.shape[-1]
        local_target = targets - group_rank(group) * local_vocab
        owned = (local_target >= 0) & (local_target < local_vocab)  # [T]: this rank holds the target
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)  # [T]
        _all_reduce(picked, group)
        probs = (shifted - log_z.unsqueeze(-1)).exp()  # [T, V_local]; 0 where masked
        ctx.save_for_backward(probs, index, owned)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return picked - log_z

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        # d logprob_t / d logit_tv = (onehot(target_t)_v - p_tv) / temperature.
        probs, index, owned = ctx.saved_tensors
        grad_logits = -probs
        grad_logits.scatter_add_(-1, index, owned.to(probs.dtype).unsqueeze(-1))
        grad_logits.mul_(grad.float().unsqueeze(-1) / ctx.temperature)
        return grad_logits.to(ctx.logits_dtype), None, None, None, None


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


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, group: ProcessGroup | None = None,
                            temperature: float = 1.0, allowed: Tensor | None = None) -> Tensor:
    """float32 [T] log p(targets[t]) under softmax(logits[t] / temperature) over the full vocab.

    logits [T, V_local] (this rank's vocab slice), targets int64 [T] global token ids;
    differentiable with respect to logits.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} / targets {tuple(targets.shape)}: need [T, V_local] and [T]")
    return _VocabParallelLogprob.apply(logits, targets.long(), group, float(temperature), allowed)


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

    This gives the convention of actors/advantages.py: entry i is about token i
    (logprobs[i] = log p(token_i | tokens before it)); each sequence's first entry is 0.
    """
    out = torch.roll(per_position, shifts=1)
    starts = cu_seqlens[:-1].long()
    return out.index_fill(0, starts, 0.0)


def token_logprobs(logits: Tensor, tokens: Tensor, cu_seqlens: Tensor, group: ProcessGroup | None = None,
                   temperature: float = 1.0, allowed: Tensor | None = None) -> Tensor:
    """float32 [T]: logprobs[i] = log p(tokens[i] | tokens before it in its sequence), 0 at each
    sequence's first token. logits [T, V_local] from the model on the packed `tokens` [T]."""
    targets, _ = next_token_targets(tokens, cu_seqlens)
    per_position = vocab_parallel_logprobs(logits, targets, group, temperature, allowed)
    return shift_to_token_positions(per_position, cu_seqlens)


__all__ = [
    "next_token_targets", "shift_to_token_positions", "token_logprobs", "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
