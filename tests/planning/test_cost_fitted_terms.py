"""The cost-model terms fitted to measured H200 runs (issue 27): the optimizer step and gradient
accumulation as the engine's kernels move bytes, the per-micro-batch GEMM ramp, the generate
round's setup, and the preset's efficiency factors a config gets when it names no profile."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from app.config import build_problem, load_config
from planning.algorithm_graphs import grpo_graph
from planning.cost import PlanningProblem, call_cost, rlhf_problem
from planning.cost_terms import GRAD_ACCUMULATION_TRAFFIC_PER_PARAM, OPTIMIZER_TRAFFIC_PER_PARAM, call_geometry
from planning.dataflow import BatchShape
from planning.efficiency import PRESET_EFFICIENCY, OpEfficiency, preset_efficiency
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import CallExecution, Placement

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))


def _problem(minibatches: int = 1, gpu: str = "h200-141g") -> PlanningProblem:
    graph = grpo_graph(BatchShape(64, 128, 512), group_size=8, ppo_minibatches=minibatches)
    return rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset(gpu)), model_preset("llama3.2-1b"))


def _train(problem: PlanningProblem, mb_tokens: int) -> dict[str, float]:
    cost = call_cost(problem, problem.graph.mfc("actor_train"), ONE_GPU, execution=CallExecution(micro_batch_tokens=mb_tokens))
    assert cost.feasible, cost.reason
    return cost.breakdown


def test_each_optimizer_step_moves_the_engines_bytes_per_parameter() -> None:
    one, sixteen = _problem(1), _problem(16)
    params = call_geometry(model_preset("llama3.2-1b"), False, Layout(1, 1, 1)).stage_params
    hbm = one.cluster.hardware.hbm_bw * one.efficiency.optimizer
    step_s = params * OPTIMIZER_TRAFFIC_PER_PARAM / hbm + one.cluster.hardware.kernel_overhead_s
    assert _train(one, 16384)["optimizer_s"] == pytest.approx(step_s)
    assert _train(sixteen, 16384)["optimizer_s"] == pytest.approx(16 * step_s)
    # 1.24B parameters at 126 bytes on an H200: ~36 ms a step, as measured (docs/benchmarks.md).
    assert 0.030 < step_s < 0.045


def test_gradient_accumulation_is_paid_per_micro_batch() -> None:
    problem = _problem()
    coarse, fine = _train(problem, 16384), _train(problem, 4096)
    assert fine["micro_batches"] == 4 * coarse["micro_batches"]
    assert fine["grad_accumulation_s"] == pytest.approx(4 * coarse["grad_accumulation_s"])
    spec = model_preset("llama3.2-1b")
    geo = call_geometry(spec, False, Layout(1, 1, 1))
    # Only parameters outside the blocks' linear layers pass through .grad (the linear layers
    # accumulate in their GEMM): for the tied 1B model, the embedding table and the norms.
    hooked = spec.vocab_size * spec.hidden_size + (2 * spec.n_layers + 1) * spec.hidden_size
    assert geo.stage_params - geo.stage_layers * geo.layer_matmul_flops / 2 == pytest.approx(hooked)
    per_micro = hooked * GRAD_ACCUMULATION_TRAFFIC_PER_PARAM / problem.cluster.hardware.hbm_bw
    assert coarse["grad_accumulation_s"] == pytest.approx(coarse["micro_batches"] * per_micro)


def test_an_untied_head_accumulates_in_its_gemm_like_the_blocks() -> None:
    # An untied head is a linear layer too: only the embedding table and the norms pass .grad.
    spec = model_preset("qwen2.5-7b")
    assert not spec.tie_embeddings
    graph = grpo_graph(BatchShape(8, 128, 128), group_size=2)
    problem = rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), spec)
    cost = call_cost(problem, graph.mfc("actor_train"), ONE_GPU, execution=CallExecution(micro_batch_tokens=2048))
    bias = 0 if not spec.qkv_bias else spec.n_layers * (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
    hooked = spec.vocab_size * spec.hidden_size + (2 * spec.n_layers + 1) * spec.hidden_size + bias
    per_micro = hooked * GRAD_ACCUMULATION_TRAFFIC_PER_PARAM / problem.cluster.hardware.hbm_bw
    assert cost.breakdown["grad_accumulation_s"] == pytest.approx(cost.breakdown["micro_batches"] * per_micro)


def test_short_micro_batches_pay_the_gemm_ramp() -> None:
    # Same tokens in 4x the micro-batches: the matmul time grows by the ramp of the extra ones.
    problem = _problem()
    ramp = problem.cluster.hardware.gemm_ramp_tokens
    assert ramp == 512
    coarse, fine = _train(problem, 16384), _train(problem, 4096)
    n = coarse["micro_batches"]
    expected = (4 * n * (4096 + ramp)) / (n * (16384 + ramp))
    assert fine["compute_s"] / coarse["compute_s"] == pytest.approx(expected, rel=0.02)
    # Without a ramp (the CPU setup's: its matmuls have no waves to fill) micro-batching is free.
    assert hardware_preset("cpu").gemm_ramp_tokens == 0
    flat = replace(problem, cluster=ClusterSpec(1, 1, replace(problem.cluster.hardware, gemm_ramp_tokens=0.0)))
    assert _train(flat, 4096)["compute_s"] == pytest.approx(_train(flat, 16384)["compute_s"], rel=1e-6)


def test_every_generation_round_pays_its_setup() -> None:
    problem = _problem()
    mfc = problem.graph.mfc("actor_gen")
    hw = problem.cluster.hardware
    assert hw.generate_setup_s > 0
    one = call_cost(problem, mfc, ONE_GPU, execution=CallExecution(gen_rounds=1)).breakdown
    two = call_cost(problem, mfc, ONE_GPU, execution=CallExecution(gen_rounds=2)).breakdown
    assert one["setup_s"] == pytest.approx(16 * hw.generate_setup_s)  # per decoder block
    assert two["setup_s"] == pytest.approx(2 * one["setup_s"])
    cpu = call_cost(_problem(gpu="cpu"), mfc, ONE_GPU, execution=CallExecution(gen_rounds=1)).breakdown
    assert cpu["setup_s"] == 0.0  # no CUDA graphs on the CPU test setup


def test_presets_take_their_fitted_efficiencies(tmp_path: Path) -> None:
    assert preset_efficiency("h200-141g") == PRESET_EFFICIENCY["h200-141g"] != OpEfficiency()
    assert preset_efficiency("a100-80g") == OpEfficiency()  # nothing fitted: the peaks as they are
    config = tmp_path / "run.yaml"
    config.write_text("algorithm: grpo\nmodels: {actor: {preset: tiny}}\ncluster: {gpu: h200-141g}\n")
    assert build_problem(load_config(config)).efficiency == PRESET_EFFICIENCY["h200-141g"]
    assert build_problem(load_config(config, ["cluster.gpu=cpu"])).efficiency == OpEfficiency()
    # A measured profile replaces them: factors it names, 1.0 for the others.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"efficiency": {"gemm": 0.8}}))
    profiled = build_problem(load_config(config, [f"plan.profile={profile}"])).efficiency
    assert profiled == OpEfficiency(gemm=0.8)


def test_elementwise_factor_scales_only_the_elementwise_term() -> None:
    base = _problem()
    slow = replace(base, efficiency=OpEfficiency(elementwise=0.5))
    a, b = _train(base, 16384), _train(slow, 16384)
    assert b["elementwise_s"] == pytest.approx(2 * a["elementwise_s"])
    assert b["compute_s"] == pytest.approx(a["compute_s"]) and math.isfinite(b["compute_s"])
