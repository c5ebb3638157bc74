"""Unit tests of the cost model's memory terms against the tensors the runtime keeps alive.

The counts are the ones the GPU fidelity sweep (docs/benchmarks.md, issue 12) checks against
measured peaks; here they are pinned by hand-counted examples so a change to the engine's
tensors and a change to the model cannot drift apart silently.
"""

from __future__ import annotations

import pytest

from planning.algorithm_graphs import outcome_graph
from planning.cost import PlanningProblem, call_cost, rlhf_problem
from planning.cost_terms import (
    ENTROPY_LOGIT_BYTES,
    SAMPLING_BYTES_PER_LOGIT,
    TRAIN_LOGIT_BYTES,
    activation_bytes_per_token_layer,
    forward_tokens,
    inference_bytes_per_token_layer,
)
from planning.dataflow import BatchShape, with_entropy_bonus
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import CallExecution, Placement

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))
LLAMA_1B = model_preset("llama3.2-1b")  # h 2048, intermediate 8192, 32 q heads, 8 kv heads of 64


COMPACT = 1 - 128 * (1 - 1 / 8) / 640  # the share of _grpo()'s row tokens a shared-prompt forward runs


def _grpo(prompt_len: int = 128, gen_len: int = 512) -> PlanningProblem:
    graph = outcome_graph("grpo", BatchShape(64, prompt_len, gen_len), 8)
    return rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), LLAMA_1B)


def _activation(problem: PlanningProblem, call: str, execution: CallExecution) -> float:
    cost = call_cost(problem, problem.graph.mfc(call), ONE_GPU, execution=execution)
    return cost.breakdown["activation_bytes"]


def test_stored_activations_per_token_and_block_hand_counted() -> None:
    # Two RMSNorms: float32 input + bf16 normalised + bf16 output, 8 h bytes each.
    norms = 2 * 8 * 2048
    # bf16: q and attention output (2 x 2048), K and V expanded to the 32 query heads (2 x 2048),
    # gate, up, SiLU output, product (4 x 8192).
    split = 2 * (2 * 2048 + 2 * 2048 + 4 * 8192)
    assert activation_bytes_per_token_layer(LLAMA_1B, 1) == norms + split == 114_688
    # Under tp=2 only the split part halves.
    assert activation_bytes_per_token_layer(LLAMA_1B, 2) == norms + split / 2
    # Fused (CUDA): a norm keeps its bf16 input and output (4 h bytes); the gate saves gate and up,
    # the down projection its input (3 x 8192).
    fused_norms, fused_split = 2 * 4 * 2048, 2 * (2 * 2048 + 2 * 2048 + 3 * 8192)
    assert activation_bytes_per_token_layer(LLAMA_1B, 1, fused=True) == fused_norms + fused_split == 81_920
    assert activation_bytes_per_token_layer(LLAMA_1B, 2, fused=True) == fused_norms + fused_split / 2


def test_inference_working_set_is_one_block_or_the_head_whichever_is_larger() -> None:
    # The MLP's gate activation, up projection and product (3 x 8192) beat attention's tensors.
    assert inference_bytes_per_token_layer(LLAMA_1B, 1) == 2 * (4 * 2048 + 3 * 8192)
    problem = _grpo()
    tokens = 16384
    execution = CallExecution(micro_batch_tokens=tokens)
    # The reference's peak is at its head: bf16 logits read in place by the fused logprob kernel
    # (not float32), beside the final hidden states and their norm. Its micro-batches hold each
    # prompt of 8 rows once (planning.cost_terms.forward_tokens): 1 - 128 * 7/8 / 640 of the tokens.
    head = tokens * COMPACT * (LLAMA_1B.vocab_size * 2 + 2 * 2048 * 2)
    assert _activation(problem, "ref_inf", execution) == pytest.approx(head)
    # The reward model's head is one column: a block's working set is its peak.
    block = tokens * COMPACT * inference_bytes_per_token_layer(LLAMA_1B, 1)
    assert _activation(problem, "rew_inf", execution) == pytest.approx(block)


def test_generation_keeps_the_last_tokens_logits_only() -> None:
    rounds = CallExecution(gen_rounds=1)
    short, long = _grpo(prompt_len=128), _grpo(prompt_len=512)
    rows = 64 * 8
    # Prefill of 64 distinct prompts for 512 rows in one packed pass: a block's working set over
    # the distinct prompt tokens plus one layer's K/V copied to every row, or sampling's
    # [rows, vocab] buffers; never [prompt tokens, vocab] logits.
    kv_per_token = 2 * LLAMA_1B.n_kv_heads * LLAMA_1B.head_dim * 2
    for problem, prompt_len in ((short, 128), (long, 512)):
        prefill = 64 * prompt_len * inference_bytes_per_token_layer(LLAMA_1B, 1) + rows * prompt_len * kv_per_token
        sampling = rows * LLAMA_1B.vocab_size * SAMPLING_BYTES_PER_LOGIT
        assert _activation(problem, "actor_gen", rounds) == pytest.approx(max(prefill, sampling))
    # Two rounds halve the prefill's working set along with the KV cache.
    one = call_cost(long, long.graph.mfc("actor_gen"), ONE_GPU, execution=rounds).breakdown
    two = call_cost(long, long.graph.mfc("actor_gen"), ONE_GPU, execution=CallExecution(gen_rounds=2)).breakdown
    assert two["kv_cache_bytes"] == pytest.approx(one["kv_cache_bytes"] / 2)
    assert two["activation_bytes"] < one["activation_bytes"]


def test_training_logits_and_the_entropy_bonus() -> None:
    problem = _grpo()
    tokens = 8192
    execution = CallExecution(micro_batch_tokens=tokens)
    # The h200 preset's engine fuses the elementwise ops (HardwareSpec.fused_elementwise).
    assert problem.cluster.hardware.fused_elementwise
    stored = tokens * COMPACT * activation_bytes_per_token_layer(LLAMA_1B, 1, fused=True) * LLAMA_1B.n_layers
    logits = tokens * COMPACT * LLAMA_1B.vocab_size
    assert _activation(problem, "actor_train", execution) == pytest.approx(stored + logits * TRAIN_LOGIT_BYTES)
    entropy = with_entropy_bonus(problem.graph)
    assert [m.name for m in entropy.mfcs if m.with_entropy] == ["actor_train"]
    bonus = rlhf_problem(entropy, problem.cluster, LLAMA_1B)
    assert _activation(bonus, "actor_train", execution) == pytest.approx(
        stored + logits * (TRAIN_LOGIT_BYTES + ENTROPY_LOGIT_BYTES))


def test_shared_prompts_remove_tokens_not_the_answers_attention() -> None:
    shape = BatchShape(512, 128, 512, prompt_group=8)
    tokens, ctx = forward_tokens(shape, 512, 1)
    assert tokens == 64 * 128 + 512 * 512  # each prompt once, every answer token
    # Prompt tokens attend 64 keys on average, answer tokens their prompt and half their answer.
    assert ctx == pytest.approx((64 * 128 * 64 + 512 * 512 * (128 + 256)) / tokens)
    assert forward_tokens(BatchShape(512, 128, 512), 512, 1) == (512 * 640, 320)
    # Four shuffled minibatches: a prompt of 8 rows is in a given one with probability 1 - (3/4)^8.
    distinct = 128 * 4 / 8 * (1 - 0.75**8)
    assert forward_tokens(shape, 128, 4)[0] == pytest.approx(distinct * 128 + 128 * 512)
