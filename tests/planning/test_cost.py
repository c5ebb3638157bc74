"""Unit tests of the analytic cost model (planning.cost): sanity, monotonicity, feasibility."""

from __future__ import annotations

import math

import pytest

from planning.algorithm_graphs import ppo_graph
from planning.cost import (
    CallCost,
    ModelRole,
    PlanningProblem,
    call_cost,
    call_cost_levels,
    rlhf_problem,
    weight_bytes_per_gpu,
)
from planning.cost_terms import ELEMENTWISE_BYTES_PER_HIDDEN, ELEMENTWISE_BYTES_PER_INTERMEDIATE, allreduce_s
from planning.dataflow import MFC, BatchShape, Graph
from planning.efficiency import OpEfficiency
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import Placement

pytestmark = pytest.mark.unit


def _problem(nodes: int = 1, gpus: int = 8, model: str = "llama-7b", batch: BatchShape | None = None) -> PlanningProblem:
    graph = ppo_graph(batch or BatchShape(256, 256, 256))
    return rlhf_problem(graph, ClusterSpec(nodes, gpus, hardware_preset("h100-80g")), model_preset(model))


def _cost(problem: PlanningProblem, call: str, start: int, size: int, layout: str) -> CallCost:
    mesh = Mesh(start, size, problem.cluster.gpus_per_node)
    return call_cost(problem, problem.graph.mfc(call), Placement(mesh, Layout.parse(layout)))


def test_time_and_memory_are_sums_of_the_breakdown() -> None:
    problem = _problem()
    for mfc in problem.graph.mfcs:
        cost = _cost(problem, mfc.name, 0, 8, "dp2tp2pp2")
        assert cost.feasible, cost.reason
        seconds = sum(v for k, v in cost.breakdown.items() if k.endswith("_s"))
        nbytes = sum(v for k, v in cost.breakdown.items() if k.endswith("_bytes"))
        assert cost.time_s == pytest.approx(seconds)
        assert cost.mem_bytes == pytest.approx(nbytes)
        assert cost.time_s > 0 and cost.mem_bytes > 0


def test_more_tp_less_compute_per_gpu_but_tp_comm_is_paid() -> None:
    problem = _problem()
    previous = None
    for tp in (1, 2, 4, 8):
        cost = _cost(problem, "ref_inf", 0, tp, f"tp{tp}")
        assert cost.feasible, cost.reason
        if tp == 1:
            assert cost.breakdown["tp_comm_s"] == 0.0
        else:
            assert cost.breakdown["tp_comm_s"] > 0.0
            assert cost.breakdown["compute_s"] < previous.breakdown["compute_s"]
            assert cost.mem_bytes < previous.mem_bytes
        previous = cost


def test_elementwise_work_is_mostly_replicated_over_tp() -> None:
    # No sequence parallelism: norms and residuals on [tokens, hidden] run whole on every tp
    # rank; only the MLP's share splits. So a tp=8 forward does not get 8x cheaper there.
    problem = _problem()
    spec = problem.models["ref"].spec
    one = _cost(problem, "ref_inf", 0, 1, "tp1").breakdown["elementwise_s"]
    eight = _cost(problem, "ref_inf", 0, 8, "tp8").breakdown["elementwise_s"]
    split = ELEMENTWISE_BYTES_PER_INTERMEDIATE * spec.intermediate_size
    whole = ELEMENTWISE_BYTES_PER_HIDDEN * spec.hidden_size
    assert eight / one == pytest.approx((whole + split / 8) / (whole + split))
    assert one / 8 < eight < one
    # The tp all-reduces inside real steps scale with tp_comm, on top of comm.
    slow = PlanningProblem(problem.graph, problem.cluster, problem.models, OpEfficiency(tp_comm=0.25))
    base_tp = _cost(problem, "ref_inf", 0, 8, "tp8").breakdown["tp_comm_s"]
    assert _cost(slow, "ref_inf", 0, 8, "tp8").breakdown["tp_comm_s"] > 3 * base_tp


def test_communication_never_zero_for_parallel_dimensions() -> None:
    problem = _problem(nodes=2)
    train_dp = _cost(problem, "actor_train", 0, 16, "dp4tp4pp1")
    assert train_dp.breakdown["dp_comm_s"] > 0 and train_dp.breakdown["tp_comm_s"] > 0
    pipe = _cost(problem, "actor_train", 0, 8, "dp1tp4pp2")
    assert pipe.breakdown["pp_p2p_s"] > 0 and pipe.breakdown["pp_bubble_s"] > 0
    gen = _cost(problem, "actor_gen", 0, 8, "dp1tp4pp2")
    assert gen.breakdown["tp_comm_s"] > 0 and gen.breakdown["pp_p2p_s"] > 0


def test_dp_across_nodes_costs_more_than_within_a_node() -> None:
    # Same dp degree; the 16-GPU mesh's dp group (dp*tp=16 GPUs) leaves the node, the 8-GPU one does not.
    problem = _problem(nodes=2)
    inside = _cost(problem, "actor_train", 0, 8, "dp8tp1pp1")
    across = _cost(problem, "actor_train", 0, 16, "dp8tp2pp1")
    assert across.breakdown["dp_comm_s"] > inside.breakdown["dp_comm_s"]


