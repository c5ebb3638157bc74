"""How the cost model prices a decode step's sampling (plain: one fused read of the logits;
top-k / top-p: sorted sweeps) and the shared prompts' cascade attention in forwards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.config import load_config
from app.config.problem import build_graph
from planning.algorithm_graphs import grpo_graph
from planning.cost import PlanningProblem, call_cost, rlhf_problem
from planning.cost_passes import (
    CASCADE_OVERHEAD_KERNELS,
    E4M3_TRITON_READ_BYTES,
    E4M3_WIDENED_READ_BYTES,
    kv_read_bytes,
)
from planning.cost_terms import (
    FUSED_SAMPLING_BYTES_PER_LOGIT,
    SAMPLING_PASSES,
    Links,
    call_geometry,
    fp8_aligned,
    sampling_s,
)
from planning.dataflow import BatchShape, Graph
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import CallExecution, Placement
from tests.planning.test_model_free_calls import BASE

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))
H200 = hardware_preset("h200-141g")


def _problem() -> PlanningProblem:
    graph = grpo_graph(BatchShape(64, 128, 512), 8)
    return rlhf_problem(graph, ClusterSpec(1, 1, H200), model_preset("llama3.2-1b"))


def test_config_marks_truncated_sampling_on_the_generate_calls(tmp_path: Path) -> None:
    def graph(sampling: str) -> Graph:
        path = tmp_path / "c.yaml"
        path.write_text(BASE + sampling)
        return build_graph(load_config(path))

    assert not any(m.truncated_sampling for m in graph("").mfcs)  # temperature 1, top_p 1, top_k 0
    for knob in ("sampling: {top_p: 0.9}\n", "sampling: {top_k: 50}\n"):
        marked = graph(knob)
        assert all(m.truncated_sampling == (m.kind == "generate") for m in marked.mfcs), knob
    assert not any(m.truncated_sampling for m in graph("sampling: {temperature: 0, top_k: 50}\n").mfcs)  # greedy


def test_plain_sampling_reads_the_logits_once() -> None:
    problem = _problem()
    links = Links(H200, problem.efficiency, ONE_GPU)
    rows, vocab = 512, 128256
    plain, truncated = (sampling_s(vocab, rows, 1, links, t) for t in (False, True))
    assert plain - H200.kernel_overhead_s == pytest.approx(FUSED_SAMPLING_BYTES_PER_LOGIT * rows * vocab / links.hbm)
    assert truncated - H200.kernel_overhead_s == pytest.approx(SAMPLING_PASSES * 8 * rows * vocab / links.hbm)
    gen = problem.graph.mfc("actor_gen")
    rounds = CallExecution(gen_rounds=1)
    cheap, sorted_ = (call_cost(problem, replace(gen, truncated_sampling=t), ONE_GPU, execution=rounds) for t in
                      (False, True))
    # Every decode step pays its sampling: the call's term scales with the step's, and only it moves.
    assert sorted_.breakdown["sampling_s"] / cheap.breakdown["sampling_s"] == pytest.approx(truncated / plain)
    assert sorted_.time_s - cheap.time_s == pytest.approx(sorted_.breakdown["sampling_s"] - cheap.breakdown["sampling_s"])
    assert cheap.breakdown["sampling_s"] < 0.1 < sorted_.breakdown["sampling_s"]  # 512 steps of 512 rows


def test_shared_prompt_forwards_pay_the_cascade_per_block_and_micro_batch() -> None:
    problem = _problem()
    execution = CallExecution(micro_batch_tokens=16384)
    train = call_cost(problem, problem.graph.mfc("actor_train"), ONE_GPU, execution=execution).breakdown
    n_micro, layers = train["micro_batches"], problem.models["actor"].spec.n_layers
    assert train["cascade_s"] == pytest.approx(3 * n_micro * layers * CASCADE_OVERHEAD_KERNELS * H200.kernel_overhead_s)
    whole = replace(problem.graph.mfc("actor_train"), batch=BatchShape(512, 128, 512))  # one sample per prompt
    assert "cascade_s" not in call_cost(problem, whole, ONE_GPU, execution=execution).breakdown


def test_fp8_decode_is_priced_on_the_mlps_and_head_and_holds_their_copies(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BASE + "sampling: {fp8: true}\n")
    marked = build_graph(load_config(path))
    assert all(m.fp8_decode == (m.kind == "generate") for m in marked.mfcs)
    problem = _problem()
    gen = problem.graph.mfc("actor_gen")
    rounds = CallExecution(gen_rounds=1)
    bf16, fp8 = (call_cost(problem, replace(gen, fp8_decode=f), ONE_GPU, execution=rounds) for f in (False, True))
    spec = model_preset("llama3.2-1b")
    # Llama-3.2-1B ties its head to the embedding, but the FP8 head is a copy of its own.
    copied = spec.n_layers * 3 * spec.hidden_size * spec.intermediate_size + spec.vocab_size * spec.hidden_size
    assert fp8.breakdown["fp8_weights_bytes"] == pytest.approx(copied)
    assert "fp8_weights_bytes" not in bf16.breakdown
    assert fp8.mem_bytes - bf16.mem_bytes == pytest.approx(copied)
    # 512 rows are compute-bound: only the decode term moves, by the MLPs' and head's share of the
    # step's FLOPs times (1 - 1 / FP8_DECODE_SPEEDUP).
    assert fp8.breakdown["prefill_s"] == bf16.breakdown["prefill_s"]
    saved = 1 - fp8.breakdown["decode_s"] / bf16.breakdown["decode_s"]
    assert 0.05 < saved < 0.3


def test_an_fp8_kv_cache_halves_its_bytes_and_prices_its_reads_as_measured(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BASE + "sampling: {kv_cache_dtype: fp8}\n")
    marked = build_graph(load_config(path))
    assert all(m.fp8_kv_cache == (m.kind == "generate") and not m.fp8_decode for m in marked.mfcs)
    problem = _problem()
    gen = problem.graph.mfc("actor_gen")
    rounds = CallExecution(gen_rounds=1)
    bf16, fp8 = (call_cost(problem, replace(gen, fp8_kv_cache=f), ONE_GPU, execution=rounds).breakdown
                 for f in (False, True))
    assert fp8["kv_cache_bytes"] == pytest.approx(bf16["kv_cache_bytes"] / 2)
    assert fp8["prefill_s"] == bf16["prefill_s"] and fp8["weights_bytes"] == bf16["weights_bytes"]
    # Reads priced at E4M3_TRITON_READ_BYTES per value: on the H200 the kernel was measured no
    # faster than over a bf16 cache, so the decode term stays; a cheaper read would lower it.
    read_share = E4M3_TRITON_READ_BYTES / 2.0
    assert fp8["decode_s"] <= bf16["decode_s"] and (fp8["decode_s"] < bf16["decode_s"]) == (read_share < 1)


def test_fp8_copies_are_priced_only_for_weights_the_worker_can_quantize() -> None:
    """The worker keeps a weight in bf16 when a local dim is not a multiple of FP8_ALIGN
    (actors.generation.fp8_weights); the planner then prices neither its copy nor a speed-up."""
    spec = model_preset("llama3.2-1b")
    h, ffn, layers = spec.hidden_size, spec.intermediate_size, spec.n_layers
    aligned = call_geometry(spec, False, Layout(1, 1, 1))
    assert aligned.fp8_stage_params() == pytest.approx(layers * 3 * h * ffn + spec.vocab_size * h)
    odd_vocab = call_geometry(replace(spec, vocab_size=128250), False, Layout(1, 1, 1))  # 128250 % 16 == 10
    assert odd_vocab.fp8_stage_params() == pytest.approx(layers * 3 * h * ffn)
    # tp = 2 halves each shard's vocabulary: 2 x 64,008 rows is 16-aligned whole, not per shard.
    split = call_geometry(replace(spec, vocab_size=128016), False, Layout(1, 2, 1))
    assert split.fp8_stage_params() == pytest.approx(layers * 3 * h * ffn / 2)
    assert call_geometry(spec, True, Layout(1, 1, 1)).fp8_stage_params() == pytest.approx(layers * 3 * h * ffn)
    assert fp8_aligned(2048, 8192) and not fp8_aligned(2048, 8200) and not fp8_aligned(2048.5)


def test_fp8_decode_is_priced_faster_only_where_the_gpu_has_fp8_matmuls() -> None:
    """On hardware without FP8 matmuls (HardwareSpec.fp8_matmul false: the CPU's emulation) the
    decode is priced as bf16; the copies' memory is still held."""
    problem = _problem()
    gen = problem.graph.mfc("actor_gen")
    rounds = CallExecution(gen_rounds=1)
    no_fp8 = replace(problem, cluster=replace(problem.cluster, hardware=replace(H200, fp8_matmul=False)))
    bf16, fp8 = (call_cost(no_fp8, replace(gen, fp8_decode=f), ONE_GPU, execution=rounds) for f in (False, True))
    assert fp8.breakdown["decode_s"] == pytest.approx(bf16.breakdown["decode_s"])
    assert fp8.breakdown["fp8_weights_bytes"] > 0
    assert H200.fp8_matmul and hardware_preset("h100-80g").fp8_matmul
    assert not hardware_preset("a100-80g").fp8_matmul and not hardware_preset("cpu").fp8_matmul


def test_an_fp8_cache_without_e4m3_hardware_is_priced_as_the_widening_it_costs() -> None:
    """Below compute capability 8.9 the worker reads an e4m3 cache through SDPA on a widened copy
    (5 bytes moved per value against 2 for bf16): slower decode, half the cache's memory."""
    problem = _problem()
    gen = problem.graph.mfc("actor_gen")
    rounds = CallExecution(gen_rounds=1)
    no_e4m3 = replace(problem, cluster=replace(problem.cluster, hardware=replace(H200, fp8_matmul=False)))
    bf16, fp8 = (call_cost(no_e4m3, replace(gen, fp8_kv_cache=f), ONE_GPU, execution=rounds).breakdown
                 for f in (False, True))
    assert fp8["decode_s"] > bf16["decode_s"]
    assert fp8["kv_cache_bytes"] == pytest.approx(bf16["kv_cache_bytes"] / 2)
    assert kv_read_bytes(True, H200) == E4M3_TRITON_READ_BYTES <= 2.0 < kv_read_bytes(True, no_e4m3.cluster.hardware)
    assert kv_read_bytes(True, no_e4m3.cluster.hardware) == E4M3_WIDENED_READ_BYTES
