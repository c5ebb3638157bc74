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
from pathlib import Path
from typing import Any

import ray

from actors.rl import make_kl_controller
from app.config import ExperimentConfig
from app.data import BatchIterator, IteratorState, PromptExample
from app.reporting import (
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
from app.run.checkpoint import commit, latest_checkpoint, prune
from app.run.collect import SubmittedOp, wait_ops
from app.run.dispatch import Dispatch, PendingIteration, Target
from app.run.headroom import check_headroom
from app.run.iteration_metrics import collect_iteration
from app.run.recovery import DriverError, WorkerFailure, log_restart, one_line
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
    search_plan_now,
    setup_groups,
    start_workers,
)
from app.run.schedule import (
    home_placements,
    prompt_shard,
    sequences_per_iteration,
)
from app.run.staleness import staleness_metrics
from app.run.submit import call_options
from cluster.placement import WorkerCallError, WorkerGroup
from planning.simulate import simulate

LOOKAHEAD = 1  # complete iterations submitted beyond the one being waited on


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
        # The plan before Ray and before the run directory: a config without one fails in a second.
        self.search = search_plan_now(self.inputs)
        check_headroom(self.inputs.problem, self.search.plan)  # ConfigError, before Ray too
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.problem = self.inputs.problem
        self.graph = self.problem.graph
        self.total_iterations = cfg.run.iterations
        self.workers: WorkerGroup | None = None
        self._started_ray = not ray.is_initialized()
        self.dispatch: Dispatch | None = None  # the submitted side: from _start_run_state
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
        self.plan = self.search.plan
        self._info = connect_cluster(cfg)
        self._start_workers()
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
        location = home_placements(self.graph, self.plan, self.model_roles)
        batches: BatchIterator[PromptExample] = BatchIterator(
            self.inputs.examples, cfg.batch.prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        p = cfg.ppo
        kl = make_kl_controller(p.kl_controller, p.kl_coef, p.kl_target, p.kl_horizon)
        # The KL coefficient each submitted iteration got (restored: the driver runs ahead).
        start, kl_used, wandb_id = 0, {}, None
        if checkpoint is not None and state is not None:
            assert self.workers is not None
            location = restore_workers(self.workers, self.graph, self.plan, self.model_roles, checkpoint,
                                       state, cfg.run.call_timeout_s)
            start = state.iterations_done
            batches.state = IteratorState(state.data_epoch, state.data_position)
            kl.value, kl_used = state.kl_value, dict(state.kl_submitted)
            restore_driver_rng(state.rng)
            wandb_id = state.wandb_id
        self.dispatch = Dispatch(cfg, self.inputs, self.run_dir, start, location, batches, kl, kl_used)
        rewind_logs(self.run_dir, start)
        self.records = [r for r in self.records if r.iteration < start]
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

    # ---- collection ------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one iteration (submitting the next one first, for overlap); returns its metrics."""
        assert self.dispatch is not None and self.workers is not None
        d = self.dispatch
        if d.next_iteration >= self.total_iterations and not d.pending:
            raise RuntimeError(f"Driver.step: all {self.total_iterations} iterations (run.iterations) already ran")

        def wants_more() -> bool:
            # The oldest pending iteration must be complete to collect; beyond it keep LOOKAHEAD
            # complete iterations submitted (units of stages under bounded staleness), none while a
            # plan switch waits for the pipeline to drain.
            if not d.pending or not d.pending[0].complete:
                return True
            return self._switch is None and sum(p.complete for p in d.pending) <= LOOKAHEAD

        to = Target(self.workers, self.plan, self.estimates, self._wait_ops)
        while d.has_more() and wants_more():
            d.submit_next(to, self.total_iterations)
        metrics = self._collect(d.pending.pop(0))
        if self._switch is not None and not d.pending:
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
            while self.dispatch is not None and (self.dispatch.next_iteration < self.total_iterations
                                                 or self.dispatch.pending):
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
        self.dispatch = None
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
        assert self.dispatch is not None
        return self.dispatch.start

    def _collect(self, pending: PendingIteration) -> dict[str, float]:
        metas = self._wait_ops(pending.ops)
        got = collect_iteration(pending.iteration, pending.ops, metas, pending.estimates, self.graph,
                                self._previous_end, self.cfg.plan.memory_margin)
        records, metrics = got.records, got.metrics
        append_records(self.run_dir / "timeline.jsonl", records)
        self.records += records
        n_seqs = sequences_per_iteration(self.graph)
        metrics.update(self._replan(pending.iteration, records, got.call_metas))
        metrics.update(pending.extra_metrics)  # dynamic sampling's (the reward of every generated response)
        assert self.dispatch is not None
        metrics.update(staleness_metrics(pending.iteration, self.graph.max_staleness, self.dispatch.start))
        metrics["perf/throughput"] = throughput(pending.prompt_tokens, metrics, n_seqs, self.problem.cluster.n_gpus)
        self._previous_end = span(records)[1]
        if "actor/kl" in metrics:  # adapts the coefficient of the iterations submitted from now on
            self.dispatch.kl.update(metrics["actor/kl"], n_seqs)
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
        assert self.dispatch is not None
        d = self.dispatch
        d.kl_used = {i: v for i, v in d.kl_used.items() if i >= done}
        homes = home_placements(self.graph, self.plan, self.model_roles)
        state = RunState(done, pending.data_state.epoch, pending.data_state.position, d.kl.value, d.kl_used,
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
        later = [op for p in (self.dispatch.pending if self.dispatch else []) for op in p.ops if op not in ops]
        return wait_ops(self.workers, ops, later, self.cfg.run.call_timeout_s)

    def _submitted(self) -> int:
        """Iterations whose every stage is submitted."""
        return self.dispatch.next_iteration if self.dispatch is not None else 0

    # ---- re-planning -----------------------------------------------------------------------------
    def _replan(self, iteration: int, records: list[TimelineRecord],
                call_metas: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
        """Feed the re-planner (call times; a multi-turn call's env step time and turns from its
        metadata); on a decision adopt the calibrated model (and schedule a switch)."""
        assert self.replanner is not None
        metrics, decision = self.replanner.collect(iteration, records, self.run_dir,
                                                   self._submitted() < self.total_iterations,
                                                   last=iteration + 1 >= self.total_iterations, call_metas=call_metas)
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
        assert self.dispatch is not None
        d = self.dispatch
        records = apply_switch(self.workers, self.inputs, d.location, decision.plan, d.next_iteration,
                               self.cfg.run.call_timeout_s)
        append_records(self.run_dir / "timeline.jsonl", records)
        self.records += records
        self.plan, self._plan_since = decision.plan, d.next_iteration
        d.location = home_placements(self.graph, self.plan, self.model_roles)
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
        if self.dispatch is not None:
            self.dispatch.pending.clear()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


__all__ = ["Driver", "DriverError", "LOOKAHEAD", "PendingIteration", "SubmittedOp", "call_options", "prompt_shard"]
