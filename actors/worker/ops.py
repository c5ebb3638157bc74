"""The worker's ops by name: what `CallSpec.params["op"]` (set by app/algorithms) runs.

A plain mapping from op name to a function `(CallContext, inputs) -> (meta, data shard)`, and
which ops need no model: those run on the worker's MODEL_FREE_GROUP threads (a Ray concurrency
group), beside its GPU calls.
"""

from __future__ import annotations

from actors.worker.calls import run_logprobs, run_model_reward, run_rule_reward, run_values
from actors.worker.multiturn import run_env_reward, run_generation
from actors.worker.outcome_train import run_grpo_actor, run_outcome_actor
from actors.worker.select import run_select_rows
from actors.worker.train import run_dpo_actor, run_ppo_actor, run_ppo_critic, run_remax_actor

# Ops by name (a plain mapping; app/algorithms put the name in CallSpec.params["op"]).
CALL_OPS = {
    "generate": run_generation,
    "rule_reward": run_rule_reward,
    "env_reward": run_env_reward,
    "model_reward": run_model_reward,
    "logprobs": run_logprobs,
    "values": run_values,
    "ppo_actor": run_ppo_actor,
    "ppo_critic": run_ppo_critic,
    "grpo_actor": run_grpo_actor,
    "outcome_actor": run_outcome_actor,
    "select_rows": run_select_rows,
    "remax_actor": run_remax_actor,
    "dpo_actor": run_dpo_actor,
}
MODEL_FREE_OPS = ("rule_reward", "env_reward", "select_rows")
# Model-free calls (decode + score on the host) run on this Ray concurrency group's threads,
# overlapping the worker's next GPU call; they join no collective and are pure functions of
# their inputs, so neither the collective order nor any number changes.
MODEL_FREE_GROUP = "model_free"
CONCURRENCY_GROUPS = {MODEL_FREE_GROUP: 2}


__all__ = ["CALL_OPS", "CONCURRENCY_GROUPS", "MODEL_FREE_GROUP", "MODEL_FREE_OPS"]
