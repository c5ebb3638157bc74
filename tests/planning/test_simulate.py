"""Unit tests of the plan simulator (planning.simulate): concurrency, dependencies, reallocation, memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planning.algorithm_graphs import ppo_graph
from planning.cost import PlanningProblem, call_cost, rlhf_problem
from planning.dataflow import BatchShape, with_staleness
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import ExecutionPlan, Placement
from planning.simulate import SimResult, SimTask, simulate

pytestmark = pytest.mark.unit


def _problem(model: str = "llama-7b", nodes: int = 1) -> PlanningProblem:
    graph = ppo_graph(BatchShape(256, 256, 256))
    return rlhf_problem(graph, ClusterSpec(nodes, 8, hardware_preset("h100-80g")), model_preset(model))


def _at(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, 8), Layout.parse(layout))


def _plan(**placements: Placement) -> ExecutionPlan:
    order = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")
    return ExecutionPlan(tuple((name, placements[name]) for name in order))


def _split_plan() -> ExecutionPlan:
    """Generation on all 8 GPUs; inference and training split over the two halves."""
    return _plan(
        actor_gen=_at(0, 8, "tp8"), rew_inf=_at(0, 4, "dp4"), ref_inf=_at(4, 4, "dp4"),
        critic_inf=_at(4, 4, "dp2tp2"), actor_train=_at(0, 4, "dp2tp2"), critic_train=_at(4, 4, "dp2tp2"),
    )


def _task(result: SimResult, name: str, iteration: int = 0) -> SimTask:
    return next(t for t in result.tasks if t.name == name and t.iteration == iteration)


def _overlap(a: SimTask, b: SimTask) -> bool:
    return a.start_s < b.end_s and b.start_s < a.end_s


def test_disjoint_meshes_run_concurrently() -> None:
    result = simulate(_problem(), _split_plan())
    assert result.feasible, result.reason
    assert _overlap(_task(result, "rew_inf"), _task(result, "ref_inf"))
    assert _overlap(_task(result, "actor_train"), _task(result, "critic_train"))


def test_overlapping_meshes_serialise_in_graph_order() -> None:
    full = _at(0, 8, "dp2tp4")
    plan = _plan(**{name: full for name in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")})
    result = simulate(_problem(), plan)
    assert result.feasible, result.reason
    calls = sorted((t for t in result.tasks if t.kind == "call"), key=lambda t: t.start_s)
    for a, b in zip(calls, calls[1:]):
        assert b.start_s >= a.end_s - 1e-12
    assert [t.name for t in calls[:7]] == [m.name for m in _problem().graph.mfcs]  # actor_inf: where actor_train is
    # Iterations repeat identically: steady state equals one iteration's sum of call times.
    first = [t for t in calls if t.iteration == 0]
    assert result.iteration_s == pytest.approx(sum(t.end_s - t.start_s for t in first))


def test_data_and_version_dependencies_are_respected() -> None:
    problem = _problem()
    result = simulate(problem, _split_plan(), iterations=3)
    graph = problem.graph
    for task in (t for t in result.tasks if t.kind == "call"):
        for parent in graph.data_parents(task.name):
            assert task.start_s >= _task(result, parent, task.iteration).end_s - 1e-12
        if task.iteration:
            for parent in graph.version_parents(task.name):
                assert task.start_s >= _task(result, parent, task.iteration - 1).end_s - 1e-12
    # Generation of the next iteration waits for actor training, even on free GPUs.
    assert _task(result, "actor_gen", 1).start_s >= _task(result, "actor_train", 0).end_s


def test_realloc_tasks_only_where_placements_differ() -> None:
    result = simulate(_problem(), _split_plan())
    reallocs = {t.name for t in result.tasks if t.kind == "realloc"}
    # actor_gen (tp8 on 8) differs from actor_train (dp2tp2 on 0-3); critic_inf equals critic_train.
    assert reallocs == {"realloc:actor_train->actor_gen"}
    task = _task(result, "realloc:actor_train->actor_gen", 1)
    assert task.gpus == tuple(range(8))
    assert task.end_s <= _task(result, "actor_gen", 1).start_s
    assert task.start_s >= _task(result, "actor_train", 0).end_s
    same = _plan(**{n: _at(0, 8, "dp2tp4") for n in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")})
    assert not [t for t in simulate(_problem(), same).tasks if t.kind == "realloc"]


def test_never_trained_roles_are_not_reallocated_but_hold_memory() -> None:
    problem = _problem()
    plan = _split_plan()
    result = simulate(problem, plan)
    assert not [t for t in result.tasks if "ref_inf" in t.name and t.kind == "realloc"]
    moved = _plan(**{**plan.as_dict(), "ref_inf": _at(0, 4, "dp4")})
    moved_result = simulate(problem, moved)
    # ref's resident weights moved from GPUs 4-7 to GPUs 0-3.
    assert moved_result.peak_mem_bytes[0] > result.peak_mem_bytes[0]


def test_memory_overflow_is_infeasible() -> None:
    problem = _problem(model="llama-13b")
    # All four 13B models plus the actor's and critic's optimizer states on 4 GPUs cannot fit.
    half = _at(0, 4, "dp1tp4")
    plan = _plan(**{n: half for n in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")})
    result = simulate(problem, plan)
    assert not result.feasible and "memory" in result.reason
    assert max(result.peak_mem_bytes.values()) > problem.cluster.hardware.mem_bytes
    assert result.peak_mem_bytes[7] == 0.0


def test_steady_state_overlaps_iterations() -> None:
    # Critic training of iteration i and generation of i+1 need nothing from each other.
    problem = _problem(nodes=2)
    plan = _plan(
        actor_gen=_at(0, 8, "tp8"), rew_inf=_at(8, 4, "dp4"), ref_inf=_at(12, 4, "dp4"), critic_inf=_at(8, 4, "dp2tp2"),
        actor_train=_at(0, 8, "dp2tp4"), critic_train=_at(8, 4, "dp2tp2"),
    )
    result = simulate(problem, plan, iterations=4)
    assert result.feasible, result.reason
    # critic training of iteration i runs beside generation of i+1.
    assert _overlap(_task(result, "critic_train", 0), _task(result, "actor_gen", 1))
    first_end = max(t.end_s for t in result.tasks if t.iteration == 0)
    assert result.iteration_s < first_end
    assert result.iteration_s == pytest.approx(
        (max(t.end_s for t in result.tasks if t.iteration == 3) - first_end) / 3
    )


def test_plan_validation() -> None:
    problem = _problem()
    with pytest.raises(ValueError, match="no placement for calls"):
        simulate(problem, ExecutionPlan((("actor_gen", _at(0, 8, "tp8")),)))
    outside = _plan(**{n: _at(8, 8, "tp8") for n in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")})
    with pytest.raises(ValueError, match="not inside"):
        simulate(problem, outside)


def test_resident_weights_squeeze_a_call_into_a_slower_level() -> None:
    problem = rlhf_problem(ppo_graph(BatchShape(512, 512, 1024)), ClusterSpec(2, 8, hardware_preset("h100-80g")),
                           model_preset("llama-7b"))
    gen = _at(0, 8, "dp2tp4")
    others = ("rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")
    # Generation alone on node 0, or beside every other model's resident weights and optimizer.
    roomy = _plan(actor_gen=gen, **{n: _at(8, 8, "dp4tp2") for n in others})
    crowded = _plan(actor_gen=gen, **{n: gen for n in others})
    free = call_cost(problem, problem.graph.mfc("actor_gen"), gen)
    durations = []
    for plan in (roomy, crowded):
        result = simulate(problem, plan)
        assert result.feasible, result.reason
        task = _task(result, "actor_gen", 1)
        durations.append(task.end_s - task.start_s)
    assert durations[0] == pytest.approx(free.time_s)
    assert durations[1] > 1.1 * free.time_s  # two rounds: the weights are streamed twice as often


# ---- bounded staleness ----------------------------------------------------------------------------


def _disjoint_plan() -> ExecutionPlan:
    """Generation alone on GPUs 0-3; every other call (actor_inf with actor_train) on GPUs 4-7."""
    rest = _at(4, 4, "dp1tp4")
    return _plan(actor_gen=_at(0, 4, "dp1tp4"), **{n: rest for n in ("rew_inf", "ref_inf", "critic_inf",
                                                                         "actor_train", "critic_train")})


def _train_stage(result: SimResult, iteration: int) -> SimTask:
    """The span of an iteration's calls other than generation, as one task."""
    tasks = [t for t in result.tasks if t.kind == "call" and t.iteration == iteration and t.name != "actor_gen"]
    return SimTask("train stage", "call", iteration, (), min(t.start_s for t in tasks), max(t.end_s for t in tasks))


