"""The RL math: advantages and losses as pure functions of packed [T] tensors and `cu_seqlens`.

Imports only torch (no torch.distributed, no engine, planning or config); hyperparameters are plain
arguments. The worker picks a function by name (actors.worker.train).
  advantages  GAE, GRPO / ReMax outcome advantages, whitening, KL-shaped rewards, KL controllers
  losses      PPO policy and value losses, KL terms, entropy, DPO, SFT; every loss returns `LossSums`
"""

from __future__ import annotations

from actors.rl.advantages import (
    broadcast_to_tokens,
    grpo_outcome_advantages,
    make_kl_controller,
    masked_whiten,
    ppo_advantages,
    remax_advantages,
    token_level_rewards,
)
from actors.rl.losses import (
    LossSums,
    aggregate,
    combine_losses,
    dpo_loss,
    entropy_term,
    kl_loss,
    kl_penalty,
    ppo_policy_loss,
    sequence_logprob_sums,
    sft_loss,
    value_loss,
)

__all__ = [
    # advantages.py
    "broadcast_to_tokens", "grpo_outcome_advantages", "make_kl_controller", "masked_whiten", "ppo_advantages",
    "remax_advantages", "token_level_rewards",
    # losses.py
    "LossSums", "aggregate", "combine_losses", "dpo_loss", "entropy_term", "kl_loss", "kl_penalty", "ppo_policy_loss",
    "sequence_logprob_sums", "sft_loss", "value_loss",
]
