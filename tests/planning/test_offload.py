"""Optimizer offload in the planner (planning.offload, planning.offload_search): its memory and
time terms, the host memory check, and the search offloading only what does not fit."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest

from planning.algorithm_graphs import grpo_graph, ppo_graph
from planning.cost import PlanningProblem, call_cost, rlhf_problem
from planning.dataflow import BatchShape, prune_graph
from planning.hardware import GiB, hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.offload import (
    OFFLOAD_STEPS,
    OPTIMIZER_BYTES_PER_PARAM,
    host_capacity_bytes,
    node_host_excess,
)
from planning.offload_search import offload_ladder
from planning.plan import OFFLOAD_CHUNK_ELEMENTS, ExecutionPlan, Placement
from planning.search import search_plan
from planning.simulate import simulate

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))


def grpo_8b(host_mem_gib: float | None = None) -> PlanningProblem:
    """Issue 25's problem: Llama-3-8B GRPO on one H200, 32 prompts x 8, 128 + 512 tokens, the
    config's default 10% memory margin."""
    hw = hardware_preset("h200-141g")
    if host_mem_gib is not None:
        hw = replace(hw, host_mem_bytes=host_mem_gib * GiB)
    problem = rlhf_problem(grpo_graph(BatchShape(32, 128, 512), 8), ClusterSpec(1, 1, hw), model_preset("llama3-8b"))
    return replace(problem, memory_margin=0.1)


def one_gpu_plan(problem: PlanningProblem, fractions: dict[str, float]) -> ExecutionPlan:
    return ExecutionPlan(tuple((m.name, ONE_GPU) for m in problem.graph.mfcs)).with_offload(fractions)


def test_train_cost_moves_the_offloaded_optimizer_state_to_the_host() -> None:
    problem = grpo_8b()
    train = problem.graph.mfc("actor_train")
    whole = call_cost(problem, train, ONE_GPU)
    half = call_cost(problem.with_offload({"actor": 0.5}), train, ONE_GPU, execution=whole.execution)
    params = model_preset("llama3-8b").n_params()
    assert whole.breakdown["optimizer_bytes"] == OPTIMIZER_BYTES_PER_PARAM * params and whole.host_bytes == 0.0
    assert "offload_s" not in whole.breakdown and "offload_buffer_bytes" not in whole.breakdown
    assert half.breakdown["optimizer_bytes"] == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * params / 2, rel=1e-6)
    assert half.host_bytes == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * params / 2, rel=1e-6)
    # Two staging sets of master, m, v chunks: 384 MiB, on the GPU only while the call runs.
    assert half.breakdown["offload_buffer_bytes"] == 2 * 3 * 4 * OFFLOAD_CHUNK_ELEMENTS == 384 * 2**20
    assert half.mem_bytes == pytest.approx(whole.mem_bytes - half.host_bytes + 384 * 2**20)
    # One direction's bytes at host_bw per optimizer step (the other overlaps), plus a little.
    steps = train.n_minibatches
    streamed = steps * half.host_bytes / problem.cluster.hardware.host_bw
    assert streamed < half.breakdown["offload_s"] < 1.05 * streamed
    assert half.time_s == pytest.approx(whole.time_s + half.breakdown["offload_s"])


def test_problem_refuses_offload_of_untrained_roles_and_bad_fractions() -> None:
    problem = grpo_8b()
    with pytest.raises(ValueError, match=r"optimizer_offload\['ref'\]: not a trained role.*allowed: actor"):
        problem.with_offload({"ref": 0.5})
    with pytest.raises(ValueError, match=r"optimizer_offload\['actor'\]=1.5: must be a fraction in \(0, 1\]"):
        replace(problem, optimizer_offload=(("actor", 1.5),))
    assert problem.with_offload({"actor": 0.0}).optimizer_offload == ()


def test_peer_bench_1b_problem_plans_without_offload() -> None:
    """The 1B GRPO of benchmarks/peer_bench.py (no KL: no reference) fits an H200 as it is."""
    graph = prune_graph(grpo_graph(BatchShape(64, 128, 512), 8), ("ref_logprobs",))
    problem = replace(rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset("llama3.2-1b")),
                      memory_margin=0.1)
    result = search_plan(problem, seconds=5)
    assert result.plan.optimizer_offload == () and simulate(problem, result.plan).offload_s == {}
    pinned = search_plan(replace(problem, auto_offload=False), seconds=5)
    assert result.est_iteration_s == pytest.approx(pinned.est_iteration_s) and result.plan == pinned.plan


