"""Measured next to estimated: call records with peaks and estimates, the memory metrics, the
overrun warnings, timings.json rows and the Gantt labels."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.config.problem import build_problem, manual_plan
from app.reporting.timeline import (
    CallEstimate,
    append_records,
    call_estimates,
    fidelity_metrics,
    measured_bars,
    memory_overruns,
    read_records,
    records_of,
    timing_table,
    write_gantt,
)
from planning.hardware import GiB
from planning.simulate import complete_plan

pytestmark = pytest.mark.unit


def test_records_carry_peaks_and_estimates_and_round_trip(tmp_path: Path) -> None:
    metas = [{"start": 1.0, "end": 2.0, "peak_allocated_bytes": 3 * GiB, "peak_reserved_bytes": 4 * GiB, "gc_s": 0.25,
              "compile_s": 1.5, "gc_before_s": 0.5},
             {"start": 1.1, "end": 2.5, "peak_allocated_bytes": 5 * GiB, "peak_reserved_bytes": 6 * GiB, "gc_s": 0.0,
              "compile_s": None, "gc_before_s": 0.75}]
    records = records_of(0, "actor_train", "call", [0, 1], metas, CallEstimate(1.2, 4 * GiB))
    cpu = records_of(0, "ref_inf", "call", [0], [{"start": 0.0, "end": 0.5, "peak_allocated_bytes": None}])
    path = tmp_path / "timeline.jsonl"
    append_records(path, records + cpu)
    assert read_records(path) == records + cpu
    metrics = fidelity_metrics(records + cpu)
    assert metrics["memory/actor_train_peak_gib"] == 5.0 and metrics["memory/actor_train_reserved_gib"] == 6.0
    assert metrics["memory/actor_train_est_gib"] == 4.0 and metrics["timing_est_s/actor_train"] == 1.2
    assert math.isnan(metrics["memory/ref_inf_peak_gib"])  # CPU: null in metrics.jsonl
    assert metrics["timing_gc_s/actor_train"] == 0.25 and "timing_gc_s/ref_inf" not in metrics  # not measured there
    assert metrics["timing_compile_s/actor_train"] == 1.5 and records[1].compile_s is None
    assert metrics["timing_gc_before_s/actor_train"] == 0.75 and "timing_gc_before_s/ref_inf" not in metrics
    warnings = memory_overruns(records, margin=0.1)
    assert len(warnings) == 1 and warnings[0].startswith("call actor_train (iteration 0): measured peak 5 GiB on rank 1")
    assert "estimate 4 GiB" in warnings[0] and memory_overruns(records, margin=0.5) == []
    assert [b.label for b in measured_bars(records, 0.0)] == ["actor_train #0 3.0G", "actor_train #0 5.0G"]


def test_timing_table_and_gantt_show_measured_beside_estimated(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT_CONFIG)
    problem = build_problem(cfg)
    plan = complete_plan(problem, manual_plan(cfg, problem))
    estimates = call_estimates(problem, plan)
    records = []
    for it in range(2):
        for m in problem.graph.mfcs:
            metas = [{"start": 10.0 * it, "end": 10.0 * it + 0.5, "peak_allocated_bytes": 2**20,
                      "peak_reserved_bytes": 2**21} for _ in plan[m.name].mesh.gpus]
            records += records_of(it, m.name, "call", list(plan[m.name].mesh.gpus), metas, estimates[m.name])
    rows = {row["call"]: row for row in timing_table(records, problem, plan)}
    assert rows["actor_train"]["micro_batch_tokens"] == plan.execution("actor_train").micro_batch_tokens
    assert rows["actor_gen"]["gen_rounds"] == 1
    assert rows["actor_gen"]["measured_s"] == 0.5 and rows["actor_gen"]["estimated_s"] == estimates["actor_gen"].seconds
    assert rows["ref_inf"]["measured_peak_gib"] == pytest.approx(1 / 1024)
    assert rows["ref_inf"]["measured_reserved_gib"] == pytest.approx(2 / 1024)
    assert rows["ref_inf"]["estimated_peak_gib"] == pytest.approx(estimates["ref_inf"].peak_bytes / GiB)
    write_gantt(records, problem, plan, tmp_path / "gantt.png")
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"
