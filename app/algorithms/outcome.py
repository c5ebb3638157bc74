"""The critic-free outcome-reward algorithms beside GRPO: RLOO, REINFORCE++, REINFORCE++-baseline,
DAPO and GSPO. Their graph is `planning.algorithm_graphs.outcome_graph`; the worker op is
`outcome_actor` (actors.worker.outcome_train), chosen by the `advantage` and `policy_loss` params.

Calls (every call sees n_prompts x group_size rows; row r answers prompt_index r // group_size):

  actor_gen    generate (n_samples = group_size)        -> prompt_ids, response_ids, logprobs, prompt_index
  rew_inf      rule_reward / model_reward               -> rewards
  ref_inf      logprobs (only when a KL term needs it)  -> ref_logprobs
  actor_train  outcome_actor:
    rloo                   s_i - mean of the other samples of its prompt; KL in the reward (ppo.kl_coef)
    reinforce_pp           whitened reward-to-go of the KL-shaped token rewards
    reinforce_pp_baseline  summed KL-shaped rewards minus the prompt's mean, whitened over the batch
    dapo                   GRPO advantages, clip-higher (0.28), token-mean, overlong shaping; dynamic
                           sampling is the driver's (app.run.dynamic_sampling); KL: grpo.kl_loss_coef
    gspo                   GRPO advantages, GSPO's sequence-level ratio clipped to gspo.clip_eps(_high)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.algorithms.ppo import KL_ESTIMATORS, PPOHyperparams, RolloutSettings, inference_params
from planning.dataflow import MFC

OUTCOME_RUNTIME = ("rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo")
ADVANTAGE_OF = {"rloo": "rloo", "reinforce_pp": "reinforce_pp", "reinforce_pp_baseline": "reinforce_pp_baseline",
                "dapo": "grpo", "gspo": "grpo"}
KL_IN_REWARD = ("rloo", "reinforce_pp", "reinforce_pp_baseline")


@dataclass(frozen=True)
class OutcomeHyperparams:
    """The knobs of one outcome algorithm beside the PPO ones it reuses (epochs, minibatches,
    aggregation, entropy, importance weights). clip_eps / clip_eps_high: None keeps ppo's."""

    algorithm: str
    group_size: int
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "low_var_kl"
    scale_by_std: bool = True
    clip_eps: float | None = None
    clip_eps_high: float | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.algorithm not in OUTCOME_RUNTIME:
            raise ValueError(f"algorithm={self.algorithm!r}: outcome algorithms are {', '.join(OUTCOME_RUNTIME)}")
        minimum = 1 if self.algorithm == "reinforce_pp" else 2
        if self.group_size < minimum:
            raise ValueError(f"batch.group_size={self.group_size}: {self.algorithm} needs >= {minimum}")
        if self.kl_loss_coef < 0:
            raise ValueError(f"grpo.kl_loss_coef={self.kl_loss_coef}: must be >= 0")
        if self.kl_loss_coef and self.algorithm in KL_IN_REWARD:
            raise ValueError(f"grpo.kl_loss_coef={self.kl_loss_coef}: {self.algorithm} puts its KL in the reward "
                             "(ppo.kl_coef); must be 0")
        if self.kl_loss_estimator not in KL_ESTIMATORS:
            raise ValueError(f"grpo.kl_loss_estimator={self.kl_loss_estimator!r}: allowed: {', '.join(KL_ESTIMATORS)}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"dapo.overlong_buffer={self.overlong_buffer}, overlong_penalty={self.overlong_penalty}:"
                             " must be >= 0")

    @property
    def kl_in_reward(self) -> bool:
        return self.algorithm in KL_IN_REWARD


def train_params(rollout: RolloutSettings, hp: PPOHyperparams, outcome: OutcomeHyperparams,
                 kl_coef: float) -> dict[str, Any]:
    """The actor_train call's params (kl_coef: this iteration's weight of the KL in the reward)."""
    actor = hp.actor_params(kl_coef if outcome.kl_in_reward else 0.0, rollout.logprob_temperature)
    params = {
        **actor, "op": "outcome_actor", "advantage": ADVANTAGE_OF[outcome.algorithm],
        "policy_loss": "gspo" if outcome.algorithm == "gspo" else "ppo", "group_size": outcome.group_size,
        "kl_loss_coef": outcome.kl_loss_coef, "kl_loss_estimator": outcome.kl_loss_estimator,
        "scale_by_std": outcome.scale_by_std, "overlong_buffer": outcome.overlong_buffer,
        "overlong_penalty": outcome.overlong_penalty, "max_new_tokens": rollout.max_new_tokens,
    }
    if outcome.clip_eps is not None:
        params["clip_eps"] = outcome.clip_eps
    if outcome.clip_eps_high is not None:
        params["clip_eps_high"] = outcome.clip_eps_high
    return params


def call_params(mfc: MFC, rollout: RolloutSettings, hp: PPOHyperparams, outcome: OutcomeHyperparams,
                kl_coef: float) -> dict[str, Any]:
    """CallSpec.params of one call of an outcome graph."""
    if mfc.kind == "generate":
        return {**rollout.generate_params(), "n_samples": outcome.group_size}
    if mfc.kind == "inference":
        return inference_params(mfc, rollout)
    if mfc.role != "actor":
        raise ValueError(f"{outcome.algorithm} call {mfc.name}: trains role {mfc.role!r}; only the actor trains")
    return train_params(rollout, hp, outcome, kl_coef)


__all__ = ["ADVANTAGE_OF", "KL_IN_REWARD", "OUTCOME_RUNTIME", "OutcomeHyperparams", "call_params", "train_params"]