def test_dispatch_order_runs_generation_k_iterations_ahead() -> None:
    graph = _problem().graph
    names = [m.name for m in graph.mfcs]
    assert graph.dispatch_order(2) == [(0, n) for n in names] + [(1, n) for n in names]  # k = 0: on-policy
    stale = with_staleness(graph, 1)
    train = [n for n in names if n != "actor_gen"]
    assert stale.dispatch_order(3) == ([(0, "actor_gen"), (1, "actor_gen")] + [(0, n) for n in train]
                                      + [(2, "actor_gen")] + [(1, n) for n in train] + [(2, n) for n in train])
    assert (stale.version_lag("actor_gen"), stale.version_lag("actor_train")) == (2, 1)


def test_staleness_lets_generation_run_beside_training_on_disjoint_meshes() -> None:
    problem = _problem()
    stale = replace(problem, graph=with_staleness(problem.graph, 1))
    on_policy, async_ = simulate(problem, _disjoint_plan(), iterations=4), simulate(stale, _disjoint_plan(), iterations=4)
    assert on_policy.feasible and async_.feasible, (on_policy.reason, async_.reason)
    # k = 0: the next generation waits for the training stage; k = 1: it runs during it.
    assert not _overlap(_task(on_policy, "actor_gen", 2), _train_stage(on_policy, 1))
    assert _overlap(_task(async_, "actor_gen", 2), _train_stage(async_, 1))
    # Generation of iteration j reads the weights of training j - 2 (reallocated after it).
    for j in (2, 3):
        moved = _task(async_, "realloc:actor_train->actor_gen", j)
        assert moved.start_s >= _task(async_, "actor_train", j - 2).end_s - 1e-9
        assert _task(async_, "actor_gen", j).start_s >= moved.end_s - 1e-9
    # The steady iteration is bounded by the slower side, not by their sum.
    gen = _task(async_, "actor_gen", 2)
    assert async_.iteration_s < on_policy.iteration_s
    assert async_.iteration_s < on_policy.iteration_s - 0.5 * (gen.end_s - gen.start_s)


def test_staleness_gains_nothing_when_every_call_shares_the_gpus() -> None:
    problem = _problem()
    stale = replace(problem, graph=with_staleness(problem.graph, 2))
    same = _plan(**{n: _at(0, 8, "dp2tp4") for n in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train",
                                                         "critic_train")})
    assert simulate(stale, same).iteration_s == pytest.approx(simulate(problem, same).iteration_s)
