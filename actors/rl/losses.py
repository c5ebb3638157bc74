"""Training losses for RLHF on packed per-token tensors: PPO and GSPO policy, value, KL, DPO, SFT.

Tensor convention: see `actors.rl.advantages`. Per-token tensors are float [N] aligned with the
packed token stream (entry i is about token i), `mask` [N] selects the tokens that count
(the response for RL, the completion for SFT), `cu_seqlens` [B+1] gives sequence boundaries.

Aggregation: every loss returns a `LossSums` holding *sums* (the loss and each statistic summed
over the tokens or sequences it covers) and the *count* it was summed over, never a mean. A mean
over a micro-batch would weight micro-batches (and DP ranks) with different token counts wrongly.
The engine instead divides by the count of the whole optimiser step:

    total = all_reduce_sum(sum of `count` over this rank's micro-batches)   # known before backward
    for each micro-batch: (sums.loss / total).backward()
    gradients: all-reduce SUM over DP (not average)

which gives exactly the token-mean over the global mini-batch ("token-mean"), or the sequence
mean ("seq-mean-token-mean", each sequence's token-mean weighted equally, count = sequences).
Statistics are reported the same way: stats[k] / count after summing both over micro-batches.
A statistic that is a largest value (`maxima`) is reduced by max instead and reported as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from actors.rl.advantages import sequence_ids

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass(frozen=True)
class LossSums:
    """A loss and its statistics as sums over `count` tokens or sequences.

    loss: scalar tensor carrying the gradient. count: scalar float tensor (tokens for token-mean,
    sequences otherwise). stats: detached scalar sums, e.g. {"pg_clipfrac": 12.0}. maxima:
    detached scalar largest values (combined by max, never divided), e.g. {"rollout_is_max": 3.1}.
    """

    loss: Tensor
    count: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    maxima: dict[str, Tensor] = field(default_factory=dict)

    def mean(self) -> Tensor:
        """loss / count for a single micro-batch (count clamped to >= 1 for empty masks)."""
        return self.loss / self.count.clamp(min=1)

    def stat_means(self) -> dict[str, float]:
        """Each statistic divided by the count, as Python floats for logging."""
        denom = float(self.count.clamp(min=1))
        return {name: float(value) / denom for name, value in self.stats.items()}

    def __add__(self, other: LossSums) -> LossSums:
        """Combine two micro-batches (or DP ranks) by adding sums and counts (maxima: the larger)."""
        if set(self.stats) != set(other.stats) or set(self.maxima) != set(other.maxima):
            raise ValueError(f"stats keys differ: {sorted(self.stats) + sorted(self.maxima)} vs "
                             f"{sorted(other.stats) + sorted(other.maxima)}")
        stats = {k: self.stats[k] + other.stats[k] for k in self.stats}
        maxima = {k: torch.maximum(self.maxima[k], other.maxima[k]) for k in self.maxima}
        return LossSums(self.loss + other.loss, self.count + other.count, stats, maxima)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"per-token tensors must share one shape; got {shapes}")


def aggregate(per_token: Tensor, mask: Tensor, agg: str = "token-mean",
              cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sum a per-token quantity [N] under `agg`; returns (sum, count) scalars.

    token-mean: (sum of masked values, number of masked tokens).
    seq-mean-token-mean: (sum over sequences of each one's masked token-mean, number of sequences
    with at least one masked token); needs cu_seqlens.
    """
    m = mask.to(per_token.dtype)
    if agg == "token-mean":
        return (per_token * m).sum(), m.sum().detach()
    if agg == "seq-mean-token-mean":
        if cu_seqlens is None:
            raise ValueError("agg='seq-mean-token-mean': cu_seqlens is required")
        seq = sequence_ids(cu_seqlens, per_token.numel())
        n_seqs = cu_seqlens.numel() - 1
        seq_sum = torch.zeros(n_seqs, dtype=per_token.dtype, device=per_token.device).index_add(0, seq, per_token * m)
        seq_cnt = torch.zeros(n_seqs, dtype=per_token.dtype, device=per_token.device).index_add(0, seq, m)
        has_tokens = seq_cnt > 0
        return (seq_sum[has_tokens] / seq_cnt[has_tokens]).sum(), has_tokens.sum().to(per_token.dtype)
    raise ValueError(f"agg={agg!r}: unknown; allowed: {', '.join(AGGREGATIONS)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs [N] -> [N].

    k1: log(pi/pi_ref). abs: |k1|. mse / k2: 0.5 * k1^2. low_var_kl / k3 (Schulman's unbiased,
    non-negative estimator): r - log r - 1 with r = pi_ref/pi, clamped to [-10, 10] as in veRL.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if estimator in ("low_var_kl", "k3"):
        ref_minus = (-log_ratio).clamp(-20.0, 20.0)  # log(pi_ref / pi), clamped so exp stays finite
        return (ref_minus.exp() - ref_minus - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl estimator={estimator!r}: unknown; allowed: {', '.join(KL_ESTIMATORS)}")


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    clip_eps: float = 0.2, clip_eps_high: float | None = None,
                    dual_clip: float | None = None, agg: str = "token-mean",
                    cu_seqlens: Tensor | None = None, is_weights: Tensor | None = None) -> LossSums:
    """Clipped PPO surrogate (Schulman et al. 2017), optionally asymmetric (DAPO clip-higher) and
    dual-clipped (Ye et al. 2020: for A < 0 the loss is capped at -A * dual_clip).

    logprobs (with grad), old_logprobs, advantages, mask: [N]. is_weights [N] (optional,
    `actors.rl.importance.truncated_is_weights`): each token's loss is multiplied by its weight.
    Stats (sums): pg_loss, pg_clipfrac (tokens where clipping is active), pg_clipfrac_lower
    (tokens capped by dual clip), ppo_kl (k1 estimate of KL(old || new)).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    eps_high = _upper_clip(clip_eps, clip_eps_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip}: must be > 1 (or None to disable)")
    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-20.0, 20.0)
    losses, clip_active = _clipped_surrogate(log_ratio.exp(), advantages, clip_eps, eps_high)
    lower_active = torch.zeros_like(losses)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        lower_active = ((losses > cap) & (advantages < 0)).to(logprobs.dtype)
        losses = torch.where(advantages < 0, torch.minimum(losses, cap), losses)
    losses = _importance_weighted(losses, is_weights)
    loss, count = aggregate(losses, mask, agg, cu_seqlens)
    with torch.no_grad():
        stats = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": aggregate(clip_active, mask, agg, cu_seqlens)[0],
            "pg_clipfrac_lower": aggregate(lower_active, mask, agg, cu_seqlens)[0],
            "ppo_kl": aggregate(-log_ratio, mask, agg, cu_seqlens)[0],
        }
    return LossSums(loss, count, stats)


def _upper_clip(clip_eps: float, clip_eps_high: float | None) -> float:
    """The upper clip range (clip_eps unless set apart, DAPO's clip-higher); both must be > 0."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps={clip_eps}, clip_eps_high={clip_eps_high}: must be > 0")
    return eps_high


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_eps: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate per token [N]: max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), and
    where the clipped term is the larger (the clip fraction's indicator, [N] in ratio's dtype)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(ratio.dtype)


def _importance_weighted(losses: Tensor, is_weights: Tensor | None) -> Tensor:
    """Per-token losses [N] times the (detached) truncated importance weights [N], when given."""
    if is_weights is None:
        return losses
    _check_same_shape(losses=losses, is_weights=is_weights)
    return losses * is_weights.detach()


def gspo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cu_seqlens: Tensor,
                     clip_eps: float = 3e-4, clip_eps_high: float | None = 4e-4, agg: str = "seq-mean-token-mean",
                     is_weights: Tensor | None = None) -> LossSums:
    """GSPO (Zheng et al. 2025): the clipped surrogate on one importance ratio per SEQUENCE,
    s_i = exp(mean over i's response tokens of (log pi - log pi_old)), clipped to
    [1 - clip_eps, 1 + clip_eps_high] (GSPO's ranges are ~1e-4, not PPO's 0.2).

    Every token of sequence i carries s_i in the forward pass; its gradient flows through the
    token's own logprob: log s_i,t = log pi_t - sg(log pi_t) + sg(log s_i) (veRL's form).
    logprobs (with grad), old_logprobs, advantages (the sequence's advantage on each token),
    mask: [N]; cu_seqlens [B+1]. Stats (sums) as `ppo_policy_loss`.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    eps_high = _upper_clip(clip_eps, clip_eps_high)
    m = mask.to(logprobs.dtype)
    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()) * m
    seq = sequence_ids(cu_seqlens, logprobs.numel())
    n_seqs = cu_seqlens.numel() - 1
    seq_sum = torch.zeros(n_seqs, dtype=logprobs.dtype, device=logprobs.device).index_add(0, seq, log_ratio.detach())
    seq_len = torch.zeros(n_seqs, dtype=logprobs.dtype, device=logprobs.device).index_add(0, seq, m).clamp(min=1)
    log_seq_ratio = (seq_sum / seq_len)[seq]  # [N]: each token's sequence-mean log ratio
    token_log_ratio = (logprobs - logprobs.detach() + log_seq_ratio).clamp(max=10.0)
    losses, clip_active = _clipped_surrogate(token_log_ratio.exp(), advantages, clip_eps, eps_high)
    losses = _importance_weighted(losses, is_weights)
    loss, count = aggregate(losses, mask, agg, cu_seqlens)
    with torch.no_grad():
        stats = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": aggregate(clip_active, mask, agg, cu_seqlens)[0],
            "pg_clipfrac_lower": torch.zeros((), dtype=logprobs.dtype, device=logprobs.device),
            "ppo_kl": aggregate(-log_ratio.detach(), mask, agg, cu_seqlens)[0],
        }
    return LossSums(loss, count, stats)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = 0.2, agg: str = "token-mean",
               cu_seqlens: Tensor | None = None) -> LossSums:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2).

    values (with grad), old_values, returns, mask: [N]. clip_range=None disables clipping.
    Stats (sums): vf_loss, vf_clipfrac (tokens where the clipped term is larger), vpred (values).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    returns = returns.detach()
    unclipped = (values - returns).square()
    if clip_range is None:
        losses = 0.5 * unclipped
        clip_active = torch.zeros_like(losses)
    else:
        if clip_range <= 0:
            raise ValueError(f"clip_range={clip_range}: must be > 0 (or None to disable)")
        old = old_values.detach()
        clipped_values = old + (values - old).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        losses = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = (clipped > unclipped).to(values.dtype)
    loss, count = aggregate(losses, mask, agg, cu_seqlens)
    with torch.no_grad():
        stats = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": aggregate(clip_active, mask, agg, cu_seqlens)[0],
            "vpred": aggregate(values.detach(), mask, agg, cu_seqlens)[0],
        }
    return LossSums(loss, count, stats)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "low_var_kl",
            agg: str = "token-mean", cu_seqlens: Tensor | None = None) -> LossSums:
    """KL to the reference policy as a loss term (GRPO style, instead of a reward penalty).

    Stats (sums): kl. Add `coef * kl_loss(...)` to the policy loss (same count, same aggregation).
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    per_token = kl_penalty(logprobs, ref_logprobs.detach(), estimator)
    loss, count = aggregate(per_token, mask, agg, cu_seqlens)
    return LossSums(loss, count, {"kl": loss.detach()})


