"""Training ops of the critic-free outcome-reward algorithms: GRPO, RLOO, REINFORCE++,
REINFORCE++-baseline, DAPO and GSPO (one op, `outcome_actor`, picked by params['advantage'] and
params['policy_loss']; `grpo_actor` is GRPO's name for it).

Each row answers the prompt named by its `prompt_index` (written by the generate op); groups are
the rows sharing one, wherever they sit, and a call whose groups do not each hold exactly
params['group_size'] rows fails naming the prompt. Shapes as actors.worker.train: per-token float32
[T] over the packed rows, per-row [B].

  advantage              per-sequence score -> advantages [T]
  grpo                   (s - group mean) / (group std + eps), or unscaled (scale_by_std=False)
  rloo                   s - mean of the other members of the group
  reinforce_pp           whitened reward-to-go of the KL-shaped token rewards (kl_coef)
  reinforce_pp_baseline  summed KL-shaped rewards minus the group mean, whitened over the batch

DAPO is grpo advantages + the clip-higher PPO loss + token-mean + the overlong penalty
(overlong_buffer > 0: scores fall linearly to -overlong_penalty over the last overlong_buffer
tokens before max_new_tokens); its dynamic sampling happens in the driver, which hands this op
only groups whose rewards differ. GSPO is grpo advantages + policy_loss 'gspo'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from actors.rl import (
    broadcast_to_tokens,
    grpo_outcome_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_ids,
    token_level_rewards,
)
from actors.worker.behaviour import logprobs_before_step
from actors.worker.calls import CallContext
from actors.worker.train import Rollout, load_rollout, rollout_kl, rollout_metrics, train_actor

ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def group_ids(ctx: CallContext, r: Rollout) -> Tensor:
    """int64 [B]: each row's prompt index, checked to form groups of exactly params['group_size']."""
    if r.prompt_index is None:
        raise ValueError(f"call {ctx.call.name}: groups need 'prompt_index' from the generate call")
    size = int(ctx.params.get("group_size", 1))
    ids, counts = torch.unique(r.prompt_index, return_counts=True)
    wrong = (counts != size).nonzero(as_tuple=True)[0]
    if wrong.numel():
        k = int(wrong[0])
        raise ValueError(f"call {ctx.call.name}: prompt_index {int(ids[k])} has {int(counts[k])} rows; every "
                         f"prompt needs group_size={size} responses in the batch")
    return r.prompt_index


def shaped_scores(ctx: CallContext, r: Rollout) -> Rollout:
    """The rollout with DAPO's overlong penalty added to its scores (params['overlong_buffer'] > 0)."""
    buffer = int(ctx.params.get("overlong_buffer", 0))
    if buffer <= 0:
        return r
    lengths = torch.tensor(r.response_lengths, dtype=torch.float32)
    max_len = int(ctx.params.get("max_new_tokens", max(r.response_lengths)))
    penalty = overlong_penalty(lengths, max_len, buffer, float(ctx.params.get("overlong_penalty", 1.0)))
    return replace(r, scores=r.scores + penalty)


def outcome_advantages(ctx: CallContext, r: Rollout, kl: Tensor | None) -> Tensor:
    """Advantages [T] of params['advantage'] (see the module docstring); kl [T] or None. The
    rewards are KL-shaped per token (kl_coef; 0 for GRPO, whose KL is a loss term); the group
    estimators take each sequence's total (veRL: token_level_rewards.sum(-1))."""
    p = ctx.params
    kind = str(p.get("advantage", "grpo"))
    token_rewards = token_level_rewards(r.scores, r.mask, r.cu_seqlens, kl=kl, kl_coef=float(p.get("kl_coef", 0.0)))
    seq = sequence_ids(r.cu_seqlens, token_rewards.numel())
    totals = torch.zeros(len(r.lengths)).index_add(0, seq, token_rewards * r.mask)  # [B]
    if kind == "grpo":
        per_seq = grpo_outcome_advantages(totals, group_ids(ctx, r), scale_by_std=bool(p.get("scale_by_std", True)))
        return broadcast_to_tokens(per_seq, r.mask, r.cu_seqlens)
    if kind == "rloo":
        return broadcast_to_tokens(rloo_advantages(totals, group_ids(ctx, r)), r.mask, r.cu_seqlens)
    if kind == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards, r.mask, r.cu_seqlens, float(p.get("gamma", 1.0)))
    if kind == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(token_rewards, group_ids(ctx, r), r.mask, r.cu_seqlens)
    raise ValueError(f"call {ctx.call.name}: params['advantage']={kind!r}; allowed: {', '.join(ADVANTAGES)}")


def run_outcome_actor(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    """Advantages (with the behaviour logprobs first when a KL penalty in the reward needs them),
    then the policy loss."""
    r = shaped_scores(ctx, load_rollout(ctx, inputs, []))
    old = logprobs_before_step(ctx, r)  # None unless a KL penalty in the reward needs them first
    kl = rollout_kl(ctx, r, old)
    advantages = outcome_advantages(ctx, r, kl)
    extra = rollout_metrics(ctx, r, kl)
    if r.prompt_index is not None:
        extra["rollout/prompts"] = float(torch.unique(r.prompt_index).numel())
    return train_actor(ctx, r, advantages, extra, old)


def run_grpo_actor(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    """GRPO: group-normalised outcome advantages by prompt_index, KL as a loss term
    (kl_loss_coef) instead of a reward penalty."""
    if ctx.params.get("advantage", "grpo") != "grpo":
        raise ValueError(f"call {ctx.call.name}: op grpo_actor computes grpo advantages, not "
                         f"{ctx.params['advantage']!r} (use op outcome_actor)")
    return run_outcome_actor(ctx, inputs)


__all__ = ["ADVANTAGES", "group_ids", "outcome_advantages", "run_grpo_actor", "run_outcome_actor", "shaped_scores"]