def test_8b_grpo_on_one_h200_needs_and_gets_the_least_offload() -> None:
    problem = grpo_8b()
    with pytest.raises(ValueError, match=r"actor_train: no placement fits.*needs 137.3 GiB per GPU"):
        search_plan(replace(problem, auto_offload=False), seconds=5)
    result = search_plan(problem, seconds=5)
    fraction = result.plan.offload_fraction("actor")
    assert 0.0 < fraction < 1.0 and (fraction * OFFLOAD_STEPS).is_integer()
    sim = simulate(problem, result.plan)
    assert sim.feasible and sim.iteration_s == pytest.approx(result.est_iteration_s)
    assert sim.offload_s["actor_train"] > 0 and max(sim.peak_mem_bytes.values()) <= problem.mem_limit_bytes
    # Exactly what does not fit: one step less does not fit the GPU.
    less = simulate(problem, one_gpu_plan(problem, {"actor": fraction - 1 / OFFLOAD_STEPS}))
    assert not less.feasible and "peak memory exceeds the GPU" in less.reason
    # The same plan without its offload is priced as the problem says: it does not fit.
    assert not simulate(problem, result.plan.with_offload({})).feasible


def test_too_little_host_memory_names_role_need_and_capacity() -> None:
    with pytest.raises(ValueError, match=r"least offload with which one does, actor 5/8 \(56.1 GiB .*does not fit host "
                                         r"memory: .*needs 56.1 GiB \(actor 56.1 GiB\), the node has 12.8 GiB"):
        search_plan(grpo_8b(host_mem_gib=24), seconds=5)
    with pytest.raises(ValueError, match=r"offload cannot help: its least step \(actor 1/8\) needs 11.2 GiB of host "
                                         r"memory, the cluster has 1.6 GiB"):
        search_plan(grpo_8b(host_mem_gib=8), seconds=5)
    # A plan that fixes more offload than host memory holds is infeasible, naming the node.
    small = grpo_8b(host_mem_gib=24)
    sim = simulate(small, one_gpu_plan(small, {"actor": 1.0}))
    assert not sim.feasible and sim.reason.startswith("host memory overflows: the optimizer state offloaded to node 0")


def test_node_host_excess_sums_the_gpus_of_each_node() -> None:
    hw = replace(hardware_preset("h100-80g"), host_mem_bytes=32 * GiB)
    per_gpu = host_capacity_bytes(hw)
    # Node 0 (GPUs 0-3) holds 4 GPUs of actor state and 2 of critic state: over its 4 shares.
    terms = [(0, 4, per_gpu * 0.75, "actor"), (2, 6, per_gpu * 0.75, "critic")]
    excess, reason = node_host_excess(terms, 4, hw)
    assert excess == pytest.approx(4 * 0.75 * per_gpu + 2 * 0.75 * per_gpu - 4 * per_gpu)
    assert "node 0" in reason and "actor" in reason and "critic" in reason
    assert node_host_excess(terms[:1], 4, hw)[0] <= 0 and node_host_excess([], 4, hw) == (-math.inf, "")


def test_ladder_offloads_the_role_with_most_state_left_first() -> None:
    graph = ppo_graph(BatchShape(8, 16, 16))
    problem = rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset("llama-7b"),
                           critic=model_preset("llama3.2-1b"))
    ladder = offload_ladder(problem)
    assert len(ladder) == 2 * OFFLOAD_STEPS and ladder[0] == {"actor": 1 / 8}
    assert ladder[-1] == {"actor": 1.0, "critic": 1.0}
    # The 7B actor goes far before the 1B critic; each step adds 1/8 of one role.
    first_critic = next(i for i, step in enumerate(ladder) if "critic" in step)
    assert ladder[first_critic - 1]["actor"] >= 7 / 8
    assert all(sum(b.values()) - sum(a.values()) == pytest.approx(1 / 8) for a, b in pairwise(ladder))


def test_pinned_offload_is_kept_and_a_manual_plan_gets_the_least() -> None:
    problem = grpo_8b()
    pinned = replace(problem.with_offload({"actor": 0.75}), auto_offload=False)
    assert search_plan(pinned, seconds=5).plan.optimizer_offload == (("actor", 0.75),)
    manual = one_gpu_plan(problem, {})
    auto = search_plan(problem, "manual", manual=manual)
    assert auto.plan.optimizer_offload == search_plan(problem, seconds=5).plan.optimizer_offload
    fixed = search_plan(problem, "manual", manual=manual.with_offload({"actor": 0.875}))
    assert fixed.plan.optimizer_offload == (("actor", 0.875),)
    with pytest.raises(ValueError, match="manual plan is infeasible: host memory overflows"):
        search_plan(problem, "manual", manual=manual.with_offload({"actor": 1.0}))  # 89.7 GiB of 85.6