def test_pipeline_bubble_shrinks_with_more_micro_batches() -> None:
    small = _problem(batch=BatchShape(16, 256, 256))
    large = _problem(batch=BatchShape(1024, 256, 256))
    a = _cost(small, "ref_inf", 0, 4, "pp4")
    b = _cost(large, "ref_inf", 0, 4, "pp4")
    assert a.breakdown["pp_bubble_s"] / a.breakdown["compute_s"] > b.breakdown["pp_bubble_s"] / b.breakdown["compute_s"]


def test_more_gpus_train_faster() -> None:
    problem = _problem()
    times = [_cost(problem, "actor_train", 0, n, f"dp{n // 2}tp2").time_s for n in (2, 4, 8)]
    assert times[0] > times[1] > times[2]


def test_decode_is_memory_bound_and_scales_with_gen_len() -> None:
    short = _problem(batch=BatchShape(64, 128, 128))
    long = _problem(batch=BatchShape(64, 128, 512))
    a = _cost(short, "actor_gen", 0, 8, "tp8")
    b = _cost(long, "actor_gen", 0, 8, "tp8")
    assert b.breakdown["decode_s"] > 3.5 * a.breakdown["decode_s"]
    spec = model_preset("llama-7b")
    hw = short.cluster.hardware
    # A decode step can never beat streaming this GPU's weights once from HBM.
    weights = weight_bytes_per_gpu(ModelRole(spec, False), Layout(1, 8, 1))
    assert a.breakdown["decode_s"] >= 128 * weights / hw.hbm_bw


def test_memory_exceeded_is_infeasible_with_reason() -> None:
    problem = _problem(model="llama-70b")
    cost = _cost(problem, "actor_train", 0, 1, "dp1")
    assert not cost.feasible and "GiB" in cost.reason
    assert cost.mem_bytes > problem.cluster.hardware.mem_bytes
    assert math.isfinite(cost.time_s)  # it is infeasible, not merely slow


def test_illegal_layouts_are_infeasible() -> None:
    problem = _problem(model="tiny", batch=BatchShape(8, 16, 16))
    assert "tp=8" in _cost(problem, "actor_train", 0, 8, "tp8").reason  # 4 heads
    assert "pp=8" in _cost(problem, "actor_train", 0, 8, "pp8").reason  # 4 layers
    few = _problem(model="tiny", batch=BatchShape(4, 16, 16))
    assert not _cost(few, "actor_train", 0, 8, "dp8").feasible  # 4 seqs over 4 minibatches x 8 replicas


def test_efficiency_factors_slow_down_their_op() -> None:
    base = _problem()
    slow = PlanningProblem(base.graph, base.cluster, base.models, OpEfficiency(gemm=0.5, comm=0.5))
    a = _cost(base, "actor_train", 0, 8, "dp2tp4")
    b = _cost(slow, "actor_train", 0, 8, "dp2tp4")
    assert b.breakdown["compute_s"] == pytest.approx(2 * a.breakdown["compute_s"])
    assert b.breakdown["tp_comm_s"] > 1.5 * a.breakdown["tp_comm_s"]
    with pytest.raises(ValueError, match="OpEfficiency.gemm"):
        OpEfficiency(gemm=5.0)
    assert OpEfficiency.from_dict({"decode": 0.7}) == OpEfficiency(decode=0.7)
    with pytest.raises(ValueError, match="unknown keys \\['flops'\\]"):
        OpEfficiency.from_dict({"flops": 0.5})


def test_critic_has_no_vocab_head() -> None:
    problem = _problem()
    critic = _cost(problem, "critic_inf", 0, 8, "dp8")
    ref = _cost(problem, "ref_inf", 0, 8, "dp8")
    assert critic.breakdown["weights_bytes"] < ref.breakdown["weights_bytes"]
    assert critic.mem_bytes < ref.mem_bytes


def test_allreduce_formula() -> None:
    assert allreduce_s(1e9, 1, 1e9, 1e-5) == 0.0
    assert allreduce_s(1e9, 4, 1e9, 0.0) == pytest.approx(1.5)


def test_problem_validation_names_the_field() -> None:
    base = _problem()
    with pytest.raises(ValueError, match="roles"):
        PlanningProblem(base.graph, base.cluster, {"actor": base.models["actor"]})
    with pytest.raises(ValueError, match="role 'policy'"):
        PlanningProblem(base.graph, base.cluster, {**base.models, "policy": base.models["actor"]})
    mfc = MFC("x", "critic", "inference", ("prompts",), ("v",), BatchShape(1, 1, 1))
    critic_only = PlanningProblem(Graph("x", (mfc,)), base.cluster, {"critic": base.models["critic"]})
    assert critic_only.models["critic"].critic


