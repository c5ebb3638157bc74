"""Self-calibration: the cost model fitted to a run's own measured call times and memory peaks.

A run measures, per call of the plan it executes, the seconds the call took (first start to last
end over its ranks) and, on GPUs, the peak memory of its fullest rank. `calibrate` finds the
`OpEfficiency` factors under which the cost model's estimates of those very calls (each at the
placement and execution the plan gives it) come closest to the measurements, in the least-squares
sense on log time (a call 2x too slow and one 2x too fast weigh the same), with a small pull
towards the factors the run started from so that factors no call depends on stay where they were.
It minimises one factor at a time by golden-section search on log e in [MIN_FACTOR,
MAX_EFFICIENCY], for a few sweeps: five factors and a handful of calls need nothing smarter.

Memory: a call's estimated peak is resident bytes + `memory_scale` x its transient bytes
(activations, logits, KV cache), linear in the scale at a fixed execution; the scale is fitted
by least squares on the relative errors of the measured peaks.

Multi-turn generation: a generate call's measurement may carry the mean seconds of one
environment step and the mean turns per trajectory. They are not fitted but taken as measured
(`with_measured_rollout`: turns within [1, max_turns]) into the call's `MultiTurn` before the
factors are fitted, so the environment's wait is not mistaken for slow decoding.

All results go back into the problem (`calibrated_problem`) for the re-plan of
`app.run.replan`. Pure Python, like the rest of planning.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from planning.cost import PlanningProblem, call_cost_levels
from planning.dataflow import MultiTurn
from planning.efficiency import MAX_EFFICIENCY, OpEfficiency
from planning.plan import ExecutionPlan
from planning.simulate import complete_plan, simulate

MIN_FACTOR = 0.01
MEMORY_SCALE_RANGE = (0.25, 8.0)
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class CallMeasurement:
    """What a run measured of one call: seconds (typically the median over iterations) and
    the peak bytes on its fullest rank (None where the device cannot tell, e.g. on CPU). A
    multi-turn generate call also: env_step_s, the mean seconds of one environment step, and
    turns, the mean turns per trajectory (None when not measured)."""

    seconds: float
    peak_bytes: float | None = None
    env_step_s: float | None = None
    turns: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"CallMeasurement.seconds={self.seconds}: must be a positive number")
        if self.env_step_s is not None and not (math.isfinite(self.env_step_s) and self.env_step_s >= 0):
            raise ValueError(f"CallMeasurement.env_step_s={self.env_step_s}: must be a number >= 0")
        if self.turns is not None and not (math.isfinite(self.turns) and self.turns > 0):
            raise ValueError(f"CallMeasurement.turns={self.turns}: must be a positive number")


@dataclass(frozen=True)
class Calibration:
    """Fitted factors, and each measured call's estimate before and after (seconds, bytes)."""

    efficiency: OpEfficiency
    memory_scale: float
    measured_s: dict[str, float]
    estimated_before_s: dict[str, float]
    estimated_after_s: dict[str, float]
    measured_peak_bytes: dict[str, float]
    estimated_before_bytes: dict[str, float]
    estimated_after_bytes: dict[str, float]
    multi_turn: dict[str, MultiTurn] = field(default_factory=dict)  # generate calls' measured rollout

    def time_errors(self, after: bool = True) -> tuple[float, float]:
        """(median, max) of |estimate / measured - 1| over the measured calls."""
        estimates = self.estimated_after_s if after else self.estimated_before_s
        errors = [abs(estimates[name] / seconds - 1.0) for name, seconds in self.measured_s.items()]
        return (statistics.median(errors), max(errors)) if errors else (math.nan, math.nan)


def calibrate(problem: PlanningProblem, plan: ExecutionPlan, measured: dict[str, CallMeasurement],
              sweeps: int = 4, pull: float = 0.05, max_turns: float | None = None) -> Calibration:
    """Fit `problem`'s efficiency factors and memory scale to `measured` calls of `plan`, after
    taking the measured environment steps and turns in (`with_measured_rollout`, turns at most
    `max_turns`).

    pull: weight of (log e - log e_start)^2 per factor against the squared log-time errors.
    Raises ValueError for calls not in the plan or a plan that does not fit the problem.
    """
    unknown = sorted(set(measured) - {m.name for m in problem.graph.mfcs})
    if unknown:
        raise ValueError(f"calibrate: measured calls {unknown} are not in the {problem.graph.algorithm} graph")
    plan = complete_plan(problem, plan)
    before = problem
    problem = with_measured_rollout(problem, measured, max_turns)
    seconds = {name: m.seconds for name, m in measured.items()}
    start = problem.efficiency

    def objective(candidate: OpEfficiency) -> float:
        estimates = _call_seconds(replace(problem, efficiency=candidate), plan, seconds)
        misfit = sum((math.log(estimates[n] / seconds[n])) ** 2 for n in seconds)
        return misfit + pull * sum(math.log(getattr(candidate, f.name) / getattr(start, f.name)) ** 2
                                   for f in fields(OpEfficiency))

    efficiency = fit_factors(objective, start, [f.name for f in fields(OpEfficiency)], sweeps)
    peaks = {name: m.peak_bytes for name, m in measured.items() if m.peak_bytes is not None}
    scale = _memory_scale(problem, plan, peaks) if peaks else problem.memory_scale
    after = replace(problem, efficiency=efficiency, memory_scale=scale)
    return Calibration(
        efficiency=efficiency, memory_scale=scale, measured_s=seconds,
        estimated_before_s=_call_seconds(before, plan, seconds), estimated_after_s=_call_seconds(after, plan, seconds),
        measured_peak_bytes=peaks, estimated_before_bytes=_call_bytes(before, plan, peaks),
        estimated_after_bytes=_call_bytes(after, plan, peaks),
        multi_turn={m.name: m.multi_turn for m in problem.graph.mfcs
                    if m.multi_turn is not None and m.multi_turn != before.graph.mfc(m.name).multi_turn},
    )


