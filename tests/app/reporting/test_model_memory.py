"""The plan report's trained-model block (app.reporting.model_memory): weights and optimizer state
on the GPU and in host memory, the offload's seconds, and the offload bars of the Gantt chart."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.reporting.report import PlanReport, draw_gantt, format_plan_table, plan_json, plan_report, simulated_bars
from planning.algorithm_graphs import grpo_graph
from planning.cost import PlanningProblem, rlhf_problem
from planning.dataflow import BatchShape
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec
from planning.models import model_preset
from planning.search import SearchResult, search_plan
from planning.simulate import SimResult, simulate

pytestmark = pytest.mark.unit


def _planned(model: str, prompts: int) -> tuple[PlanningProblem, SearchResult]:
    problem = rlhf_problem(grpo_graph(BatchShape(prompts, 128, 512), 8),
                           ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset(model))
    problem = replace(problem, memory_margin=0.1)
    return problem, search_plan(problem, seconds=5)


def _report(problem: PlanningProblem, result: SearchResult) -> tuple[PlanReport, SimResult]:
    sim = simulate(problem, result.plan)
    return plan_report(problem, result.plan, sim, mode="search", est_iteration_s=result.est_iteration_s,
                       baseline_iteration_s=result.baseline_iteration_s, search_s=result.search_s,
                       evaluated_plans=result.evaluated_plans), sim


def test_offloaded_8b_shows_what_lives_where(tmp_path: Path) -> None:
    problem, result = _planned("llama3-8b", 32)
    report, sim = _report(problem, result)
    (row,) = report.models
    fraction = result.plan.offload_fraction("actor")
    assert row.role == "actor" and row.offload_fraction == fraction > 0
    total = row.optimizer_gpu_gib + row.optimizer_host_gib
    assert row.optimizer_host_gib == pytest.approx(fraction * total, rel=1e-6)
    assert row.offload_s == pytest.approx(sim.offload_s["actor_train"]) and row.offload_s > 0
    assert all(r.feasible for r in report.calls)  # priced with the plan's offload
    text = format_plan_table(report)
    assert "host optimizer GiB" in text and f"{row.optimizer_host_gib:.1f}" in text
    assert "optimizer offload: actor 5/8 of the optimizer state in pinned host memory" in text
    data = plan_json(report)
    assert data["optimizer_offload"] == {"actor": fraction}
    assert data["models"][0]["optimizer_host_gib"] == pytest.approx(row.optimizer_host_gib)
    json.dumps(data, allow_nan=False)
    # The Gantt chart draws the offload as the train call's last segment.
    bars = simulated_bars(sim)
    offload = [b for b in bars if b.kind == "offload"]
    train = [b for b in bars if b.kind == "call" and b.label.startswith("actor_train")]
    assert offload and offload[0].label == "actor_train #0 offload"
    assert offload[0].start_s == pytest.approx(train[0].end_s)
    assert offload[0].end_s - offload[0].start_s == pytest.approx(row.offload_s)
    draw_gantt(bars, tmp_path / "g.png", n_rows=1)
    assert (tmp_path / "g.png").stat().st_size > 0


def test_a_model_that_fits_shows_no_offload() -> None:
    problem, result = _planned("llama3.2-1b", 64)
    report, sim = _report(problem, result)
    (row,) = report.models
    assert row.offload_fraction == 0 and row.optimizer_host_gib == 0 and row.offload_s == 0
    assert "optimizer offload:" not in format_plan_table(report)
    assert plan_json(report)["optimizer_offload"] == {}
    assert not [b for b in simulated_bars(sim) if b.kind == "offload"]
