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

Failures end the run with a `DriverError` naming the operation, the iteration and the worker:
a worker that raised or died as soon as its result arrives, and a stall (no operation finishing
for `run.call_timeout_s`; collectives themselves time out after `run.collective_timeout_s`).
A lost Ray node is named with the operations in flight on it (app.run.failures).
metrics.jsonl, timeline.jsonl and complete checkpoints written before stay valid.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from actors.rl import make_kl_controller
from actors.worker import MODEL_FREE_GROUP, MODEL_FREE_OPS, CallSpec
from app.algorithms import call_params, preference_shard
from app.config import ExperimentConfig
from app.data import BatchIterator, PromptExample
from app.reporting import (
    CallEstimate,
    RayMetricsExporter,
    TimelineRecord,
    Tracker,
    append_records,
    append_samples,
    call_estimates,
    fidelity_metrics,
    memory_overruns,
    plan_json,
    plan_report,
    realloc_metrics,
    records_of,
    rollout_metrics,
    rollout_samples,
    span,
    throughput,
    timing_metrics,
    timing_table,
    write_gantt,
)
from app.run.checkpoint import checkpoint_dir, is_due, mark_complete
from app.run.dynamic_sampling import SELECT_CALL, GroupFilter, rewards_in_row_order, select_call
from app.run.failures import explain_node_loss
from app.run.headroom import check_headroom
from app.run.replan import PlanDecision, Replanner, apply_switch
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
from app.run.schedule import CallOp, Op, ReallocOp, ReleaseOp, home_placements, iteration_ops, shards_needed
from app.run.staleness import StageSchedule, staleness_metrics
from cluster.health import NODE_LOSS_WAIT_S
from cluster.placement import WorkerGroup
from planning.plan import Placement
from planning.simulate import simulate

LOOKAHEAD = 1  # iterations submitted beyond the one being waited on
FAILURE_SETTLE_S = 5.0


class DriverError(RuntimeError):
    """An operation failed or stalled; the message names it, its iteration and the worker(s)."""


@dataclass(frozen=True, eq=False)  # identity equality: ops are dict keys while collected
class SubmittedOp:
    """One operation as submitted: meta refs in `ranks` order, data refs of the data owners."""

    iteration: int
    name: str
    kind: str  # call | realloc | release | export
    ranks: tuple[int, ...]
    meta_refs: tuple[ray.ObjectRef, ...]
    data_refs: dict[int, ray.ObjectRef] = field(default_factory=dict)
    placement: Placement | None = None  # where its data came from, when not the plan's (dyn_select)
    n_rows: int | None = None

    def describe(self) -> str:
        return f"{self.kind} '{self.name}' of iteration {self.iteration}"


@dataclass
class PendingIteration:
    """What the driver keeps of a submitted iteration until its metadata is collected.
    complete: every stage of it is submitted; outputs: its calls' data producers by call name."""

    iteration: int
    ops: list[SubmittedOp]
    prompt_tokens: int
    checkpoint: Path | None
    complete: bool = True
    outputs: dict[str, SubmittedOp] = field(default_factory=dict)
    batch: list[Any] = field(default_factory=list)
    prompts_ref: Any = None
    extra_metrics: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, CallEstimate] = field(default_factory=dict)  # of the plan it was submitted under


