"""What the driver has submitted and submits next: the run's iterations (or, under bounded
staleness, stages of them, app.run.staleness) turned into Ray tasks, pending until collected.

A `Dispatch` holds the run's position: the data iterator, the adaptive KL controller and the
coefficient each submitted iteration got (the driver runs ahead of its metrics, and a resumed
run must hand out the same ones), the stage schedule, where every model is once the ops
submitted so far have run, and the pending iterations. `submit_next` never blocks, except
between DAPO's sampling rounds (each round's rewards decide whether another runs). A
checkpoint's writes are submitted right after the last train call of an iteration due one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.rl import AdaptiveKLController, FixedKLController
from app.algorithms import call_params, preference_shard
from app.config import ExperimentConfig
from app.data import BatchIterator, IteratorState, PromptExample
from app.reporting import CallEstimate
from app.run.checkpoint import begin, is_due
from app.run.collect import SubmittedOp, submit_checkpoint
from app.run.recovery import DriverError, guard_params, one_line
from app.run.runtime import TrainInputs
from app.run.schedule import CallOp, Op, iteration_ops, last_train_call, prompt_shard, sequences_per_iteration
from app.run.staleness import StageSchedule
from app.run.submit import sample_rounds, submit_call, submit_select, submit_weights_op
from cluster.placement import WorkerGroup
from planning.plan import ExecutionPlan, Placement


@dataclass
class PendingIteration:
    """What the driver keeps of a submitted iteration until its metadata is collected.
    complete: every stage of it is submitted; outputs: its calls' data producers by call name."""

    iteration: int
    ops: list[SubmittedOp]
    prompt_tokens: int
    checkpoint: Path | None  # the staging directory of the checkpoint after this iteration
    data_state: IteratorState  # the data iterator after this iteration's batch(es)
    complete: bool = True
    outputs: dict[str, SubmittedOp] = field(default_factory=dict)
    batch_size: int = 0
    prompts_ref: Any = None
    extra_metrics: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, CallEstimate] = field(default_factory=dict)  # of the plan it was submitted under


@dataclass(frozen=True)
class Target:
    """What one submission goes to: the workers, the plan (and its per-call estimates) they run,
    and how to wait for ops (DAPO's rounds read the rewards)."""

    workers: WorkerGroup
    plan: ExecutionPlan
    estimates: dict[str, CallEstimate]
    wait: Callable[[list[SubmittedOp]], dict[SubmittedOp, list[Any]]]


