"""Unit tests of re-planning and the memory margin without Ray: what a switch moves and which
groups it needs, when a new plan is worth switching to, the history entry, the measured calls
the calibration sees, and the refusal of a plan that leaves no headroom."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import ConfigError, load_config
from app.reporting.timeline import TimelineRecord
from app.run.headroom import check_headroom
from app.run.replan import PlanDecision, Replanner, judge, switch_groups, switch_moves
from app.run.runtime import TrainInputs, preflight
from app.run.schedule import home_placements
from planning.calibrate import calibrate, calibrated_problem
from planning.layout import Layout, Mesh
from planning.plan import ExecutionPlan, Placement
from planning.search import search_plan

pytestmark = pytest.mark.unit

ALL = Placement(Mesh(0, 4, 4), Layout(dp=4))


def tiny_inputs(*overrides: str) -> TrainInputs:
    return preflight(load_config(DEFAULT_CONFIG, list(overrides)))


def test_a_switch_moves_every_model_whose_home_changes() -> None:
    inputs = tiny_inputs()
    old = search_plan(inputs.problem, "manual", manual=inputs.manual).plan
    location = home_placements(inputs.problem.graph, old, tuple(inputs.models))
    new = ExecutionPlan(tuple((name, ALL) for name, _ in old.placements))
    moves = {m.role: m for m in switch_moves(inputs, location, new)}
    assert set(moves) == {"actor", "critic", "ref"}  # the rule-based reward holds no model
    assert moves["actor"].src == old["actor_train"] and moves["actor"].dst == ALL
    groups = switch_groups(inputs, new, list(moves.values()))
    assert (0, 1, 2, 3) in groups and len(groups) == len(set(groups)) and all(len(g) > 1 for g in groups)
    assert not switch_moves(inputs, home_placements(inputs.problem.graph, new, tuple(inputs.models)), new)


def test_switch_only_when_faster_by_the_gain() -> None:
    inputs = tiny_inputs()
    current = search_plan(inputs.problem, "manual", manual=inputs.manual).plan
    other = ExecutionPlan(tuple((name, ALL) for name, _ in current.placements))
    assert judge(current, 10.0, other, 9.4, 0.05)[0] == other
    keep, why = judge(current, 10.0, other, 9.6, 0.05)
    assert keep is None and "less than plan.switch_gain=0.05" in why
    assert judge(current, 10.0, current, 5.0, 0.05) == (None, "the search chose the current plan")
    assert judge(current, 10.0, None, 1.0, 0.05)[0] is None


def test_measured_calls_skip_the_warm_up_iteration_and_history_is_json() -> None:
    inputs = tiny_inputs("plan.recalibrate_after=2")
    plan = search_plan(inputs.problem, "manual", manual=inputs.manual).plan
    replanner = Replanner(inputs.cfg, inputs.problem, plan, 0.1)
    for it, seconds in enumerate((5.0, 1.0, 3.0)):
        records = [TimelineRecord(it, m.name, "call", rank, 100.0 * it, 100.0 * it + seconds * (1 + rank),
                                  peak_allocated_bytes=2**20 * (rank + 1)) for m in inputs.problem.graph.mfcs
                   for rank in (0, 1)]
        replanner.observe(it, records)
    measured = replanner.measured()
    assert set(measured) == {m.name for m in inputs.problem.graph.mfcs}
    assert measured["actor_gen"].seconds == pytest.approx(4.0)  # median of 2 and 6 (iteration 0 skipped)
    assert measured["actor_gen"].peak_bytes == 2 * 2**20
    calibration = calibrate(inputs.problem, plan, measured)
    decision = PlanDecision(2, None, calibrated_problem(inputs.problem, calibration), calibration, 0.1, 0.2, 0.3,
                            "the search chose the current plan")
    entry = json.loads(json.dumps(decision.record(False), allow_nan=False))
    assert entry["switched"] is False and set(entry["calls"]) == set(measured)
    assert entry["calls"]["actor_gen"]["measured_s"] == pytest.approx(4.0)
    assert decision.metrics(False)["plan/switched"] == 0.0


def test_no_search_starts_after_the_last_iteration(tmp_path: Path) -> None:
    """recalibrate_after = run.iterations: the calibration point is the run's last iteration,
    after which no collection would receive the search's answer, so no planner process starts."""
    inputs = tiny_inputs("plan.recalibrate_after=1")
    plan = search_plan(inputs.problem, "manual", manual=inputs.manual).plan
    replanner = Replanner(inputs.cfg, inputs.problem, plan, 0.1)
    records = [TimelineRecord(0, m.name, "call", 0, 0.0, 1.0) for m in inputs.problem.graph.mfcs]
    assert replanner.collect(0, records, tmp_path, more_to_run=False, last=True) == ({}, None)
    assert replanner._search is None and not (tmp_path / "plan_history.jsonl").exists()


def test_a_plan_without_headroom_is_refused_naming_the_call() -> None:
    inputs = tiny_inputs()
    plan = search_plan(inputs.problem, "manual", manual=inputs.manual).plan
    check_headroom(inputs.problem, plan)  # the tiny plan uses a sliver of the 4 GiB
    squeezed = replace(inputs.problem, memory_margin=0.999999)
    with pytest.raises(ConfigError) as info:
        check_headroom(squeezed, plan)
    message = str(info.value)
    assert message.startswith("plan.memory_margin=") and "call actor_gen" in message and "GiB per GPU of 4.0 GiB" in message
    assert "\n" not in message
