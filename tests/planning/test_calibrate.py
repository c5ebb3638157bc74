"""Self-calibration: efficiency factors and the memory scale fitted to measured calls."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planning.algorithm_graphs import grpo_graph
from planning.calibrate import CallMeasurement, calibrate, calibrated_problem
from planning.cost import PlanningProblem, call_cost_levels, rlhf_problem
from planning.dataflow import BatchShape
from planning.efficiency import OpEfficiency
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec
from planning.models import model_preset
from planning.plan import ExecutionPlan
from planning.search import search_plan
from planning.simulate import simulate

pytestmark = pytest.mark.unit


def _problem_and_plan() -> tuple[PlanningProblem, ExecutionPlan]:
    # 32 rows: decoding streams the weights (memory-bound), so the decode factor shows in its time.
    graph = grpo_graph(BatchShape(8, 128, 256), 4, 1)
    problem = rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset("llama3.2-1b"))
    return problem, search_plan(problem, seconds=1.0, max_steps=200).plan


def test_fits_times_the_cost_model_can_explain() -> None:
    problem, plan = _problem_and_plan()
    truth = replace(problem, efficiency=OpEfficiency(gemm=0.55, decode=1.4))
    measured = {m.name: CallMeasurement(
        call_cost_levels(truth, m, plan[m.name], plan.execution(m.name))[0].time_s) for m in problem.graph.mfcs}
    result = calibrate(problem, plan, measured)
    before, after = result.time_errors(after=False), result.time_errors(after=True)
    assert before[1] > 0.2 and after[1] < 0.05, (before, after)
    assert result.efficiency.gemm == pytest.approx(0.55, rel=0.15)
    assert result.efficiency.decode > 1.0  # this machine beats the preset's HBM figure
    assert result.memory_scale == problem.memory_scale  # no peaks measured (CPU): unchanged
    fitted = calibrated_problem(problem, result)
    assert simulate(fitted, plan).iteration_s == pytest.approx(simulate(truth, plan).iteration_s, rel=0.05)


def test_memory_scale_follows_measured_peaks() -> None:
    problem, plan = _problem_and_plan()
    truth = replace(problem, memory_scale=1.5)
    peaks = simulate(truth, plan, iterations=1).call_mem_bytes
    measured = {name: CallMeasurement(1.0, peaks[name]) for name in peaks}
    result = calibrate(problem, plan, measured)
    assert result.memory_scale == pytest.approx(1.5, rel=1e-3)
    for name, peak in peaks.items():
        assert result.estimated_after_bytes[name] == pytest.approx(peak, rel=1e-3)
        assert result.estimated_before_bytes[name] < peak


def test_bad_measurements_are_refused() -> None:
    problem, plan = _problem_and_plan()
    with pytest.raises(ValueError, match="measured calls \\['critic_inf'\\]"):
        calibrate(problem, plan, {"critic_inf": CallMeasurement(1.0)})
    with pytest.raises(ValueError, match="seconds=0"):
        CallMeasurement(0.0)
