"""Outcome-reward advantages of the critic-free algorithms: GRPO, RLOO, REINFORCE++ (and its
group baseline) and DAPO's overlong shaping.

Conventions of `actors.rl.advantages`: per-token tensors are float [N] on the packed stream,
`response_mask` [N], `cu_seqlens` [B+1]; per-sequence tensors are float [B]. A *group* is the set of
responses to one prompt: `group_ids` int64 [B] holds each sequence's prompt index (the generate
op's `prompt_index`), so groups are found by id wherever their rows sit, never by row order alone.

References: GRPO (Shao et al. 2024) and Dr. GRPO (Liu et al. 2025); RLOO (Ahmadian et al. 2024);
REINFORCE++ (Hu 2025); DAPO (Yu et al. 2025). The formulas follow veRL's `core_algos.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.rl.advantages import broadcast_to_tokens, masked_whiten, reward_to_go, sequence_ids


def group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(dense group of each sequence int64 [B] in 0..G-1, members per group int64 [G]).

    group_ids: int [B], any values (e.g. prompt indices 7, 7, 3, 3). Groups are numbered in the
    order of their first appearance.
    """
    if group_ids.dim() != 1 or group_ids.numel() == 0:
        raise ValueError(f"group_ids: shape {tuple(group_ids.shape)}; must be 1-D and non-empty")
    uniques, dense = torch.unique(group_ids, sorted=True, return_inverse=True)
    # Renumber by first appearance so group 0 is the group of row 0 (stable, readable order).
    first_row = torch.full((uniques.numel(),), group_ids.numel(), dtype=torch.int64, device=group_ids.device)
    first_row = first_row.scatter_reduce(0, dense, torch.arange(group_ids.numel(), device=group_ids.device), "amin")
    rank = torch.empty_like(first_row)
    rank[torch.argsort(first_row)] = torch.arange(uniques.numel(), device=group_ids.device)
    dense = rank[dense]
    counts = torch.bincount(dense, minlength=uniques.numel())
    return dense, counts


def group_mean_std(scores: Tensor, group_ids: Tensor, min_size: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence [B]: its group's mean score, unbiased std (n - 1) and size.

    Raises ValueError when a group has fewer than `min_size` members (a baseline from the other
    members needs at least one other).
    """
    if scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)}: must both be [B]")
    dense, counts = group_index(group_ids)
    small = (counts < min_size).nonzero(as_tuple=True)[0]
    if small.numel():
        g = int(small[0])
        example = int(group_ids[(dense == g).nonzero(as_tuple=True)[0][0]])
        raise ValueError(f"group_ids: group {example} has {int(counts[g])} member(s); need >= {min_size} "
                         "samples per prompt (batch.group_size)")
    x = scores.detach().double()
    n = counts.to(x.dtype)
    sums = torch.zeros(counts.numel(), dtype=x.dtype, device=x.device).index_add(0, dense, x)
    mean = sums / n
    sq = torch.zeros_like(sums).index_add(0, dense, (x - mean[dense]) ** 2)
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    dt = scores.dtype
    return mean[dense].to(dt), std[dense].to(dt), counts[dense]


def grpo_outcome_advantages(scores: Tensor, group_ids: Tensor, eps: float = 1e-6,
                            scale_by_std: bool = True) -> Tensor:
    """GRPO group-normalised outcome advantages per sequence [B].

    A_i = (s_i - mean_g) / (std_g + eps) over the sequences of i's group g (unbiased std);
    scale_by_std=False gives Dr. GRPO's A_i = s_i - mean_g. scores float [B], group_ids int [B].
    """
    mean, std, _ = group_mean_std(scores, group_ids)
    centred = scores.detach() - mean
    return centred / (std + eps) if scale_by_std else centred


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (leave-one-out baseline) per sequence [B]: A_i = s_i - mean of the OTHER members of
    i's group = n / (n - 1) * (s_i - mean_g) for a group of n."""
    mean, _, counts = group_mean_std(scores, group_ids)
    n = counts.to(scores.dtype)
    return (scores.detach() - mean) * n / (n - 1)


def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, cu_seqlens: Tensor,
                            gamma: float = 1.0) -> Tensor:
    """REINFORCE++: the discounted reward-to-go of each response token (token_rewards [N]: the
    score at the last token minus the per-token KL penalty), whitened over every response token
    of the batch (global batch normalisation, no critic). Returns advantages [N], 0 elsewhere."""
    returns = reward_to_go(token_rewards, response_mask, cu_seqlens, gamma)
    return masked_whiten(returns, response_mask)


def reinforce_pp_baseline_advantages(token_rewards: Tensor, group_ids: Tensor, response_mask: Tensor,
                                     cu_seqlens: Tensor) -> Tensor:
    """REINFORCE++-baseline: each sequence's summed reward (token_rewards [N] summed over its
    response) minus its group's mean, on every response token, then whitened over the batch.
    Returns advantages [N], 0 outside the response."""
    mask = response_mask.to(token_rewards.dtype)
    seq = sequence_ids(cu_seqlens, token_rewards.numel())
    n_seqs = cu_seqlens.numel() - 1
    totals = torch.zeros(n_seqs, dtype=token_rewards.dtype, device=token_rewards.device)
    totals = totals.index_add(0, seq, token_rewards.detach() * mask)  # [B]
    mean, _, _ = group_mean_std(totals, group_ids)
    centred = broadcast_to_tokens(totals - mean, response_mask, cu_seqlens)
    return masked_whiten(centred, response_mask)


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment per sequence [B] (added to the score): 0 up to
    max_len - buffer tokens, then falling linearly to -factor at max_len.

    response_lengths: int or float [B]. buffer: the tokens over which the penalty ramps (0 < buffer
    <= max_len)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer}: must be in (0, max_len={max_len}]")
    if factor < 0:
        raise ValueError(f"overlong penalty factor={factor}: must be >= 0")
    exceed = response_lengths.to(torch.float32) - (max_len - buffer)
    return (-exceed / buffer * factor).clamp(max=0.0)


__all__ = [
    "group_index", "group_mean_std", "grpo_outcome_advantages", "overlong_penalty", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages", "rloo_advantages",
]
