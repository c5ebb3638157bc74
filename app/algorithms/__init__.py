"""RLHF algorithms on the runtime: each module fills the `CallSpec.params` of its graph's calls.

The graphs themselves are `planning.dataflow.{ppo,outcome,remax,dpo}_graph`; the worker-side
computations are in actors.worker (calls, train, outcome_train). DPO reads preference pairs
instead of generating (see app.algorithms.dpo); its pairs stay together in every dp and
micro-batch split (SequenceBatch.group_size=2). May import planning, app.config and app.data.
  ppo       PPO: rollout settings, hyperparameters and the params of every call
  grpo      GRPO: group-relative advantages, the KL loss term
  outcome   RLOO, REINFORCE++, REINFORCE++-baseline, DAPO, GSPO: the outcome_actor op's params
  remax     ReMax: the greedy baseline (and a KL penalty against the ref when ppo.kl_coef > 0)
  dpo       DPO: preference pairs as the batch, the pairwise loss
  settings  `AlgorithmSettings` from the config, and `call_params` per call
"""

from __future__ import annotations

from app.algorithms.dpo import DPOHyperparams, preference_shard, toy_preference_records
from app.algorithms.grpo import GRPOHyperparams
from app.algorithms.outcome import OUTCOME_RUNTIME, OutcomeHyperparams
from app.algorithms.ppo import PPOHyperparams, RolloutSettings
from app.algorithms.settings import (
    MULTI_TURN_ALGORITHMS,
    RUNTIME_ALGORITHMS,
    AlgorithmSettings,
    call_params,
    settings_from_config,
)

__all__ = [
    # ppo.py
    "PPOHyperparams", "RolloutSettings",
    # grpo.py
    "GRPOHyperparams",
    # outcome.py
    "OUTCOME_RUNTIME", "OutcomeHyperparams",
    # dpo.py
    "DPOHyperparams", "preference_shard", "toy_preference_records",
    # settings.py
    "AlgorithmSettings", "MULTI_TURN_ALGORITHMS", "RUNTIME_ALGORITHMS", "call_params", "settings_from_config",
]