def sequence_logprob_sums(logprobs: Tensor, mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Sum of masked per-token logprobs per sequence: [N] -> [B] (keeps the gradient)."""
    _check_same_shape(logprobs=logprobs, mask=mask)
    seq = sequence_ids(cu_seqlens, logprobs.numel())
    out = torch.zeros(cu_seqlens.numel() - 1, dtype=logprobs.dtype, device=logprobs.device)
    return out.index_add(0, seq, logprobs * mask.to(logprobs.dtype))


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, beta: float = 0.1, label_smoothing: float = 0.0) -> LossSums:
    """Direct Preference Optimisation (Rafailov et al. 2023), sigmoid loss with optional
    conservative label smoothing.

    Inputs are summed response logprobs per pair [P] (see `sequence_logprob_sums`).
    loss_p = -(1 - ls) * log sigmoid(beta * h_p) - ls * log sigmoid(-beta * h_p) with
    h_p = (chosen - ref_chosen) - (rejected - ref_rejected). Count = pairs.
    Stats (sums): dpo_loss, rewards_chosen, rewards_rejected, reward_margin, reward_accuracy.
    """
    _check_same_shape(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                      ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if beta <= 0:
        raise ValueError(f"beta={beta}: must be > 0")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 0.5)")
    chosen_reward = beta * (chosen_logps - ref_chosen_logps.detach())
    rejected_reward = beta * (rejected_logps - ref_rejected_logps.detach())
    margin = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    loss = losses.sum()
    with torch.no_grad():
        stats = {
            "dpo_loss": loss.detach(),
            "rewards_chosen": chosen_reward.detach().sum(),
            "rewards_rejected": rejected_reward.detach().sum(),
            "reward_margin": margin.detach().sum(),
            "reward_accuracy": (margin > 0).to(losses.dtype).sum(),
        }
    count = torch.tensor(float(losses.numel()), dtype=losses.dtype, device=losses.device)
    return LossSums(loss, count, stats)


def entropy_term(entropy: Tensor, mask: Tensor, agg: str = "token-mean",
                 cu_seqlens: Tensor | None = None) -> LossSums:
    """Summed per-token policy entropy [N] (differentiable); an entropy bonus enters the total
    with a negative weight: `combine_losses([(1.0, pg), (-entropy_coef, entropy_term(...))])`.
    Stats (sums): entropy."""
    _check_same_shape(entropy=entropy, mask=mask)
    total, count = aggregate(entropy, mask, agg, cu_seqlens)
    return LossSums(total, count, {"entropy": total.detach()})


def combine_losses(terms: list[tuple[float, LossSums]]) -> LossSums:
    """Weighted sum of loss terms computed over the same tokens with the same aggregation
    (e.g. policy loss + kl_coef * kl_loss - entropy_coef * entropy). The count is the first
    term's; statistics are merged unweighted (their names must differ)."""
    if not terms:
        raise ValueError("terms: empty; need at least one loss term")
    stats: dict[str, Tensor] = {}
    maxima: dict[str, Tensor] = {}
    for _, term in terms:
        clash = (set(stats) | set(maxima)) & (set(term.stats) | set(term.maxima))
        if clash:
            raise ValueError(f"terms: statistic names {sorted(clash)} appear in more than one term")
        stats.update(term.stats)
        maxima.update(term.maxima)
    loss = sum((weight * term.loss for weight, term in terms[1:]), terms[0][0] * terms[0][1].loss)
    return LossSums(loss, terms[0][1].count, stats, maxima)


def sft_loss(logprobs: Tensor, mask: Tensor, agg: str = "token-mean",
             cu_seqlens: Tensor | None = None) -> LossSums:
    """Negative log-likelihood of the masked tokens (supervised fine-tuning).

    logprobs [N] of the target tokens (with grad); mask [N] the tokens to learn (usually the
    completion, not the prompt). Stats (sums): sft_loss.
    """
    _check_same_shape(logprobs=logprobs, mask=mask)
    loss, count = aggregate(-logprobs, mask, agg, cu_seqlens)
    return LossSums(loss, count, {"sft_loss": loss.detach()})


__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "LossSums", "aggregate", "combine_losses", "dpo_loss", "entropy_term",
    "gspo_policy_loss", "kl_loss", "kl_penalty",
    "ppo_policy_loss", "sequence_logprob_sums", "sft_loss", "value_loss",
]