def calibrated_problem(problem: PlanningProblem, calibration: Calibration) -> PlanningProblem:
    """`problem` with the calibration's efficiency factors, memory scale and measured rollout."""
    graph = problem.graph
    if calibration.multi_turn:
        graph = replace(graph, mfcs=tuple(replace(m, multi_turn=calibration.multi_turn.get(m.name, m.multi_turn))
                                          for m in graph.mfcs))
    return replace(problem, graph=graph, efficiency=calibration.efficiency, memory_scale=calibration.memory_scale)


def with_measured_rollout(problem: PlanningProblem, measured: dict[str, CallMeasurement],
                          max_turns: float | None = None) -> PlanningProblem:
    """`problem` whose multi-turn generate calls take the measured environment step time and mean
    turns (clamped to [1, max_turns]; no upper bound when None) in place of the configured ones;
    the response budget stays. Calls without a measured figure, or single-turn, stay as they are."""
    calls = []
    for m in problem.graph.mfcs:
        got = measured.get(m.name)
        if m.multi_turn is None or got is None or (got.env_step_s is None and got.turns is None):
            calls.append(m)
            continue
        turns = m.multi_turn.turns if got.turns is None else max(1.0, got.turns)
        if max_turns is not None:
            turns = min(turns, max(1.0, max_turns))
        env_step_s = m.multi_turn.env_step_s if got.env_step_s is None else got.env_step_s
        budget = m.multi_turn.budget(m.batch.gen_len)  # the cache the engine allocates does not shrink
        calls.append(replace(m, multi_turn=replace(m.multi_turn, turns=turns, env_step_s=env_step_s,
                                                   response_tokens=budget)))
    if tuple(calls) == problem.graph.mfcs:
        return problem
    return replace(problem, graph=replace(problem.graph, mfcs=tuple(calls)))


def _call_seconds(problem: PlanningProblem, plan: ExecutionPlan, names: dict[str, float]) -> dict[str, float]:
    """The cost model's seconds of each named call at the plan's placement and execution."""
    out = {}
    for name in names:
        level = call_cost_levels(problem, problem.graph.mfc(name), plan[name], plan.execution(name))[0]
        if not math.isfinite(level.time_s):
            raise ValueError(f"calibrate: call {name} cannot run on {plan[name].mesh}/{plan[name].layout}: {level.reason}")
        out[name] = level.time_s
    return out


def _call_bytes(problem: PlanningProblem, plan: ExecutionPlan, names: dict[str, float]) -> dict[str, float]:
    """The simulator's peak bytes per GPU while each named call runs."""
    call_mem = simulate(problem, plan, iterations=1).call_mem_bytes
    return {name: call_mem[name] for name in names}


def _memory_scale(problem: PlanningProblem, plan: ExecutionPlan, peaks: dict[str, float]) -> float:
    """The transient scale s minimising sum_c ((resident_c + s * transient_c) / peak_c - 1)^2
    (relative errors, so a small call counts as much as a big one), clamped to
    MEMORY_SCALE_RANGE. What no single scale explains is what `plan.memory_margin` is for."""
    at_one = _call_bytes(replace(problem, memory_scale=1.0), plan, peaks)
    at_two = _call_bytes(replace(problem, memory_scale=2.0), plan, peaks)
    num = den = 0.0
    for name, peak in peaks.items():
        if peak <= 0:
            continue
        transient = (at_two[name] - at_one[name]) / peak
        resident = (at_one[name] - (at_two[name] - at_one[name])) / peak
        num += transient * (1.0 - resident)
        den += transient * transient
    if den <= 0:
        return problem.memory_scale
    return min(max(num / den, MEMORY_SCALE_RANGE[0]), MEMORY_SCALE_RANGE[1])


def fit_factors(objective: Callable[[OpEfficiency], float], start: OpEfficiency, names: Sequence[str],
                sweeps: int = 4, iterations: int = 40) -> OpEfficiency:
    """The factors `names` of `start` that minimise `objective`, one at a time by golden-section
    search on log e in [MIN_FACTOR, MAX_EFFICIENCY], for `sweeps` rounds (the others stay)."""
    values = {f.name: float(getattr(start, f.name)) for f in fields(OpEfficiency)}
    for _ in range(sweeps):
        for name in names:
            best = _golden_min(lambda log_e, n=name: objective(OpEfficiency(**{**values, n: math.exp(log_e)})),
                               math.log(MIN_FACTOR), math.log(MAX_EFFICIENCY), iterations)
            values[name] = min(max(math.exp(best), MIN_FACTOR), MAX_EFFICIENCY)
    return OpEfficiency(**values)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iterations: int = 40) -> float:
    """argmin of a unimodal-ish f on [lo, hi] by golden-section search (returns x, not f(x))."""
    a, b = lo, hi
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2.0


__all__ = ["MEMORY_SCALE_RANGE", "MIN_FACTOR", "Calibration", "CallMeasurement", "calibrate", "calibrated_problem",
           "fit_factors", "with_measured_rollout"]