def test_generation_rounds_trade_time_for_kv_memory() -> None:
    problem = _problem(batch=BatchShape(512, 1024, 1024))
    mfc = problem.graph.mfc("actor_gen")
    placement = Placement(Mesh(0, 4, 8), Layout(1, 4, 1))
    levels = call_cost_levels(problem, mfc, placement)
    assert [lv.breakdown["generation_rounds"] for lv in levels[:3]] == [1.0, 2.0, 4.0]
    kv = [lv.breakdown["kv_cache_bytes"] for lv in levels]
    assert all(b < a for a, b in zip(kv, kv[1:]))
    assert levels[1].time_s > levels[0].time_s  # every round streams the weights again
    free = call_cost(problem, mfc, placement)
    squeezed = call_cost(problem, mfc, placement, mem_budget_bytes=free.mem_bytes * 0.6)
    assert squeezed.feasible and squeezed.time_s > free.time_s and squeezed.mem_bytes <= free.mem_bytes * 0.6
    hopeless = call_cost(problem, mfc, placement, mem_budget_bytes=1e9)
    assert not hopeless.feasible and "free" in hopeless.reason


def test_training_levels_add_micro_batches() -> None:
    problem = _problem()
    levels = call_cost_levels(problem, problem.graph.mfc("actor_train"), Placement(Mesh(0, 8, 8), Layout(2, 2, 2)))
    micro = [lv.breakdown["micro_batches"] for lv in levels]
    assert micro[0] == 4 and all(b == 2 * a for a, b in zip(micro, micro[1:]))
    acts = [lv.breakdown["activation_bytes"] for lv in levels]
    assert all(b < a for a, b in zip(acts, acts[1:]))
    # With a pipeline, more micro-batches also shrink the bubble.
    assert levels[1].breakdown["pp_bubble_s"] < levels[0].breakdown["pp_bubble_s"]


def test_pipelined_decode_rereads_weights_per_micro_batch() -> None:
    # Each decode step of each micro-batch traverses every stage, and with few sequences per
    # micro-batch every stage streams its weights again for each of the pp micro-batches: at a
    # fixed tp, adding pipeline stages does not make memory-bound decoding faster (it only adds
    # p2p hops), whereas tp splits the weights each step streams.
    problem = _problem(batch=BatchShape(64, 16, 64))  # short context: weights dominate the reads
    flat = _cost(problem, "actor_gen", 0, 2, "tp2").breakdown
    piped = _cost(problem, "actor_gen", 0, 8, "tp2pp4").breakdown
    wide = _cost(problem, "actor_gen", 0, 8, "tp8").breakdown
    assert piped["decode_s"] == pytest.approx(flat["decode_s"], rel=0.05)
    assert wide["decode_s"] < 0.3 * flat["decode_s"]
    # pp hops per step: every micro-batch crosses pp stage boundaries (the last back to the first).
    hw = problem.cluster.hardware
    assert piped["pp_p2p_s"] >= 64 * 4 * hw.collective_latency_s


def test_decode_pays_two_tp_allreduces_per_layer_per_token() -> None:
    # Latency-bound at small batch: 2 all-reduces per block per decode step, whatever the bytes.
    problem = _problem(batch=BatchShape(8, 16, 100))
    gen = _cost(problem, "actor_gen", 0, 8, "tp8").breakdown
    layers = model_preset("llama-7b").n_layers
    hw = problem.cluster.hardware
    assert gen["tp_comm_s"] >= 100 * layers * 2 * hw.collective_latency_s


def test_sampling_is_paid_every_step_and_gathers_logits_under_tp() -> None:
    # actors.generation.sampling gathers the vocab-parallel logits on tp rank 0 and broadcasts the samples:
    # a tp layout pays those collectives on top of the sampling sweeps every layout pays.
    problem = _problem(batch=BatchShape(64, 16, 64))
    one = _cost(problem, "actor_gen", 0, 1, "dp1").breakdown["sampling_s"]
    two = _cost(problem, "actor_gen", 0, 2, "tp2").breakdown["sampling_s"]
    hw = problem.cluster.hardware
    assert one >= 64 * 2 * 64 * model_preset("llama-7b").vocab_size * 4 / hw.hbm_bw  # at least one read+write
    assert two > one + 64 * 4 * hw.collective_latency_s


def test_short_micro_batches_are_memory_bound_not_free() -> None:
    # A forward over a 16-token micro-batch still streams every weight of the stage from HBM:
    # splitting a batch into more micro-batches must cost weight reads, not only kernel launches.
    problem = _problem(batch=BatchShape(64, 8, 8))
    levels = call_cost_levels(problem, problem.graph.mfc("ref_inf"), Placement(Mesh(0, 1, 8), Layout(1, 1, 1)))
    leanest = levels[-1].breakdown
    assert leanest["micro_batches"] == 64
    weights = weight_bytes_per_gpu(ModelRole(model_preset("llama-7b"), False), Layout(1, 1, 1))
    assert leanest["compute_s"] >= 64 * weights / problem.cluster.hardware.hbm_bw
    assert levels[0].breakdown["compute_s"] < 0.1 * leanest["compute_s"]
