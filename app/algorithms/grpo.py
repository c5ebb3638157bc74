"""GRPO (Shao et al. 2024, DeepSeekMath): `group_size` samples per prompt, group-normalised outcome
rewards as advantages, no critic, KL to the reference as a loss term instead of a reward penalty.

Calls of `planning.algorithm_graphs.grpo_graph` (every call sees n_prompts x group_size rows; the generate
op writes prompt_index = r // group_size for row r, and the actor groups rows by it, checking that
each prompt has exactly group_size of them):

  actor_gen    generate (n_samples = group_size)      -> prompt_ids, response_ids, logprobs, ...
  rew_inf      rule_reward / model_reward             -> rewards
  ref_inf      logprobs (pruned with kl_loss_coef 0)  -> ref_logprobs
  actor_train  grpo_actor: A_i = (s_i - mean_group) / (std_group + eps) on every response token
               (Dr. GRPO without the division: scale_by_std=False), clipped surrogate plus
               kl_loss_coef * KL(pi || pi_ref) (low-variance k3 estimator by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.algorithms.ppo import KL_ESTIMATORS, PPOHyperparams, RolloutSettings, inference_params
from planning.dataflow import MFC


@dataclass(frozen=True)
class GRPOHyperparams:
    """GRPO's own knobs beside the PPO ones it reuses (clip, epochs, minibatches, aggregation)."""

    group_size: int = 8
    kl_loss_coef: float = 0.001
    kl_loss_estimator: str = "low_var_kl"
    scale_by_std: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"batch.group_size={self.group_size}: GRPO needs >= 2 samples per prompt")
        if self.kl_loss_coef < 0:
            raise ValueError(f"grpo.kl_loss_coef={self.kl_loss_coef}: must be >= 0")
        if self.kl_loss_estimator not in KL_ESTIMATORS:
            raise ValueError(f"grpo.kl_loss_estimator={self.kl_loss_estimator!r}: allowed: {', '.join(KL_ESTIMATORS)}")


def call_params(mfc: MFC, rollout: RolloutSettings, hp: PPOHyperparams, grpo: GRPOHyperparams) -> dict[str, Any]:
    """CallSpec.params of one call of the GRPO graph (the reward carries no KL penalty)."""
    if mfc.kind == "generate":
        return {**rollout.generate_params(), "n_samples": grpo.group_size}
    if mfc.kind == "inference":
        return inference_params(mfc, rollout)
    if mfc.role != "actor":
        raise ValueError(f"GRPO call {mfc.name}: trains role {mfc.role!r}; only the actor trains")
    actor = hp.actor_params(0.0, rollout.logprob_temperature)
    return {**actor, "op": "grpo_actor", "group_size": grpo.group_size, "kl_loss_coef": grpo.kl_loss_coef,
            "kl_loss_estimator": grpo.kl_loss_estimator, "scale_by_std": grpo.scale_by_std}


__all__ = ["GRPOHyperparams", "call_params"]