class Driver:
    """Set up from a config (Ray, plan, workers, groups, models), then `step()` / `run(n)`."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, worker_cls: type | None = None,
                 inputs: TrainInputs | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.inputs = inputs if inputs is not None else preflight(cfg)
        self.problem = self.inputs.problem
        self.graph = self.problem.graph
        self.total_iterations = cfg.run.iterations
        self.workers: WorkerGroup | None = None
        self._started_ray = not ray.is_initialized()
        self._pending: list[PendingIteration] = []
        self._next_iteration = 0  # iterations whose every stage is submitted
        self._stages: StageSchedule | None = None  # created at the first submission (run(n) may set n)
        self._previous_end: float | None = None
        self.records: list[TimelineRecord] = []
        self.tracker: Tracker | None = None
        self.replanner: Replanner | None = None
        self._switch: PlanDecision | None = None  # decided, applied once no iteration is in flight
        self._plan_since = 0  # first iteration run under the current plan
        try:
            self._setup(worker_cls)
        except BaseException:
            self.close(write_reports=False)
            raise

    # ---- setup ------------------------------------------------------------------------------------
    def _setup(self, worker_cls: type | None) -> None:
        if worker_cls is None:
            from actors.worker import ModelWorker

            worker_cls = ModelWorker
        cfg = self.cfg
        info = connect_cluster(cfg)
        planner, plan_ref = start_plan_search(self.inputs)  # the search runs while the workers start
        self.workers = start_workers(info, self.inputs, worker_cls)
        init_world(self.workers, info.backend, cfg.run.collective_timeout_s)
        self.search = wait_plan(cfg, planner, plan_ref)
        self.plan = self.search.plan
        check_headroom(self.problem, self.plan)  # ConfigError before any call
        self.estimates = call_estimates(self.problem, self.plan)
        self.replanner = Replanner(cfg, self.problem, self.plan, self.search.est_iteration_s)
        self._write_plan()
        setup_groups(self.workers, plan_groups(self.inputs, self.plan), cfg.run.collective_timeout_s)
        self.load_meta = load_models(self.workers, self.inputs, self.plan, cfg.run.call_timeout_s)
        self.model_roles = tuple(self.inputs.models)
        self._location = home_placements(self.graph, self.plan, self.model_roles)
        self._batches: BatchIterator[PromptExample] = BatchIterator(
            self.inputs.examples, cfg.batch.prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        p = cfg.ppo
        self.kl = make_kl_controller(p.kl_controller, p.kl_coef, p.kl_target, p.kl_horizon)
        self.tracker = Tracker(self.run_dir, project=cfg.tracking.project, run_name=self.run_dir.name,
                               config=cfg.model_dump(mode="json"), total_iterations=self.total_iterations,
                               wandb_enabled=cfg.tracking.wandb, console=cfg.tracking.console)
        self.ray_metrics = RayMetricsExporter(self.run_dir.name)  # Gauges for the cluster's Prometheus

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
            self._stages = StageSchedule(self.graph, self.total_iterations)
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
            if isinstance(op, CallOp) and op.mfc.kind == "train" and op.mfc == self._last_train():
                pending.ops.extend(self._maybe_checkpoint(i))
        if unit.completes:
            pending.complete = True
            pending.checkpoint = checkpoint_dir(self.run_dir, i + 1) if self._checkpoint_due(i) else None
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
        samples = self._n_sequences() // len(batch)
        prompt_tokens = samples * sum(len(e.prompt_ids) for e in batch)
        pending = PendingIteration(i, [], prompt_tokens, None, complete=False, batch=batch, prompts_ref=prompts_ref,
                                   estimates=self.estimates)
        self._pending.append(pending)
        return pending

    def _submit_op(self, op: Op, pending: PendingIteration, outputs: dict[str, SubmittedOp], prompts_ref: Any,
                   seed_offset: int = 0) -> SubmittedOp:
        """Submit one call (recorded in `outputs`) or weights operation of iteration pending.iteration."""
        if not isinstance(op, CallOp):
            return self._submit_weights_op(op, pending.iteration)
        params = call_params(self.inputs.settings, op.mfc, self.kl.value)
        if seed_offset and "seed" in params:
            params = {**params, "seed": int(params["seed"]) + 7919 * seed_offset}
        sub = self._submit_call(op, pending.iteration, params, prompts_ref, outputs)
        outputs[op.mfc.name] = sub
        return sub

    def _submit_sampling_rounds(self, pending: PendingIteration, ops: list[Op], max_rounds: int) -> None:
        """DAPO's dynamic sampling: `ops` (generation through reward) on fresh prompts until enough
        groups with distinct rewards; a select call then makes them the batch the rest reads."""
        gen, reward = self.graph.mfc("actor_gen"), self.graph.mfc("rew_inf")
        group_size = gen.batch.n_seqs // len(pending.batch)
        kept = GroupFilter(len(pending.batch), group_size, max_rounds)
        shards: list[tuple[int, SubmittedOp]] = []
        prompts_ref = pending.prompts_ref
        for r in range(max_rounds):
            if r:
                prompts_ref = ray.put(prompt_shard(self._batches.next_batch()))
            outputs: dict[str, SubmittedOp] = {}
            pending.ops += [self._submit_op(op, pending, outputs, prompts_ref, r) for op in ops]
            shards += [(r, outputs[gen.name]), (r, outputs[reward.name])]
            metas = self._wait(PendingIteration(pending.iteration, [outputs[reward.name]], 0, None))
            if kept.add_round(rewards_in_row_order(metas[outputs[reward.name]], reward.batch.n_seqs)):
                break
        # The select_rows call (actors.worker.select) on the first GPU of the actor's train mesh.
        assert self.workers is not None
        rank = self.plan[self._last_train().name].mesh.start
        refs = [(r, ref) for r, sub in shards for ref in sub.data_refs.values()]
        spec = select_call(pending.iteration, rank, self.problem.cluster.gpus_per_node, [r for r, _ in refs],
                           reward.batch.n_seqs, kept)
        run_call = self.workers.actor(rank).run_call.options(**call_options(spec))
        meta, data = run_call.remote(spec, *(ref for _, ref in refs))
        select = SubmittedOp(pending.iteration, SELECT_CALL, "call", (rank,), (meta,), {rank: data}, spec.placement,
                             spec.n_rows)
        pending.ops.append(select)
        pending.outputs[gen.name] = pending.outputs[reward.name] = select
        pending.extra_metrics.update(kept.metrics())

    def _submit_call(self, op: CallOp, i: int, params: dict[str, Any], prompts_ref: ray.ObjectRef,
                     outputs: dict[str, SubmittedOp]) -> SubmittedOp:
        mfc, placement = op.mfc, op.placement
        n_rows = mfc.batch.n_seqs
        spec = CallSpec(mfc.name, mfc.role, mfc.kind, placement, i, n_rows, params, self.plan.execution(mfc.name))
        all_rows = not (mfc.role == "reward" and self.inputs.reward_fn is not None)
        metas, datas = [], {}
        # Generation reads the prompts; DPO's calls read the preference pairs (graph.dataset_keys).
        reads_dataset = mfc.kind == "generate" or bool(set(mfc.input_keys) & set(self.graph.dataset_keys))
        for rank in op.ranks:
            args: list[ray.ObjectRef] = [prompts_ref] if reads_dataset else []
            for parent in self.graph.data_parents(mfc.name):
                # Rows of producer and consumer are the same sequences unless their counts differ.
                source = outputs[parent]
                parent_rows = source.n_rows or self.graph.mfc(parent).batch.n_seqs
                needed = shards_needed(placement, rank, source.placement or self.plan[parent], parent_rows,
                                       all_rows or parent_rows != n_rows)
                args.extend(source.data_refs[o.rank] for o in needed)
            meta_ref, data_ref = self.workers.actor(rank).run_call.options(**call_options(spec)).remote(spec, *args)
            metas.append(meta_ref)
            datas[rank] = data_ref
        return SubmittedOp(i, mfc.name, "call", op.ranks, tuple(metas), datas)

    def _submit_weights_op(self, op: Op, i: int) -> SubmittedOp:
        assert self.workers is not None
        if isinstance(op, ReallocOp):
            refs = tuple(self.workers.actor(r).reallocate.remote(op.role, op.src, op.dst) for r in op.ranks)
            return SubmittedOp(i, self._dst_call(op), "realloc", op.ranks, refs)
        assert isinstance(op, ReleaseOp)
        refs = tuple(self.workers.actor(r).release.remote(op.role, op.placement) for r in op.ranks)
        return SubmittedOp(i, op.role, "release", op.ranks, refs)

    def _dst_call(self, op: ReallocOp) -> str:
        """The call a reallocation prepares (the first call of the role on its destination)."""
        return next(m.name for m in self.graph.mfcs if m.role == op.role and self.plan[m.name] == op.dst)

    def _n_sequences(self) -> int:
        """Sequences per iteration: the first generation call's rows (the first call's without one,
        e.g. DPO's 2 x pairs)."""
        return next((m.batch.n_seqs for m in self.graph.mfcs if m.kind == "generate"), self.graph.mfcs[0].batch.n_seqs)

    def _last_train(self) -> Any:
        return [m for m in self.graph.mfcs if m.kind == "train"][-1]

    def _checkpoint_due(self, i: int) -> bool:
        c = self.cfg.checkpoint
        return is_due(i + 1, c.every, self.total_iterations, c.at_end)

    def _maybe_checkpoint(self, i: int) -> list[SubmittedOp]:
        """Exports of every trained role after iteration i's training, when one is due."""
        if not self._checkpoint_due(i):
            return []
        assert self.workers is not None
        target = checkpoint_dir(self.run_dir, i + 1)
        subs = []
        for role in self.graph.trained_roles:
            ranks = tuple(self._location[role].mesh.gpus)
            refs = tuple(self.workers.actor(r).export.remote(role, str(target / role)) for r in ranks)
            subs.append(SubmittedOp(i, role, "export", ranks, refs))
        return subs

    # ---- collection ------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one iteration (submitting the next one first, for overlap); returns its metrics."""
        if self._next_iteration >= self.total_iterations and not self._pending:
            raise RuntimeError(f"Driver.step: all {self.total_iterations} iterations (run.iterations) already ran")

        def complete() -> int:
            return sum(p.complete for p in self._pending)

        def wants_more() -> bool:
            # The oldest pending iteration must be complete to collect; beyond it keep LOOKAHEAD
            # complete iterations submitted (units of stages under bounded staleness), none while a
            # plan switch waits for the pipeline to drain.
            if not self._pending or not self._pending[0].complete:
                return True
            return self._switch is None and complete() <= LOOKAHEAD

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
        history = []
        try:
            while self._next_iteration < self.total_iterations or self._pending:
                history.append(self.step())
        finally:
            self.close()
        return history

    def _collect(self, pending: PendingIteration) -> dict[str, float]:
        metas = self._wait(pending)
        records: list[TimelineRecord] = []
        call_metas: dict[str, list[dict[str, Any]]] = {}
        realloc_metas: list[Any] = []
        for sub in pending.ops:
            estimate = pending.estimates.get(sub.name) if sub.kind == "call" else None
            records += records_of(pending.iteration, sub.name, sub.kind, sub.ranks, metas[sub], estimate)
            if sub.kind == "call":
                call_metas[sub.name] = [m for m in metas[sub] if isinstance(m, dict)]
            elif sub.kind == "realloc":
                realloc_metas += metas[sub]
        if pending.checkpoint is not None:
            exports = {s.name: metas[s][0] for s in pending.ops if s.kind == "export"}
            mark_complete(pending.checkpoint, pending.iteration + 1, list(self.graph.trained_roles), exports,
                          tokenizer_dir=self.cfg.data.tokenizer)
        append_records(self.run_dir / "timeline.jsonl", records)
        self.records += records
        kinds = {m.name: m.kind for m in self.graph.mfcs}
        metrics = {**timing_metrics(records, self._previous_end), **realloc_metrics(realloc_metas),
                   **rollout_metrics(call_metas, kinds), **fidelity_metrics(records)}
        for line in memory_overruns(records, self.cfg.plan.memory_margin):
            warnings.warn(line, stacklevel=2)
        metrics.update(self._replan(pending.iteration, records))
        metrics.update(pending.extra_metrics)  # dynamic sampling's (the reward of every generated response)
        metrics.update(staleness_metrics(pending.iteration, self.graph.max_staleness))
        metrics["perf/throughput"] = throughput(pending.prompt_tokens, metrics, self._n_sequences(),
                                                self.problem.cluster.n_gpus)
        self._previous_end = span(records)[1]
        if "actor/kl" in metrics:  # adapts the coefficient of the iterations submitted from now on
            self.kl.update(metrics["actor/kl"], self._n_sequences())
        assert self.tracker is not None
        self.tracker.log(metrics, pending.iteration)
        self.ray_metrics.export(metrics, pending.iteration)
        append_samples(self.run_dir / "samples.jsonl", pending.iteration, rollout_samples(call_metas, kinds))
        return {"iteration": float(pending.iteration), **metrics}

    def _wait(self, pending: PendingIteration) -> dict[SubmittedOp, list[Any]]:
        """Every op's per-rank metadata; DriverError on a failure or a stall (see module doc)."""
        assert self.workers is not None
        where = {ref: (sub, rank) for sub in pending.ops for rank, ref in zip(sub.ranks, sub.meta_refs)}
        results: dict[ray.ObjectRef, Any] = {}
        remaining = list(where)
        timeout = self.cfg.run.call_timeout_s
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=timeout)
            if not ready:
                self._raise_stall(pending, remaining, where, timeout)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except RayError as error:
                    sub, rank = where[ref]
                    ops = [*pending.ops, *(op for later in self._pending for op in later.ops)]
                    lost = explain_node_loss(self.workers.slots, ops, error, min(timeout, NODE_LOSS_WAIT_S))
                    if lost is not None:
                        raise DriverError(lost) from error
                    sub = self._first_failed(rank, pending, sub)
                    raise DriverError(f"{sub.describe()} failed on worker {self.workers.slots[rank].name} "
                                      f"(rank {rank}): {_cause(error)}") from error
        return {sub: [results[ref] for ref in sub.meta_refs] for sub in pending.ops}

    def _first_failed(self, rank: int, pending: PendingIteration, reported: SubmittedOp) -> SubmittedOp:
        """The op a failed worker was running: its first op, in submission order, without a
        successful result. (A dead actor fails its queued tasks at once, in no set order, and
        the failures reach the driver over a few moments: each op gets FAILURE_SETTLE_S.)"""
        for sub in [*pending.ops, *(op for later in self._pending for op in later.ops)]:
            if rank not in sub.ranks:
                continue
            ref = sub.meta_refs[sub.ranks.index(rank)]
            ready, _ = ray.wait([ref], timeout=FAILURE_SETTLE_S)
            if not ready:
                return sub
            try:
                ray.get(ref, timeout=0)
            except RayError:
                return sub
        return reported

    def _raise_stall(self, pending: PendingIteration, remaining: list[ray.ObjectRef],
                     where: dict[ray.ObjectRef, tuple[SubmittedOp, int]], timeout: float) -> None:
        assert self.workers is not None
        lost = explain_node_loss(self.workers.slots, pending.ops, TimeoutError(), max_wait_s=0.0)
        if lost is not None:
            raise DriverError(lost)
        first = min((where[ref] for ref in remaining), key=lambda sr: pending.ops.index(sr[0]))
        stuck = [self.workers.slots[rank].name for sub, rank in (where[r] for r in remaining) if sub is first[0]]
        raise DriverError(f"{first[0].describe()} made no progress for {timeout:g} s (run.call_timeout_s) on "
                          f"worker(s) {', '.join(stuck)}: a stalled collective or a hung worker")

    # ---- re-planning -------------------------------------------------------------------------------
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


def call_options(spec: CallSpec) -> dict[str, Any]:
    """Ray options of a call: two returns (meta, data); a model-free call (a rule reward: decode
    and score) on the worker's own threads, so the worker's next GPU call runs meanwhile."""
    if spec.op in MODEL_FREE_OPS:
        return {"num_returns": 2, "concurrency_group": MODEL_FREE_GROUP}
    return {"num_returns": 2}


def prompt_shard(batch: list[PromptExample]) -> dict[str, Any]:
    """The generation call's input: rows 0..n-1 with prompt ids (int64 [p_i]), texts and answers."""
    import torch

    return {
        "row_start": 0, "n": len(batch),
        "prompt_ids": [torch.tensor(e.prompt_ids, dtype=torch.int64) for e in batch],
        "prompt": [e.prompt for e in batch],
        "answer": [e.answer for e in batch],
    }


def _cause(error: BaseException) -> str:
    """The worker's original exception (type: message) inside a Ray error, on one line."""
    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:2000]


__all__ = ["Driver", "DriverError", "LOOKAHEAD", "PendingIteration", "SubmittedOp", "call_options", "prompt_shard"]
