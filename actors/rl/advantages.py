"""Advantage estimation for RLHF on packed batches: GAE, ReMax, whitening, KL control (the
group-based outcome advantages of GRPO, RLOO, REINFORCE++ are in `actors.rl.outcome`).

Convention (shared with `actors.rl.losses`): a batch of B sequences (prompt + response) is packed
into one 1-D stream of N tokens with `cu_seqlens` [B+1] (int32 or int64, starting at 0, as in
`actors.engine.packing`). Every per-token tensor is float [N] and aligned with the token stream:
entry i is about token i, i.e. `logprobs[i] = log p(token_i | tokens before it)` and
`values[i] = V(state just before token i is emitted)`. The engine shifts model outputs (which
predict the *next* token) by one position to get there. `response_mask` [N] (bool or 0/1) marks
the tokens the policy generated; the first token of a sequence is never a response token.
Response tokens of one sequence are treated as consecutive time steps in order (a multi-turn
mask with holes is compressed). Per-sequence tensors (scores, baselines) are float [B].

These functions run on the full batch, on the driver-side worker that assembles it, before the
batch is split into PPO mini/micro-batches; whitening therefore uses statistics of the whole batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_ids(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """int64 [N]: index of the sequence each packed token belongs to."""
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: shape {tuple(cu.shape)}; must be 1-D [B+1] starting at 0")
    if int(cu[-1]) != n_tokens:
        raise ValueError(f"cu_seqlens: ends at {int(cu[-1])} but the per-token tensor has {n_tokens} tokens")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens: {cu.tolist()} is not non-decreasing")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)


def _response_slots(response_mask: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where each response token goes in a [B, T_max] right-padded matrix of response steps.

    Returns (token_index [R], row [R], col [R], t_max): R response tokens, token_index their
    position in the packed stream, row their sequence, col their step inside that sequence.
    """
    mask = response_mask.bool()
    seq = sequence_ids(cu_seqlens, mask.numel())
    n_seqs = cu_seqlens.numel() - 1
    token_index = mask.nonzero(as_tuple=True)[0]
    row = seq[token_index]
    counts = torch.bincount(row, minlength=n_seqs)
    empty = (counts == 0).nonzero(as_tuple=True)[0]
    if empty.numel() > 0:
        raise ValueError(f"response_mask: sequences {empty.tolist()[:8]} have no response token; "
                         "every sequence needs at least one (e.g. its EOS)")
    # Step of a response token within its sequence = its rank among the sequence's response tokens.
    first = torch.cumsum(counts, 0) - counts
    col = torch.arange(token_index.numel(), device=mask.device) - first[row]
    return token_index, row, col, int(counts.max())


def _to_padded(x: Tensor, row: Tensor, col: Tensor, token_index: Tensor, n_seqs: int, t_max: int) -> Tensor:
    padded = torch.zeros(n_seqs, t_max, dtype=x.dtype, device=x.device)
    padded[row, col] = x[token_index]
    return padded