class Dispatch:
    """The submitted side of a run that starts (or resumes) at iteration `start`."""

    def __init__(self, cfg: ExperimentConfig, inputs: TrainInputs, run_dir: Path, start: int,
                 location: dict[str, Placement], batches: BatchIterator[PromptExample], kl: FixedKLController | AdaptiveKLController,
                 kl_used: dict[int, float]) -> None:
        self.cfg, self.inputs, self.run_dir = cfg, inputs, run_dir
        self.graph = inputs.problem.graph
        self.start = self.next_iteration = start  # next_iteration: iterations whose every stage is submitted
        self.location, self.batches, self.kl, self.kl_used = location, batches, kl, kl_used
        self.pending: list[PendingIteration] = []
        self._stages: StageSchedule | None = None  # created at the first submission (run(n) may set n)

    def has_more(self) -> bool:
        return self._stages is None or self._stages.remaining > 0

    def submit_next(self, to: Target, total_iterations: int) -> None:
        """Submit the operations of the next unit: a whole iteration, or one stage of one."""
        if self._stages is None:
            self._stages = StageSchedule(self.graph, total_iterations, self.start)
        unit = self._stages.next_unit()
        i = unit.iteration
        pending = self._open_iteration(i, to)
        ops, self.location = iteration_ops(self.graph, to.plan, tuple(self.inputs.models), self.location, unit.calls)
        rounds = self.inputs.settings.dynamic_sampling_rounds
        if rounds is not None and "rew_inf" in unit.calls:
            cut = next(k for k, op in enumerate(ops) if isinstance(op, CallOp) and op.mfc.name == "rew_inf") + 1
            self._submit_sampling_rounds(pending, ops[:cut], rounds, to)
            ops = ops[cut:]
        for op in ops:
            pending.ops.append(self._submit_op(op, pending, pending.outputs, pending.prompts_ref, to))
            if isinstance(op, CallOp) and op.mfc == last_train_call(self.graph):
                pending.checkpoint, subs = self._maybe_checkpoint(i, to.workers, total_iterations)
                pending.ops.extend(subs)
        if unit.completes:
            pending.complete = True
            self.next_iteration += 1

    def _open_iteration(self, i: int, to: Target) -> PendingIteration:
        """The pending entry of iteration i, created (with its batch) at its first unit."""
        for pending in self.pending:
            if pending.iteration == i:
                return pending
        batch = self.batches.next_batch()
        # DPO reads preference pairs (rows 2i chosen, 2i + 1 rejected); the others read prompts.
        prompts_ref = ray.put(preference_shard(batch) if self.graph.algorithm == "dpo" else prompt_shard(batch))
        # Every sequence carries its prompt (GRPO samples group_size sequences per prompt).
        samples = sequences_per_iteration(self.graph) // len(batch)
        prompt_tokens = samples * sum(len(e.prompt_ids) for e in batch)
        pending = PendingIteration(i, [], prompt_tokens, None, self.batches.state, complete=False,
                                   batch_size=len(batch), prompts_ref=prompts_ref, estimates=to.estimates)
        self.pending.append(pending)
        return pending

    def _submit_op(self, op: Op, pending: PendingIteration, outputs: dict[str, SubmittedOp], prompts_ref: Any,
                   to: Target, seed_offset: int = 0) -> SubmittedOp:
        """Submit one call (recorded in `outputs`) or weights operation of iteration pending.iteration."""
        i = pending.iteration
        if not isinstance(op, CallOp):
            return submit_weights_op(to.workers, self.graph, to.plan, op, i)
        kl_coef = self.kl_used.setdefault(i, self.kl.value)  # restored when resuming
        params = {**call_params(self.inputs.settings, op.mfc, kl_coef), **guard_params(self.cfg)}
        if seed_offset and "seed" in params:
            params = {**params, "seed": int(params["seed"]) + 7919 * seed_offset}
        sub = submit_call(to.workers, self.graph, to.plan, op, i, params, prompts_ref, outputs,
                          all_reward_rows=self.inputs.reward_fn is None)
        outputs[op.mfc.name] = sub
        return sub

    def _submit_sampling_rounds(self, pending: PendingIteration, ops: list[Op], max_rounds: int, to: Target) -> None:
        """DAPO's dynamic sampling: `ops` (generation through reward) on fresh prompts until enough
        groups with distinct rewards; a select call then makes them the batch the rest reads."""
        gen, reward = self.graph.mfc("actor_gen"), self.graph.mfc("rew_inf")

        def submit_round(r: int) -> tuple[SubmittedOp, SubmittedOp]:
            prompts_ref = pending.prompts_ref
            if r:  # every further round on fresh prompts
                prompts_ref = ray.put(prompt_shard(self.batches.next_batch()))
                pending.data_state = self.batches.state
            outputs: dict[str, SubmittedOp] = {}
            pending.ops.extend(self._submit_op(op, pending, outputs, prompts_ref, to, r) for op in ops)
            return outputs[gen.name], outputs[reward.name]

        kept, shards = sample_rounds(submit_round, lambda sub: to.wait([sub])[sub], pending.batch_size,
                                     gen.batch.n_seqs // pending.batch_size, reward.batch.n_seqs, max_rounds)
        # The select_rows call on the first GPU of the actor's train mesh.
        rank = to.plan[last_train_call(self.graph).name].mesh.start
        select = submit_select(to.workers, pending.iteration, rank, self.inputs.problem.cluster.gpus_per_node, shards,
                               reward.batch.n_seqs, kept)
        pending.ops.append(select)
        pending.outputs[gen.name] = pending.outputs[reward.name] = select
        pending.extra_metrics.update(kept.metrics())

    def _maybe_checkpoint(self, i: int, workers: WorkerGroup, total: int) -> tuple[Path | None, list[SubmittedOp]]:
        """When one is due after iteration i's training: its staging directory and its writes."""
        c = self.cfg.checkpoint
        if not is_due(i + 1, c.every, total, c.at_end):
            return None, []
        try:
            staging = begin(self.run_dir, i + 1)
        except OSError as exc:  # an existing iter_N (never rewritten) or an unwritable run directory
            raise DriverError(f"checkpoint after iteration {i}: {one_line(str(exc))}") from None
        homes = {role: tuple(self.location[role].mesh.gpus) for role in self.graph.trained_roles}
        return staging, submit_checkpoint(workers, i, staging, homes)


__all__ = ["Dispatch", "PendingIteration", "Target"]
