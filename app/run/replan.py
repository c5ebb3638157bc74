"""Self-calibration and online re-planning of a running experiment (`plan.recalibrate_after`).

After `recalibrate_after` iterations the `Replanner` fits the cost model to what the run itself
measured (`planning.calibrate`: efficiency factors from each call's seconds, the transient
memory scale from its peak bytes), then searches again, starting from the plan being executed,
in a `PlannerService` actor while the next iteration runs (the decision is taken when that
iteration is collected). It compares the new plan with the current one under the same
calibrated model: the run switches when the new one is estimated at least `plan.switch_gain`
faster (a fraction), and keeps its plan otherwise. A multi-turn generate call's metadata
(`MEASURED_ROLLOUT_KEYS`: mean seconds per environment step, mean turns per trajectory) goes into
the calibration too: the re-plan prices the environment as measured, not as configured.
Either way the decision (both estimates, the calibration and the reason) goes into the history
(`plan.json`, `plan_history.jsonl`, `plan/*` metrics), and later estimates use the calibrated model.

A switch happens between two iterations, once none is in flight (`apply_switch`): the process
groups of the new plan are created on every rank, then every model whose home moves is moved
by the reallocation executor: a frozen model by `ModelWorker.reallocate`, a trained one with its
optimizer state by `ModelWorker.rehome`. The driver only calls `Replanner.collect` after each
iteration and `apply_switch` (app.run.driver).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray

from app.config import ExperimentConfig
from app.reporting import TimelineRecord, records_of, span
from app.run.runtime import TrainInputs, plan_groups, setup_groups
from app.run.schedule import ReallocOp, home_placements
from cluster.placement import WorkerGroup
from planning.calibrate import Calibration, CallMeasurement, calibrate, calibrated_problem
from planning.cost import PlanningProblem
from planning.hardware import GiB
from planning.plan import ExecutionPlan, Placement
from planning.planner_service import PlannerService
from planning.realloc_plan import plan_reallocation
from planning.simulate import simulate

HISTORY_FILE = "plan_history.jsonl"
# CallMeasurement field -> the per-rank metadata keys of a multi-turn generate call that carry it,
# first found wins: the planner's names, then the env/* metrics the generation worker reports.
MEASURED_ROLLOUT_KEYS = {"env_step_s": ("env_step_s_mean", "env/step_s_mean"),
                         "turns": ("turns_mean", "env/turns_mean")}
SEARCH_GRACE_S = 120.0  # beyond plan.seconds: starting the planner actor, candidates, re-scoring


@dataclass(frozen=True)
class PlanDecision:
    """What a re-plan concluded after `iteration`: `plan` to switch to, or None to keep the
    current one; `problem` is the calibrated planning problem either way."""

    iteration: int
    plan: ExecutionPlan | None
    problem: PlanningProblem
    calibration: Calibration
    previous_est_s: float  # the current plan under the model it was chosen with
    current_est_s: float  # the current plan under the calibrated model
    new_est_s: float  # the searched plan under the calibrated model
    reason: str

    def record(self, switched: bool) -> dict[str, Any]:
        """The JSON-ready history entry."""
        c = self.calibration
        before, after = c.time_errors(after=False), c.time_errors(after=True)
        return {
            "iteration": self.iteration, "switched": switched, "reason": self.reason,
            "previous_est_iteration_s": _number(self.previous_est_s), "current_est_iteration_s": _number(self.current_est_s),
            "new_est_iteration_s": _number(self.new_est_s),
            "efficiency": {k: round(v, 4) for k, v in asdict(c.efficiency).items()}, "memory_scale": c.memory_scale,
            "time_error_before": {"median": _number(before[0]), "max": _number(before[1])},
            "time_error_after": {"median": _number(after[0]), "max": _number(after[1])},
            "calls": {name: {"measured_s": c.measured_s[name], "est_before_s": c.estimated_before_s[name],
                             "est_after_s": c.estimated_after_s[name],
                             "measured_peak_gib": _gib(c.measured_peak_bytes.get(name)),
                             "est_peak_before_gib": _gib(c.estimated_before_bytes.get(name)),
                             "est_peak_after_gib": _gib(c.estimated_after_bytes.get(name))}
                      for name in c.measured_s},
            "plan": _plan_entries(self.plan) if self.plan is not None else None,
        }

    def metrics(self, switched: bool) -> dict[str, float]:
        """plan/* metrics of the decision (logged at its iteration)."""
        median, worst = self.calibration.time_errors(after=True)
        return {"plan/switched": float(switched), "plan/current_est_s": self.current_est_s,
                "plan/new_est_s": self.new_est_s, "plan/time_error_median": median, "plan/time_error_max": worst,
                "plan/memory_scale": self.calibration.memory_scale}


class Replanner:
    """Collects each iteration's call records; after `plan.recalibrate_after` iterations it
    calibrates, searches in the background and, when the search answers, decides (once)."""

    def __init__(self, cfg: ExperimentConfig, problem: PlanningProblem, plan: ExecutionPlan,
                 est_iteration_s: float) -> None:
        self.cfg = cfg
        self.enabled = cfg.plan.recalibrate_after is not None
        self.problem, self.plan, self.est_iteration_s = problem, plan, est_iteration_s
        self.history: list[dict[str, Any]] = []
        self._seconds: dict[str, list[float]] = defaultdict(list)
        self._peaks: dict[str, list[float]] = defaultdict(list)
        self._rollout: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self._iterations: list[int] = []
        self._search: tuple[Any, ray.ObjectRef, Calibration, PlanningProblem] | None = None
        self._done = False

    def observe(self, iteration: int, records: Sequence[TimelineRecord],
                call_metas: Mapping[str, Sequence[Any]] | None = None) -> None:
        """One collected iteration's records: per call its seconds (first start to last end over
        its ranks) and its largest peak allocated bytes; from `call_metas` (call -> its ranks'
        metadata) a multi-turn generate call's environment step time and turns."""
        if not self.enabled or self._done:
            return
        for name, metas in (call_metas or {}).items():
            for key, value in rollout_means(metas).items():
                self._rollout[name][key].append(value)
        self._iterations.append(iteration)
        by_call: dict[str, list[TimelineRecord]] = defaultdict(list)
        for record in records:
            if record.kind == "call":
                by_call[record.name].append(record)
        for name, items in by_call.items():
            start, end = span(items)
            self._seconds[name].append(max(end - start, 1e-6))
            peaks = [r.peak_allocated_bytes for r in items if r.peak_allocated_bytes is not None]
            if peaks:
                self._peaks[name].append(float(max(peaks)))

    def measured(self) -> dict[str, CallMeasurement]:
        """Per call: the median seconds over the observed iterations after the first (which
        carries warm-up: CUDA graphs, compilation) when there are several, and the largest peak."""
        skip = 1 if len(self._iterations) > 1 else 0
        return {name: CallMeasurement(statistics.median(seconds[skip:] or seconds),
                                      max(self._peaks[name]) if self._peaks.get(name) else None,
                                      **{key: statistics.median(values[skip:] or values)
                                         for key, values in self._rollout.get(name, {}).items() if values})
                for name, seconds in self._seconds.items()}

    def poll(self, iteration: int, last: bool = False) -> PlanDecision | None:
        """Start the calibration and search once enough iterations are in; return the decision
        once the search has answered (None before, and ever after). The search runs while the
        next iteration does; at that iteration's collection the driver waits for it, so the
        decision always comes one iteration after the calibration. No search starts after the
        run's `last` iteration (no collection would receive its answer)."""
        if not self.enabled or self._done:
            return None
        if self._search is None:
            if not last and len(self._iterations) >= (self.cfg.plan.recalibrate_after or 0):
                self._start_search()
            return None
        planner, ref, calibration, problem = self._search
        ready, _ = ray.wait([ref], timeout=self.cfg.plan.seconds + SEARCH_GRACE_S)
        self._done = True
        try:
            if not ready:
                return self._decision(iteration, None, problem, calibration, math.inf,
                                      "the re-plan search did not answer in time")
            result = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # no plan fits the calibrated model: keep ours
            return self._decision(iteration, None, problem, calibration, math.inf,
                                  f"the re-plan search found no plan ({' '.join(str(exc.cause).split())[:200]})")
        finally:
            ray.kill(planner)
        return self._decision(iteration, result.plan, problem, calibration, result.est_iteration_s, "")

    def _start_search(self) -> None:
        calibration = calibrate(self.problem, self.plan, self.measured(), max_turns=self.cfg.rollout.max_turns)
        problem = calibrated_problem(self.problem, calibration)
        p = self.cfg.plan
        planner = ray.remote(num_cpus=0, num_gpus=0)(PlannerService).remote()
        ref = planner.search.remote(problem, "search", p.seconds, p.seed, None, None, None, self.plan)
        self._search = (planner, ref, calibration, problem)

    def _decision(self, iteration: int, new: ExecutionPlan | None, problem: PlanningProblem,
                  calibration: Calibration, new_est_s: float, failure: str) -> PlanDecision:
        current_est_s = simulate(problem, self.plan).iteration_s
        chosen, reason = judge(self.plan, current_est_s, new, new_est_s, self.cfg.plan.switch_gain)
        return PlanDecision(iteration, chosen, problem, calibration, self.est_iteration_s, current_est_s, new_est_s,
                            failure or reason)

    def collect(self, iteration: int, records: Sequence[TimelineRecord], run_dir: Path,
                more_to_run: bool, last: bool = False, call_metas: Mapping[str, Sequence[Any]] | None = None,
                ) -> tuple[dict[str, float], PlanDecision | None]:
        """One collected iteration: observe it, and when a decision arrives record it (history,
        plan_history.jsonl, one console line) and return it with its plan/* metrics. The decision's
        plan is None unless the run switches (a switch with no iteration left to submit, `more_to_run`
        false, is not made); `last` is the run's final iteration (no search starts after it);
        `call_metas`: the iteration's per-call rank metadata (`CollectedIteration.call_metas`)."""
        self.observe(iteration, records, call_metas)
        decision = self.poll(iteration, last)
        if decision is None:
            return {}, None
        switching = decision.plan is not None and more_to_run
        if not switching:
            decision = replace(decision, plan=None)
        self.adopt(decision.problem, self.plan, decision.current_est_s)
        entry = decision.record(switching)
        self.history.append(entry)
        with (run_dir / HISTORY_FILE).open("a", encoding="utf-8") as sink:
            sink.write(json.dumps(entry, allow_nan=False) + "\n")
        print(f"re-plan after iteration {iteration}: {'switching plans' if switching else 'keeping the plan'}; "
              f"{decision.reason}", flush=True)
        return decision.metrics(switching), decision

    def adopt(self, problem: PlanningProblem, plan: ExecutionPlan, est_iteration_s: float) -> None:
        """The model and plan the run goes on with."""
        self.problem, self.plan, self.est_iteration_s = problem, plan, est_iteration_s

    def close(self) -> None:
        if self._search is not None and not self._done:
            ray.kill(self._search[0])
        self._done = True


def rollout_means(metas: Sequence[Any]) -> dict[str, float]:
    """CallMeasurement fields (env_step_s, turns) of one call from its ranks' metadata: each
    MEASURED_ROLLOUT_KEYS value averaged over the data-owner ranks reporting it, weighted by their
    rows (`n`; 1 when absent); ranks not owning data (`owner` false) repeat their owner's figures."""
    out = {}
    for measurement, keys in MEASURED_ROLLOUT_KEYS.items():
        total = weight = 0.0
        for meta in metas:
            if not isinstance(meta, dict) or not meta.get("owner", True):
                continue
            value = next((meta[k] for k in keys if k in meta), None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                rows = float(meta.get("n", 1) or 1)
                total, weight = total + rows * float(value), weight + rows
        if weight > 0:
            out[measurement] = total / weight
    return out


def judge(current: ExecutionPlan, current_est_s: float, new: ExecutionPlan | None, new_est_s: float,
          gain: float) -> tuple[ExecutionPlan | None, str]:
    """(the plan to switch to or None, why): switch when the new plan differs and is estimated at
    least `gain` (a fraction) faster than the current one under the same model."""
    if new is None:
        return None, "the search found no plan"
    if new == current:
        return None, "the search chose the current plan"
    faster = 1.0 - new_est_s / current_est_s if current_est_s > 0 else 0.0
    verdict = f"calibrated estimate {new_est_s:.3g} s vs {current_est_s:.3g} s per iteration ({faster:+.1%} faster)"
    if new_est_s <= current_est_s * (1.0 - gain):
        return new, f"{verdict}: at least plan.switch_gain={gain:g}"
    return None, f"{verdict}: less than plan.switch_gain={gain:g}"


def switch_moves(inputs: TrainInputs, location: dict[str, Placement], plan: ExecutionPlan) -> list[ReallocOp]:
    """Every model whose weights must move for `plan`: from where it is to its new home."""
    homes = home_placements(inputs.problem.graph, plan, tuple(inputs.models))
    return [ReallocOp(role, location[role], homes[role]) for role in inputs.models if location[role] != homes[role]]


def switch_groups(inputs: TrainInputs, plan: ExecutionPlan, moves: Sequence[ReallocOp]) -> list[tuple[int, ...]]:
    """The new plan's process groups plus each move's (its broadcast groups and both meshes)."""
    groups = list(plan_groups(inputs, plan))
    for move in moves:
        model = inputs.models[move.role]
        groups += list(plan_reallocation(model.spec, model.critic, move.src, move.dst).groups)
        groups.append(move.ranks)
    return [g for g in dict.fromkeys(tuple(sorted(g)) for g in groups) if len(g) > 1]


def apply_switch(workers: WorkerGroup, inputs: TrainInputs, location: dict[str, Placement], plan: ExecutionPlan,
                 iteration: int, timeout_s: float) -> list[TimelineRecord]:
    """Create the new plan's groups on every rank, then move every model to its new home (no
    iteration may be in flight). Returns the moves as `replan:<role>` realloc records of
    `iteration` (the first to run under the new plan)."""
    moves = switch_moves(inputs, location, plan)
    setup_groups(workers, tuple(switch_groups(inputs, plan, moves)), timeout_s)
    trained = set(inputs.problem.graph.trained_roles)
    records = []
    for move in moves:
        if move.role in trained:  # the optimizer state moves too, split as the new plan says
            metas = workers.run("rehome", move.role, move.src, move.dst, plan.offload_fraction(move.role),
                                ranks=move.ranks, timeout_s=timeout_s)
        else:
            metas = workers.run("reallocate", move.role, move.src, move.dst, ranks=move.ranks, timeout_s=timeout_s)
        records += records_of(iteration, f"replan:{move.role}", "realloc", move.ranks, metas)
    return records


def _plan_entries(plan: ExecutionPlan) -> dict[str, dict[str, Any]]:
    """A plan in the shape of the config's plan.manual section."""
    out = {}
    for name, placement in plan.placements:
        execution = plan.execution(name)
        out[name] = {"mesh": str(placement.mesh), "layout": str(placement.layout),
                     **(execution.as_dict() if execution else {})}
    return out


def _number(x: float) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _gib(x: float | None) -> float | None:
    return None if x is None else round(x / GiB, 3)


__all__ = ["HISTORY_FILE", "MEASURED_ROLLOUT_KEYS", "PlanDecision", "Replanner", "apply_switch", "judge",
           "rollout_means", "switch_groups", "switch_moves"]
