"""The RL math: advantages and losses as pure functions of packed [T] tensors and `cu_seqlens`.

Imports only torch (no torch.distributed, no engine, planning or config); hyperparameters are plain
arguments. The worker picks a function by name (actors.worker.train).
  advantages  GAE, ReMax advantages, whitening, KL-shaped rewards, KL controllers
  outcome     group outcome advantages by prompt index: GRPO, RLOO, REINFORCE++(-baseline), DAPO's
              overlong penalty
  losses      PPO and GSPO policy losses, value loss, KL terms, entropy, DPO, SFT; each returns `LossSums`
  importance  truncated importance weights between the rollout policy and the trained one
"""

from __future__ import annotations

from actors.rl.advantages import (
    AdaptiveKLController,
    FixedKLController,
    broadcast_to_tokens,
    make_kl_controller,
    masked_whiten,
    ppo_advantages,
    remax_advantages,
    reward_to_go,
    sequence_ids,
    token_level_rewards,
)
from actors.rl.importance import IS_LEVELS, truncated_is_terms, truncated_is_weights
from actors.rl.losses import (
    LossSums,
    aggregate,
    combine_losses,
    dpo_loss,
    entropy_term,
    gspo_policy_loss,
    kl_loss,
    kl_penalty,
    ppo_policy_loss,
    sequence_logprob_sums,
    sft_loss,
    value_loss,
)
from actors.rl.outcome import (
    group_mean_std,
    grpo_outcome_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

__all__ = [
    # advantages.py
    "AdaptiveKLController", "FixedKLController", "broadcast_to_tokens", "make_kl_controller", "masked_whiten", "ppo_advantages", "remax_advantages",
    "reward_to_go", "sequence_ids", "token_level_rewards",
    # outcome.py
    "group_mean_std", "grpo_outcome_advantages", "overlong_penalty", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages", "rloo_advantages",
    # losses.py
    "LossSums", "aggregate", "combine_losses", "dpo_loss", "entropy_term", "gspo_policy_loss", "kl_loss",
    "kl_penalty", "ppo_policy_loss", "sequence_logprob_sums", "sft_loss", "value_loss",
    # importance.py
    "IS_LEVELS", "truncated_is_terms", "truncated_is_weights",
]
