"""The driver: runs a plan's dataflow graph on the Ray workers, iteration after iteration.

It is the only dispatcher. From one thread it submits every operation of an iteration
(`app.run.schedule.iteration_ops`: reallocations, calls, releases; checkpoint exports after the
train calls) to all workers of its mesh, iterations in order. Ray runs one caller's tasks on an
actor in submission order, and a task waits for its ObjectRef arguments, so every worker sees
the same global order (no collective deadlocks), calls on disjoint meshes run concurrently, and
iteration i+1's generation starts as soon as iteration i's training (and the reallocation after
it) is done on its GPUs: `step` submits the next iteration before waiting on the current one.
With run.max_staleness = k the units it submits are stages of iterations in the order of
app.run.staleness (generation of iteration i + k + 1 right after the training of iteration i);
DAPO's dynamic sampling runs generation and reward in rounds (app.run.dynamic_sampling).

Tensors never pass through the driver: each call returns (metadata, data) as two objects; the
driver hands the data ObjectRefs of producers' data owners to consumers as top-level arguments
(`app.run.schedule.shards_needed`) and only `ray.get`s the metadata (timings, stats, rewards).

Each call runs as the plan says (`CallSpec.execution`) and its records carry the plan's estimates
beside the measured time and peak memory; the memory margin is checked before the first call
(app.run.headroom). A re-plan switch (app.run.replan) waits until no iteration is in flight.

Checkpoints (app.run.checkpoint) are written atomically after the last train call of an
iteration: every trained role's HF export and state shards, every worker's random generators,
and, once all returned, the driver's own state (app.run.resume.RunState). A run starts fresh or
from a checkpoint (`run.resume`), the same way after a failure: a worker that died, a collective
that broke with it, or a call that stalled (no operation finishing for `run.call_timeout_s`,
the rank that stopped named) makes the driver restart every worker and resume from the latest
complete checkpoint, up to `run.max_restarts` times (app.run.recovery). Any other failure, and
the one past the limit, ends the run with a `DriverError` naming the operation, the iteration,
the worker and the cause on one line; a lost Ray node ends it naming the node and the operations
in flight on it (app.run.failures). metrics.jsonl and timeline.jsonl are rewound to the
checkpoint, so they never hold a duplicate or a missing row.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.rl import make_kl_controller
from app.algorithms import call_params, preference_shard
from app.config import ExperimentConfig
from app.data import BatchIterator, IteratorState, PromptExample
from app.reporting import (
    CallEstimate,
    RayMetricsExporter,
    TimelineRecord,
    Tracker,
    append_records,
    append_samples,
    call_estimates,
    plan_json,
    plan_report,
    rollout_samples,
    span,
    throughput,
    timing_table,
    write_gantt,
)
from app.run.checkpoint import begin, commit, is_due, latest_checkpoint, prune
from app.run.collect import SubmittedOp, submit_checkpoint, wait_ops
from app.run.headroom import check_headroom
from app.run.iteration_metrics import collect_iteration
from app.run.recovery import DriverError, WorkerFailure, guard_params, log_restart, one_line
from app.run.replan import PlanDecision, Replanner, apply_switch
from app.run.resume import (
    RunState,
    check_fingerprint,
    check_run_dir,
    clear_incomplete,
    driver_rng_state,
    fingerprint,
    placement_json,
    read_run_state,
    restore_driver_rng,
    restore_workers,
    rewind_logs,
)
from app.run.runtime import (
    TrainInputs,
    connect_cluster,
    init_world,
    load_models,
    plan_groups,
    preflight,
    setup_groups,
    start_plan_search,
    start_workers,
    wait_plan,
)
from app.run.schedule import (
    CallOp,
    Op,
    home_placements,
    iteration_ops,
    last_train_call,
    prompt_shard,
    sequences_per_iteration,
)
from app.run.staleness import StageSchedule, staleness_metrics
from app.run.submit import call_options, sample_rounds, submit_call, submit_select, submit_weights_op
from cluster.placement import WorkerCallError, WorkerGroup
from planning.simulate import simulate

LOOKAHEAD = 1  # complete iterations submitted beyond the one being waited on


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


class Driver:
    """Set up from a config (Ray, plan, workers, groups, models), then `step()` / `run(n)`."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, worker_cls: type | None = None,
                 inputs: TrainInputs | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume_from = check_run_dir(self.run_dir, cfg.run.resume)  # ConfigError before Ray starts
        self.inputs = inputs if inputs is not None else preflight(cfg)
        resume_state = None if self.resume_from is None else read_run_state(self.resume_from)
        if resume_state is not None:
            check_fingerprint(resume_state, cfg, self.resume_from)  # the run it continues: before Ray too
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.problem = self.inputs.problem
        self.graph = self.problem.graph
        self.total_iterations = cfg.run.iterations
        self.workers: WorkerGroup | None = None
        self._started_ray = not ray.is_initialized()
        self._pending: list[PendingIteration] = []
        self._next_iteration = 0  # iterations whose every stage is submitted
        self._stages: StageSchedule | None = None  # created at the first submission (run(n) may set n)
        self._start = 0  # the iteration this run (re)started at
        self._previous_end: float | None = None
        self.records: list[TimelineRecord] = []
        self.tracker: Tracker | None = None
        self.restarts = 0
        self.replanner: Replanner | None = None
        self._switch: PlanDecision | None = None  # decided, applied once no iteration is in flight
        self._plan_since = 0  # first iteration run under the current plan
        try:
            self._setup(worker_cls, resume_state)
        except (WorkerCallError, TimeoutError) as exc:  # a worker failed while starting: one line
            self.close(write_reports=False)
            raise DriverError(f"setting up the run failed: {one_line(str(exc))}") from None
        except BaseException:
            self.close(write_reports=False)
            raise

    # ---- setup ------------------------------------------------------------------------------------
    def _setup(self, worker_cls: type | None, resume_state: RunState | None) -> None:
        if worker_cls is None:
            from actors.worker import ModelWorker

            worker_cls = ModelWorker
        self._worker_cls = worker_cls
        cfg = self.cfg
        self._info = connect_cluster(cfg)
        planner, plan_ref = start_plan_search(self.inputs)  # the search runs while the workers start
        self._start_workers()
        self.search = wait_plan(cfg, planner, plan_ref)
        self.plan = self.search.plan
        check_headroom(self.problem, self.plan)  # ConfigError before any call
        self.estimates = call_estimates(self.problem, self.plan)
        self.replanner = Replanner(cfg, self.problem, self.plan, self.search.est_iteration_s)
        self._write_plan()
        self.model_roles = tuple(self.inputs.models)
        self._prepare_workers()
        self._start_run_state(self.resume_from, resume_state)
        self.ray_metrics = RayMetricsExporter(self.run_dir.name)  # Gauges for the cluster's Prometheus

    def _start_workers(self) -> None:
        """One worker per GPU (placement groups reserved) in one torch.distributed world."""
        self.workers = start_workers(self._info, self.inputs, self._worker_cls)
        init_world(self.workers, self._info.backend, self.cfg.run.collective_timeout_s)

    def _prepare_workers(self) -> None:
        """The plan's process groups and every model on its home placement."""
        assert self.workers is not None
        cfg = self.cfg
        setup_groups(self.workers, plan_groups(self.inputs, self.plan), cfg.run.collective_timeout_s)
        self.load_meta = load_models(self.workers, self.inputs, self.plan, cfg.run.call_timeout_s)

    def _start_run_state(self, checkpoint: Path | None, state: RunState | None) -> None:
        """Driver state for a fresh run, or `state` of `checkpoint` (driver and workers); the
        logs rewound to it; a tracker appending to them."""
        cfg = self.cfg
        for message in clear_incomplete(self.run_dir):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        self._location = home_placements(self.graph, self.plan, self.model_roles)
        self._batches: BatchIterator[PromptExample] = BatchIterator(
            self.inputs.examples, cfg.batch.prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        p = cfg.ppo
        self.kl = make_kl_controller(p.kl_controller, p.kl_coef, p.kl_target, p.kl_horizon)
        # The KL coefficient each submitted iteration got (restored: the driver runs ahead).
        self._next_iteration, self._kl_used, wandb_id = 0, {}, None
        if checkpoint is not None and state is not None:
            assert self.workers is not None
            self._location = restore_workers(self.workers, self.graph, self.plan, self.model_roles, checkpoint,
                                             state, cfg.run.call_timeout_s)
            self._next_iteration = state.iterations_done
            self._batches.state = IteratorState(state.data_epoch, state.data_position)
            self.kl.value = state.kl_value
            self._kl_used = dict(state.kl_submitted)
            restore_driver_rng(state.rng)
            wandb_id = state.wandb_id
        self._start, self._stages = self._next_iteration, None
        rewind_logs(self.run_dir, self._next_iteration)
        self.records = [r for r in self.records if r.iteration < self._next_iteration]
        self._previous_end = None
        self.tracker = Tracker(self.run_dir, project=cfg.tracking.project, run_name=self.run_dir.name,
                               config=cfg.model_dump(mode="json"), total_iterations=self.total_iterations,
                               wandb_enabled=cfg.tracking.wandb, console=cfg.tracking.console, wandb_id=wandb_id)

    def _write_plan(self) -> None:
        sim = simulate(self.problem, self.plan)
        r = self.search
        report = plan_report(self.problem, self.plan, sim, mode=self.cfg.plan.mode, est_iteration_s=sim.iteration_s,
                             baseline_iteration_s=r.baseline_iteration_s, search_s=r.search_s,
                             evaluated_plans=r.evaluated_plans)
        history = self.replanner.history if self.replanner is not None else []
        out = {**plan_json(report), "since_iteration": self._plan_since, "history": history}
        (self.run_dir / "plan.json").write_text(json.dumps(out, indent=2, allow_nan=False))

    # ---- submission ------------------------------------------------------------------------------
    def _submit_next(self) -> None:
        """Submit the operations of the next unit: a whole iteration, or one stage of one under
        bounded staleness (app.run.staleness). Never blocks, except between dynamic sampling rounds."""
        assert self.workers is not None
        if self._stages is None:
            self._stages = StageSchedule(self.graph, self.total_iterations, self._start)
        unit = self._stages.next_unit()
        i = unit.iteration
        pending = self._open_iteration(i)
        ops, self._location = iteration_ops(self.graph, self.plan, self.model_roles, self._location, unit.calls)
        rounds = self.inputs.settings.dynamic_sampling_rounds
        if rounds is not None and "rew_inf" in unit.calls:
            cut = next(k for k, op in enumerate(ops) if isinstance(op, CallOp) and op.mfc.name == "rew_inf") + 1
            self._submit_sampling_rounds(pending, ops[:cut], rounds)
            ops = ops[cut:]
        for op in ops:
            pending.ops.append(self._submit_op(op, pending, pending.outputs, pending.prompts_ref))
            if isinstance(op, CallOp) and op.mfc == last_train_call(self.graph):
                pending.checkpoint, subs = self._maybe_checkpoint(i)
                pending.ops.extend(subs)
        if unit.completes:
            pending.complete = True
            self._next_iteration += 1

    def _open_iteration(self, i: int) -> PendingIteration:
        """The pending entry of iteration i, created (with its batch) at its first unit."""
        for pending in self._pending:
            if pending.iteration == i:
                return pending
        batch = self._batches.next_batch()
        # DPO reads preference pairs (rows 2i chosen, 2i + 1 rejected); the others read prompts.
        prompts_ref = ray.put(preference_shard(batch) if self.graph.algorithm == "dpo" else prompt_shard(batch))
        # Every sequence carries its prompt (GRPO samples group_size sequences per prompt).
        samples = sequences_per_iteration(self.graph) // len(batch)
        prompt_tokens = samples * sum(len(e.prompt_ids) for e in batch)
        pending = PendingIteration(i, [], prompt_tokens, None, self._batches.state, complete=False,
                                   batch_size=len(batch), prompts_ref=prompts_ref, estimates=self.estimates)
        self._pending.append(pending)
        return pending

    def _submit_op(self, op: Op, pending: PendingIteration, outputs: dict[str, SubmittedOp], prompts_ref: Any,
                   seed_offset: int = 0) -> SubmittedOp:
        """Submit one call (recorded in `outputs`) or weights operation of iteration pending.iteration."""
        assert self.workers is not None
        i = pending.iteration
        if not isinstance(op, CallOp):
            return submit_weights_op(self.workers, self.graph, self.plan, op, i)
        kl_coef = self._kl_used.setdefault(i, self.kl.value)  # restored when resuming
        params = {**call_params(self.inputs.settings, op.mfc, kl_coef), **guard_params(self.cfg)}
        if seed_offset and "seed" in params:
            params = {**params, "seed": int(params["seed"]) + 7919 * seed_offset}
        sub = submit_call(self.workers, self.graph, self.plan, op, i, params, prompts_ref, outputs,
                          all_reward_rows=self.inputs.reward_fn is None)
        outputs[op.mfc.name] = sub
        return sub

    def _submit_sampling_rounds(self, pending: PendingIteration, ops: list[Op], max_rounds: int) -> None:
        """DAPO's dynamic sampling: `ops` (generation through reward) on fresh prompts until enough
        groups with distinct rewards; a select call then makes them the batch the rest reads."""
        assert self.workers is not None
        gen, reward = self.graph.mfc("actor_gen"), self.graph.mfc("rew_inf")

        def submit_round(r: int) -> tuple[SubmittedOp, SubmittedOp]:
            prompts_ref = pending.prompts_ref
            if r:  # every further round on fresh prompts
                prompts_ref = ray.put(prompt_shard(self._batches.next_batch()))
                pending.data_state = self._batches.state
            outputs: dict[str, SubmittedOp] = {}
            pending.ops.extend(self._submit_op(op, pending, outputs, prompts_ref, r) for op in ops)
            return outputs[gen.name], outputs[reward.name]

        kept, shards = sample_rounds(submit_round, lambda sub: self._wait_ops([sub])[sub], pending.batch_size,
                                     gen.batch.n_seqs // pending.batch_size, reward.batch.n_seqs, max_rounds)
        # The select_rows call on the first GPU of the actor's train mesh.
        rank = self.plan[last_train_call(self.graph).name].mesh.start
        select = submit_select(self.workers, pending.iteration, rank, self.problem.cluster.gpus_per_node, shards,
                               reward.batch.n_seqs, kept)
        pending.ops.append(select)
        pending.outputs[gen.name] = pending.outputs[reward.name] = select
        pending.extra_metrics.update(kept.metrics())

    def _checkpoint_due(self, i: int) -> bool:
        c = self.cfg.checkpoint
        return is_due(i + 1, c.every, self.total_iterations, c.at_end)

    def _maybe_checkpoint(self, i: int) -> tuple[Path | None, list[SubmittedOp]]:
        """When one is due after iteration i's training: its staging directory and its writes."""
        if not self._checkpoint_due(i):
            return None, []
        assert self.workers is not None
        try:
            staging = begin(self.run_dir, i + 1)
        except OSError as exc:  # an existing iter_N (never rewritten) or an unwritable run directory
            raise DriverError(f"checkpoint after iteration {i}: {one_line(str(exc))}") from None
        homes = {role: tuple(self._location[role].mesh.gpus) for role in self.graph.trained_roles}
        return staging, submit_checkpoint(self.workers, i, staging, homes)

    # ---- collection ------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one iteration (submitting the next one first, for overlap); returns its metrics."""
        if self._next_iteration >= self.total_iterations and not self._pending:
            raise RuntimeError(f"Driver.step: all {self.total_iterations} iterations (run.iterations) already ran")

        def wants_more() -> bool:
            # The oldest pending iteration must be complete to collect; beyond it keep LOOKAHEAD
            # complete iterations submitted (units of stages under bounded staleness), none while a
            # plan switch waits for the pipeline to drain.
            if not self._pending or not self._pending[0].complete:
                return True
            return self._switch is None and sum(p.complete for p in self._pending) <= LOOKAHEAD

        while (self._stages is None or self._stages.remaining) and wants_more():
            self._submit_next()
        metrics = self._collect(self._pending.pop(0))
        if self._switch is not None and not self._pending:
            self._apply_switch(self._switch)
        return metrics

    def run(self, n: int | None = None) -> list[dict[str, float]]:
        """Run `n` iterations (default run.iterations); closes the driver at the end or on error."""
        if n is not None:
            if n < 1:
                raise ValueError(f"n={n}: must be >= 1")
            self.total_iterations = n
            if self.tracker is not None:
                self.tracker.total_iterations = n
        history: list[dict[str, float]] = []
        try:
            while self._next_iteration < self.total_iterations or self._pending:
                try:
                    history.append(self.step())
                except WorkerFailure as failure:
                    done = self._recover(failure)
                    history = [row for row in history if row["iteration"] < done]
        finally:
            self.close()
        return history

    def _recover(self, failure: WorkerFailure) -> int:
        """Restart every worker and resume from the latest complete checkpoint (see the module
        docstring); returns the iterations that checkpoint holds. DriverError when `failure`
        is not recoverable or run.max_restarts restarts were used."""
        limit = self.cfg.run.max_restarts
        if not failure.recoverable:
            raise DriverError(str(failure)) from None
        if self.restarts >= limit:
            raise DriverError(f"{failure}; gave up after {self.restarts} restart(s) (run.max_restarts={limit})") from None
        self.restarts += 1
        checkpoint = latest_checkpoint(self.run_dir)
        log_restart(self.run_dir, self.restarts, limit, failure, checkpoint)
        self._pending.clear()
        self._switch = None  # a switch not yet applied: the restarted workers load the current plan
        if self.workers is not None:
            self.workers.shutdown()  # kills the actors and removes their placement groups
            self.workers = None
        if self.tracker is not None:
            self.tracker.close()
        try:
            self._start_workers()
            self._prepare_workers()
            self._start_run_state(checkpoint, None if checkpoint is None else read_run_state(checkpoint))
        except (WorkerCallError, TimeoutError) as exc:
            raise DriverError(f"restart {self.restarts} after '{failure}' failed: {one_line(str(exc))}") from None
        return self._next_iteration

    def _collect(self, pending: PendingIteration) -> dict[str, float]:
        metas = self._wait_ops(pending.ops)
        got = collect_iteration(pending.iteration, pending.ops, metas, pending.estimates, self.graph,
                                self._previous_end, self.cfg.plan.memory_margin)
        records, metrics = got.records, got.metrics
        append_records(self.run_dir / "timeline.jsonl", records)
        self.records += records
        n_seqs = sequences_per_iteration(self.graph)
        metrics.update(self._replan(pending.iteration, records))
        metrics.update(pending.extra_metrics)  # dynamic sampling's (the reward of every generated response)
        metrics.update(staleness_metrics(pending.iteration, self.graph.max_staleness, self._start))
        metrics["perf/throughput"] = throughput(pending.prompt_tokens, metrics, n_seqs, self.problem.cluster.n_gpus)
        self._previous_end = span(records)[1]
        if "actor/kl" in metrics:  # adapts the coefficient of the iterations submitted from now on
            self.kl.update(metrics["actor/kl"], n_seqs)
        assert self.tracker is not None
        self.tracker.log(metrics, pending.iteration)
        self.ray_metrics.export(metrics, pending.iteration)
        kinds = {m.name: m.kind for m in self.graph.mfcs}
        append_samples(self.run_dir / "samples.jsonl", pending.iteration, rollout_samples(got.call_metas, kinds))
        if pending.checkpoint is not None:  # after the rows are logged: a resume never skips them
            self._commit_checkpoint(pending, metas)
        return {"iteration": float(pending.iteration), **metrics}

    def _commit_checkpoint(self, pending: PendingIteration, metas: dict[SubmittedOp, list[Any]]) -> None:
        """Make the checkpoint after `pending` complete: the driver's state beside what the
        workers wrote, then the atomic rename; older checkpoints beyond checkpoint.keep go."""
        assert pending.checkpoint is not None and self.tracker is not None
        done, roles = pending.iteration + 1, list(self.graph.trained_roles)
        self._kl_used = {i: v for i, v in self._kl_used.items() if i >= done}
        homes = home_placements(self.graph, self.plan, self.model_roles)
        state = RunState(done, pending.data_state.epoch, pending.data_state.position, self.kl.value, self._kl_used,
                         {role: placement_json(homes[role]) for role in roles}, fingerprint(self.cfg),
                         self.tracker.wandb_id, driver_rng_state())
        exports = {s.name: metas[s][0] for s in pending.ops if s.kind == "export"}
        try:
            commit(pending.checkpoint, done, roles, {"exports": exports, "run_state": state.to_json()},
                   tokenizer_dir=self.cfg.data.tokenizer)
        except (OSError, RuntimeError) as exc:
            raise DriverError(f"checkpoint after iteration {pending.iteration}: {one_line(str(exc))}") from None
        prune(self.run_dir, self.cfg.checkpoint.keep)

    def _wait_ops(self, ops: list[SubmittedOp]) -> dict[SubmittedOp, list[Any]]:
        """Every op's per-rank metadata; a WorkerFailure on a failure or a stall (module doc)."""
        assert self.workers is not None
        later = [op for p in self._pending for op in p.ops if op not in ops]
        return wait_ops(self.workers, ops, later, self.cfg.run.call_timeout_s)

    # ---- re-planning -----------------------------------------------------------------------------
    def _replan(self, iteration: int, records: list[TimelineRecord]) -> dict[str, float]:
        """Feed the re-planner; on a decision adopt the calibrated model (and schedule a switch)."""
        assert self.replanner is not None
        metrics, decision = self.replanner.collect(iteration, records, self.run_dir,
                                                   self._next_iteration < self.total_iterations)
        if decision is not None:
            self.problem = decision.problem
            self.estimates = call_estimates(self.problem, self.plan)
            self._switch = decision if decision.plan is not None else None
            self._write_plan()
        return metrics

    def _apply_switch(self, decision: PlanDecision) -> None:
        """Move every model to the new plan's homes (nothing is in flight), then adopt the plan."""
        assert self.workers is not None and self.replanner is not None and decision.plan is not None
        self._switch = None
        records = apply_switch(self.workers, self.inputs, self._location, decision.plan, self._next_iteration,
                               self.cfg.run.call_timeout_s)
        append_records(self.run_dir / "timeline.jsonl", records)
        self.records += records
        self.plan, self._plan_since = decision.plan, self._next_iteration
        self._location = home_placements(self.graph, self.plan, self.model_roles)
        self.estimates = call_estimates(self.problem, self.plan)
        self.replanner.adopt(self.problem, self.plan, decision.new_est_s)
        self._write_plan()

    # ---- end --------------------------------------------------------------------------------------
    def close(self, write_reports: bool = True) -> None:
        """Write the Gantt chart and timing table, close the tracker, stop the workers. Idempotent."""
        if self.replanner is not None:
            self.replanner.close()
        current = [r for r in self.records if r.iteration >= self._plan_since]  # under the current plan
        if write_reports and current and getattr(self, "plan", None) is not None:
            try:
                write_gantt(current, self.problem, self.plan, self.run_dir / "gantt.png")
                table = timing_table(current, self.problem, self.plan)
                (self.run_dir / "timings.json").write_text(json.dumps(table, indent=1))
            except (OSError, ValueError) as exc:  # reports are extras: never fail a finished run
                warnings.warn(f"could not write the Gantt chart / timings in {self.run_dir}: {exc}", stacklevel=2)
        if self.tracker is not None:
            self.tracker.close()
        self._pending.clear()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


__all__ = ["Driver", "DriverError", "LOOKAHEAD", "PendingIteration", "SubmittedOp", "call_options", "prompt_shard"]
