"""The worker: one `ModelWorker` process per GPU holding every model shard placed on it, its call
ops, and the profiler that measures this machine for the cost model.

May import every other package of actors/ (the top layer), never ray, cluster or app.
  data         row ranges, producer shards, packed batches, imports by name
  models       per-role bookkeeping: where a role's shards live and how they bind to modules
  guards       reward functions under a time limit; non-finite rewards, losses, gradient norms
  texts        token ids back to text for rule rewards (shared rows once, the tokenizer's parallel backend)
  memory       the peak GPU memory of each call (a probe reset before it, read after it)
  execution    how a call runs as the plan says: micro-batch token budgets, generation rounds
  calls        `CallSpec`, `CallContext` and the inference ops: rewards, logprobs, values
  generate     the single-turn generation op and what every generation op shares (settings, prompts)
  multiturn    the multi-turn generation op (environments built by name) and the env_reward op
  rollout      `Rollout`: a train call's rows merged from their producer shards and packed
  behaviour    the behaviour policy's logprobs of a train call (actor_inf's, recomputed or reused) and
               the truncated importance weights against the rollout's
  train        the training ops: PPO actor and critic, ReMax and DPO actors
  outcome_train  the group-based outcome algorithms' actor op: GRPO, RLOO, REINFORCE++, DAPO, GSPO
  select       the select_rows op: chosen rows of several calls' shards as one batch (dynamic sampling)
  rehome       a trained model's home moved to another placement, weights and optimizer state
  state        a trained model's checkpoint state per shard, loaded under any layout
  progress     where the call thread of a busy worker is (for stall reports)
  ops          the op table: names to functions, which ops need no model
  model_worker `ModelWorker`: validates, looks up state and calls one function per request
  profiler     microbenchmarks of this machine (matmuls, copies, collectives, engine steps)
  profile_fit  the cost model's efficiency factors fitted to the profiler's measurements
"""

from __future__ import annotations

from actors.worker.calls import CallSpec
from actors.worker.data import RowTensors, make_shard
from actors.worker.execution import plan_micro_batching
from actors.worker.memory import MemoryPeak, MemoryProbe, memory_probe_for
from actors.worker.model_worker import ModelWorker
from actors.worker.models import placement_group_sets
from actors.worker.ops import CALL_OPS, CONCURRENCY_GROUPS, MODEL_FREE_GROUP, MODEL_FREE_OPS
from actors.worker.profile_fit import fit_efficiency, fit_tp_comm, predicted_seconds, predicted_tp_fwd_bwd_s
from actors.worker.profiler import (
    MIN_EFFICIENCY,
    CollectiveTiming,
    EngineTiming,
    ProfileSettings,
    cut_model,
    measure_engine,
    measure_hardware,
)
from actors.worker.texts import decode_many, decodes_through_byte_table

__all__ = [
    # models.py
    "placement_group_sets",
    # memory.py
    "MemoryPeak", "MemoryProbe", "memory_probe_for",
    # execution.py
    "plan_micro_batching",
    # calls.py
    "CallSpec",
    # data.py
    "RowTensors", "make_shard",
    # model_worker.py
    "ModelWorker",
    # ops.py
    "CALL_OPS", "CONCURRENCY_GROUPS", "MODEL_FREE_GROUP", "MODEL_FREE_OPS",
    # profiler.py
    "MIN_EFFICIENCY", "CollectiveTiming", "EngineTiming", "ProfileSettings", "cut_model", "measure_engine",
    "measure_hardware",
    # texts.py
    "decode_many",
    "decodes_through_byte_table",
    # profile_fit.py
    "fit_efficiency", "fit_tp_comm", "predicted_seconds", "predicted_tp_fwd_bwd_s",
]
