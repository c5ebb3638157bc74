"""ReMax (Li et al. 2023): REINFORCE with the reward of the greedy response as the baseline.

Calls of `planning.algorithm_graphs.remax_graph`:

  sample_gen      generate (sampling)                     -> prompt_ids, response_ids, logprobs, ...
  greedy_gen      generate (greedy, out_prefix greedy_)   -> greedy_prompt_ids, greedy_response_ids, ...
  rew_inf         reward of the sampled responses         -> rewards
  greedy_rew_inf  reward of the greedy responses          -> greedy_rewards
  ref_inf         the reference's logprobs (only when ppo.kl_coef > 0) -> ref_logprobs
  actor_train     remax_actor: per-token rewards (score at the last token, minus kl_coef * KL of the
                  actor's recomputed logprobs against the ref), reward-to-go minus the greedy score,
                  clipped surrogate.
"""

from __future__ import annotations

from typing import Any

from app.algorithms.ppo import PPOHyperparams, RolloutSettings, inference_params
from planning.dataflow import MFC

GREEDY_PREFIX = "greedy_"


def call_params(mfc: MFC, rollout: RolloutSettings, hp: PPOHyperparams, kl_coef: float) -> dict[str, Any]:
    """CallSpec.params of one call of the ReMax graph."""
    if mfc.kind == "generate":
        greedy = mfc.name.startswith("greedy")
        params = rollout.generate_params(greedy=greedy)
        return {**params, "out_prefix": GREEDY_PREFIX} if greedy else params
    if mfc.kind == "inference":
        if mfc.role == "reward" and mfc.name.startswith("greedy"):
            return rollout.reward_params(in_prefix=GREEDY_PREFIX, out_key="greedy_rewards")
        return inference_params(mfc, rollout)
    if mfc.role != "actor":
        raise ValueError(f"ReMax call {mfc.name}: trains role {mfc.role!r}; only the actor trains")
    # REINFORCE advantages are not whitened by default (the greedy baseline already centres them).
    return {**hp.actor_params(kl_coef, rollout.logprob_temperature), "op": "remax_actor", "whiten": False}


__all__ = ["GREEDY_PREFIX", "call_params"]
