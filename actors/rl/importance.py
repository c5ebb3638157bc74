"""Truncated importance sampling between the rollout policy and the policy being trained.

The rollout's logprobs come from the generation engine, possibly from older weights (bounded
staleness) and always through a different kernel path (KV cache, fused sampling) than the train
layout's recomputation `old_logprobs`. PPO's ratio is taken against `old_logprobs`; the gap
between the distribution that sampled the tokens and `old_logprobs` is corrected by weighting each
token's policy loss with w = pi_old / pi_rollout, truncated at a threshold so that a few tokens
the rollout found unlikely cannot dominate the gradient (TIS, Yao et al. 2025; veRL's
`rollout_is`). Tensors follow `actors.rl.advantages`: float [N] on the packed stream,
`mask` [N], `cu_seqlens` [B+1].
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.rl.advantages import broadcast_to_tokens, sequence_ids

IS_LEVELS = ("token", "sequence")


def truncated_is_terms(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cu_seqlens: Tensor,
                       level: str = "token", threshold: float = 2.0) -> tuple[Tensor, Tensor]:
    """(weights [N], raw [N]): the truncated importance weights and the weights before
    truncation, float32, detached, 0 outside the mask, on the inputs' device; no host sync, so a
    micro-batch's loss may call it (`truncated_is_weights` adds the statistics).

    token: w_t = min(exp(old_t - rollout_t), threshold) per response token.
    sequence: w = min(exp(sum over the sequence's response tokens of (old - rollout)), threshold)
    on every response token of the sequence (cu_seqlens [B+1] over the same N tokens).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: unknown; allowed: {', '.join(IS_LEVELS)}")
    if threshold < 1.0:
        raise ValueError(f"rollout_is_threshold={threshold}: must be >= 1")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)}"
                         f" and mask {tuple(mask.shape)}: must share one shape [N]")
    m = mask.to(torch.float32)
    log_ratio = (old_logprobs.detach().float() - rollout_logprobs.detach().float().to(m.device)) * m
    if level == "sequence":
        seq = sequence_ids(cu_seqlens.to(m.device), log_ratio.numel())
        per_seq = torch.zeros(cu_seqlens.numel() - 1, dtype=log_ratio.dtype, device=m.device)
        log_ratio = broadcast_to_tokens(per_seq.index_add(0, seq, log_ratio), mask, cu_seqlens.to(m.device))
    raw = log_ratio.clamp(-20.0, 20.0).exp() * m  # clamped so exp stays finite
    return raw.clamp(max=threshold), raw


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cu_seqlens: Tensor,
                         level: str = "token", threshold: float = 2.0) -> tuple[Tensor, dict[str, float]]:
    """Importance weights [N] (`truncated_is_terms`) and their statistics.

    Stats: rollout_is_mean (mean weight over response tokens, before truncation it would be ~1
    on-policy), rollout_is_max (largest weight before truncation), rollout_is_truncated (fraction
    of response tokens whose weight was truncated).
    """
    weights, raw = truncated_is_terms(old_logprobs, rollout_logprobs, mask, cu_seqlens, level, threshold)
    m = mask.to(torch.float32)
    n = float(m.sum().clamp(min=1))
    stats = {
        "rollout_is_mean": float(weights.sum()) / n,
        "rollout_is_max": float(raw.max()) if raw.numel() else 0.0,
        "rollout_is_truncated": float(((raw > threshold) & (m > 0)).sum()) / n,
    }
    return weights, stats


__all__ = ["IS_LEVELS", "truncated_is_terms", "truncated_is_weights"]