def last_response_indices(response_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """int64 [B]: packed index of each sequence's last response token."""
    token_index, row, col, _ = _response_slots(response_mask, cu_seqlens)
    last = torch.full((cu_seqlens.numel() - 1,), -1, dtype=torch.int64, device=token_index.device)
    return last.scatter_reduce(0, row, token_index, reduce="amax")


def token_level_rewards(scores: Tensor, response_mask: Tensor, cu_seqlens: Tensor,
                        kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards [N]: the sequence score [B] at its last response token, minus
    `kl_coef * kl` [N] at every response token (Ziegler et al. KL-shaped reward); 0 elsewhere."""
    mask = response_mask.to(scores.dtype)
    rewards = torch.zeros_like(mask)
    if kl is not None:
        rewards = rewards - kl_coef * kl.to(scores.dtype) * mask
    last = last_response_indices(response_mask, cu_seqlens)
    return rewards.index_add(0, last, scores)


def discounted_gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, cu_seqlens: Tensor,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per sequence over its response tokens.

    token_rewards, values: float [N]. delta_t = r_t + gamma * V_{t+1} - V_t with V after the last
    response token = 0 (episode ends at EOS or truncation); A_t = delta_t + gamma * lam * A_{t+1};
    returns_t = A_t + V_t. Returns (advantages [N], returns [N]), 0 outside the response.
    """
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma={gamma}, lam={lam}: both must be in [0, 1]")
    token_index, row, col, t_max = _response_slots(response_mask, cu_seqlens)
    n_seqs = cu_seqlens.numel() - 1
    # Right-padded [B, T_max] with zeros past each sequence's end, so those steps contribute
    # delta = 0 and the recursion starts from A = 0, V = 0 after the last real step.
    rewards = _to_padded(token_rewards.detach(), row, col, token_index, n_seqs, t_max)
    vals = _to_padded(values.detach(), row, col, token_index, n_seqs, t_max)
    advantages = torch.zeros_like(vals)
    running = torch.zeros(n_seqs, dtype=vals.dtype, device=vals.device)
    for t in range(t_max - 1, -1, -1):
        next_value = vals[:, t + 1] if t + 1 < t_max else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    adv_tokens = torch.zeros_like(values, dtype=vals.dtype)
    adv_tokens[token_index] = advantages[row, col]
    returns = (adv_tokens + values.detach().to(vals.dtype)) * response_mask.to(vals.dtype)
    return adv_tokens, returns


def reward_to_go(token_rewards: Tensor, response_mask: Tensor, cu_seqlens: Tensor, gamma: float = 1.0) -> Tensor:
    """Per-token discounted sum of future rewards inside each response [N] (GAE with V = 0, lam = 1)."""
    zeros = torch.zeros_like(token_rewards)
    advantages, _ = discounted_gae(token_rewards, zeros, response_mask, cu_seqlens, gamma, 1.0)
    return advantages


def ppo_advantages(scores: Tensor, values: Tensor, response_mask: Tensor, cu_seqlens: Tensor,
                   kl: Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 0.95,
                   whiten: bool = True) -> tuple[Tensor, Tensor]:
    """The PPO recipe in one call: KL-shaped token rewards -> GAE -> whitened advantages.

    scores [B]; values, kl [N] (kl from `actors.rl.losses.kl_penalty(logprobs, ref_logprobs, ...)`).
    Returns (advantages [N], returns [N]); returns are the critic's targets and are not whitened.
    """
    rewards = token_level_rewards(scores, response_mask, cu_seqlens, kl=kl, kl_coef=kl_coef)
    advantages, returns = discounted_gae(rewards, values, response_mask, cu_seqlens, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean, unit variance over the masked entries of the whole tensor.

    Variance uses Bessel's correction (n / (n - 1)) as in TRL/veRL. With shift_mean=False the
    mean is added back (only the scale changes). Entries outside the mask are returned as 0.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    if float(n) < 2:
        raise ValueError(f"mask: {int(n)} selected entries; whitening needs at least 2")
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * (n / (n - 1))
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, response_mask: Tensor,
                     cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): returns are the undiscounted reward-to-go of the sampled response;
    the advantage subtracts the score of the greedy response to the same prompt ([B] baseline).

    Returns (advantages [N], returns [N]), 0 outside the response.
    """
    returns = reward_to_go(token_rewards, response_mask, cu_seqlens, gamma=1.0)
    baseline = broadcast_to_tokens(baseline_scores.detach().to(returns.dtype), response_mask, cu_seqlens)
    return returns - baseline, returns


def broadcast_to_tokens(per_sequence: Tensor, response_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Copy a per-sequence value [B] to every response token of that sequence [N] (0 elsewhere)."""
    seq = sequence_ids(cu_seqlens, response_mask.numel())
    return per_sequence[seq] * response_mask.to(per_sequence.dtype)


class FixedKLController:
    """KL-penalty coefficient that never changes."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"kl coef={coef}: must be >= 0")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Nothing to adapt; returns the coefficient."""
        return self.value


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning LMs from Human Preferences".

    After each iteration: error = clip(current_kl / target - 1, -0.2, 0.2) and
    coef *= 1 + error * n_steps / horizon, where n_steps is the number of samples (sequences)
    seen in the iteration: the coefficient grows when the policy drifts past the target KL.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if init_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise ValueError(f"init_coef={init_coef}, target_kl={target_kl}, horizon={horizon}: need "
                             "init_coef >= 0, target_kl > 0, horizon > 0")
        self.value = float(init_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt the coefficient to the KL measured in the last iteration; returns the new value."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(kind: str, coef: float, target_kl: float | None = None,
                       horizon: int = 10000) -> FixedKLController | AdaptiveKLController:
    """Build the controller named `kind` ('fixed' or 'adaptive'; adaptive needs target_kl)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None:
            raise ValueError("kl_ctrl.target_kl: required when kind='adaptive'")
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl.kind={kind!r}: unknown; allowed: 'fixed', 'adaptive'")


__all__ = [
    "AdaptiveKLController", "FixedKLController", "broadcast_to_tokens", "discounted_gae",
    "last_response_indices", "make_kl_controller", "masked_whiten", "ppo_advantages",
    "remax_advantages", "reward_to_go", "sequence_ids", "token_level_rewards",
]
