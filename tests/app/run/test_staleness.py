"""app.run.staleness: the units the driver submits under bounded staleness, and what it logs."""

from __future__ import annotations

import pytest

from app.run.staleness import StageSchedule, Unit, staleness_metrics, submission_units
from planning.algorithm_graphs import ppo_graph
from planning.dataflow import BatchShape, with_staleness

pytestmark = pytest.mark.unit

GRAPH = ppo_graph(BatchShape(8, 4, 4))
TRAIN = tuple(m.name for m in GRAPH.mfcs if m.kind != "generate")


def test_on_policy_submits_whole_iterations_in_graph_order() -> None:
    names = tuple(m.name for m in GRAPH.mfcs)
    assert submission_units(GRAPH, 2) == [Unit(0, names, True), Unit(1, names, True)]


def test_staleness_one_submits_generation_one_iteration_ahead() -> None:
    units = submission_units(with_staleness(GRAPH, 1), 4)
    gen = ("actor_gen",)
    assert units == [Unit(0, gen, False), Unit(1, gen, False), Unit(0, TRAIN, True), Unit(2, gen, False),
                     Unit(1, TRAIN, True), Unit(3, gen, False), Unit(2, TRAIN, True), Unit(3, TRAIN, True)]
    # Never more than k + 1 generated batches ahead of the training submitted so far.
    ahead, trained = 0, 0
    for unit in units:
        ahead, trained = (ahead + 1, trained) if not unit.completes else (ahead, trained + 1)
        assert ahead - trained <= 2


def test_schedule_hands_out_units_once() -> None:
    schedule = StageSchedule(with_staleness(GRAPH, 2), 3)
    seen = [schedule.next_unit() for _ in range(schedule.remaining)]
    assert [u.iteration for u in seen if not u.completes] == [0, 1, 2]
    assert [u.iteration for u in seen if u.completes] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="already submitted"):
        schedule.next_unit()


def test_staleness_metrics() -> None:
    assert staleness_metrics(5, 0) == {}
    assert [staleness_metrics(i, 1)["rollout/staleness"] for i in range(4)] == [0.0, 1.0, 1.0, 1.0]
    assert [staleness_metrics(i, 2)["rollout/weights_version"] for i in range(5)] == [-1.0, -1.0, -1.0, 0.0, 1.0]
    assert [staleness_metrics(i, 2)["rollout/staleness"] for i in range(5)] == [0.0, 1.0, 2.0, 2.0, 2.0]


def test_a_resumed_run_starts_its_schedule_at_the_resumed_iteration() -> None:
    stale = with_staleness(GRAPH, 1)
    resumed = StageSchedule(stale, 5, start=3)
    units = [resumed.next_unit() for _ in range(resumed.remaining)]
    # As a fresh run of 2 iterations would, shifted to iterations 3 and 4.
    assert units == [Unit(u.iteration + 3, u.calls, u.completes) for u in submission_units(stale, 2)]
    # Its first generations use the resumed weights (those after training 2): staleness restarts.
    assert [staleness_metrics(i, 1, start=3)["rollout/weights_version"] for i in (3, 4, 5)] == [2.0, 2.0, 3.0]
    assert [staleness_metrics(i, 1, start=3)["rollout/staleness"] for i in (3, 4, 5)] == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="start=5"):
        StageSchedule(stale, 5, start=5)


def test_dpo_cannot_run_ahead() -> None:
    from planning.algorithm_graphs import dpo_graph

    with pytest.raises(ValueError, match="no generation"):
        with_staleness(dpo_graph(BatchShape(4, 4, 4)), 1)
