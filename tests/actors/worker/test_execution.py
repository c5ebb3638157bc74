"""A call run as the plan says, on one serial worker: generation in rounds samples what one round
samples, inference with a token budget gives the one-micro-batch logprobs and values, the
defaults without a plan, each call's peak memory from the worker's probe (None on CPU), and the
garbage collections and compiles during it."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest
import torch

from actors.worker.calls import CallSpec
from actors.worker.execution import generation_rounds, plan_micro_batching
from actors.worker.memory import MemoryPeak, NoMemoryProbe, memory_probe_for
from actors.worker.model_worker import ModelWorker
from planning.call_levels import MAX_MICRO_TOKENS
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import CallExecution, Placement

pytestmark = pytest.mark.unit

SPEC = ModelSpec("exec", "llama", vocab_size=256, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
CRITIC = ModelSpec("exec-critic", "llama", vocab_size=256, hidden_size=32, intermediate_size=64, n_layers=2,
                   n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=128)
ONE = Placement(Mesh(0, 1, 1), Layout())
N = 6


class CountingProbe:
    """Reports a peak that grows with every reset, so each call's reading is its own."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def peak(self) -> MemoryPeak:
        return MemoryPeak(1000 * self.resets, 2000 * self.resets)


def _worker() -> ModelWorker:
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("actor", SPEC, False, ONE, None, 0, True, {"lr": 1e-2})
    worker.load_model("critic", CRITIC, True, ONE, None, 1, True, {"lr": 1e-2})
    return worker


def _prompts() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    return {"row_start": 0, "n": N, "prompt_ids": [torch.randint(3, 256, (3 + i,), generator=gen) for i in range(N)]}


def _generate(worker: ModelWorker, execution: CallExecution | None, **extra: Any) -> tuple[dict, dict]:
    params = {"op": "generate", "max_new_tokens": 5, "seed": 3, "temperature": 1.0, "ignore_eos": False, **extra}
    return worker.run_call(CallSpec("actor_gen", "actor", "generate", ONE, 0, N, params, execution), _prompts())


def test_rounds_and_budgets_from_the_plan() -> None:
    assert generation_rounds(CallExecution(gen_rounds=3), 7) == [range(2), range(2, 4), range(4, 7)]
    assert generation_rounds(None, 5) == [range(5)]
    assert generation_rounds(CallExecution(gen_rounds=9), 2) == [range(1), range(1, 2)]
    assert plan_micro_batching(CallExecution(micro_batch_tokens=100), None, pp=2).tokens == 100
    assert plan_micro_batching(CallExecution(micro_batch_tokens=100), None, pp=2).n_micro == 1
    unplanned = plan_micro_batching(None, None, pp=2)  # a one-off job: the cost model's cap, >= pp
    assert (unplanned.n_micro, unplanned.tokens) == (2, MAX_MICRO_TOKENS)
    assert plan_micro_batching(None, 3, pp=1).n_micro == 3
    with pytest.raises(ValueError, match="takes gen_rounds"):
        CallSpec("actor_gen", "actor", "generate", ONE, 0, N, {}, CallExecution(micro_batch_tokens=8))


def test_generation_in_rounds_samples_what_one_round_samples() -> None:
    worker = _worker()
    meta_one, one = _generate(worker, CallExecution(gen_rounds=1))
    meta_three, three = _generate(worker, CallExecution(gen_rounds=3))
    assert meta_one["gen_rounds"] == 1 and meta_three["gen_rounds"] == 3
    assert [t.tolist() for t in one["response_ids"]] == [t.tolist() for t in three["response_ids"]]
    for a, b in zip(one["logprobs"], three["logprobs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert one["no_eos"] == three["no_eos"]


@pytest.mark.parametrize("option", [{"fp8": True}, {"kv_cache_dtype": "fp8"}])
def test_generation_with_fp8_keeps_the_prefill_and_changes_the_decode(option: dict[str, Any]) -> None:
    """params["fp8"] / ["kv_cache_dtype"] (sampling.*) reach the generation: the first token of each
    response comes from the prefill (same draw, same logprob), later ones from FP8 decode steps."""
    worker = _worker()
    _, bf16 = _generate(worker, None)
    _, fp8 = _generate(worker, None, **option)
    assert [t[0].item() for t in fp8["response_ids"]] == [t[0].item() for t in bf16["response_ids"]]
    torch.testing.assert_close(torch.stack([lp[0] for lp in fp8["logprobs"]]),
                               torch.stack([lp[0] for lp in bf16["logprobs"]]), atol=1e-6, rtol=0)
    later = [(a[1:] - b[1:]).abs().max().item() for a, b, ta, tb in
             zip(fp8["logprobs"], bf16["logprobs"], fp8["response_ids"], bf16["response_ids"])
             if ta.numel() > 1 and tb.numel() > 1 and ta[1] == tb[1]]
    assert later and max(later) > 0  # the decode steps ran with other weights


def test_compact_fraction_reaches_the_generation() -> None:
    """params["compact_fraction"] (sampling.compact_fraction): with a 24-token vocabulary the stop
    token ends rows early, 0.75 drops them from the decode step (the meta counts it), 0 keeps
    them, and both sample the same responses."""
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("actor", dataclasses.replace(SPEC, name="exec-small-vocab", vocab_size=24), False, ONE,
                      None, 0, True, {"lr": 1e-2})
    gen = torch.Generator().manual_seed(4)
    prompts = {"row_start": 0, "n": N, "prompt_ids": [torch.randint(3, 24, (3 + i,), generator=gen) for i in range(N)]}
    runs = {}
    for fraction in (0.0, 0.75):
        params = {"op": "generate", "max_new_tokens": 100, "seed": 5, "eos_token_id": 1, "compact_fraction": fraction}
        runs[fraction] = worker.run_call(CallSpec("actor_gen", "actor", "generate", ONE, 0, N, params), prompts)
    (kept_meta, kept), (compacted_meta, compacted) = runs[0.0], runs[0.75]
    assert kept_meta["gen/compactions"] == 0 and compacted_meta["gen/compactions"] >= 1
    assert [t.tolist() for t in compacted["response_ids"]] == [t.tolist() for t in kept["response_ids"]]


def test_inference_with_a_token_budget_matches_one_micro_batch() -> None:
    worker = _worker()
    _, gen = _generate(worker, None)
    outputs = {}
    for budget in (10_000, 9):  # one micro-batch; a few tokens each (whole sequences, so ~one per sequence)
        execution = CallExecution(micro_batch_tokens=budget)
        _, ref = worker.run_call(CallSpec("ref_inf", "actor", "inference", ONE, 0, N, {"op": "logprobs"}, execution),
                                 gen)
        _, values = worker.run_call(CallSpec("critic_inf", "critic", "inference", ONE, 0, N, {}, execution), gen)
        outputs[budget] = (ref["ref_logprobs"], values["values"])
    (whole_lp, whole_v), (split_lp, split_v) = outputs[10_000], outputs[9]
    for x, y in zip(whole_lp + whole_v, split_lp + split_v):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_each_call_reports_its_peak_memory() -> None:
    worker = _worker()
    assert isinstance(memory_probe_for(torch.device("cpu")), NoMemoryProbe)
    meta, _ = _generate(worker, None)
    assert meta["peak_allocated_bytes"] is None and meta["peak_reserved_bytes"] is None  # CPU: unknown
    worker.memory_probe = CountingProbe()
    first, _ = _generate(worker, None)
    second, _ = _generate(worker, None)
    assert (first["peak_allocated_bytes"], first["peak_reserved_bytes"]) == (1000, 2000)
    assert second["peak_allocated_bytes"] == 2000  # reset before each call


def test_each_call_reports_what_stalled_its_host() -> None:
    worker = _worker()
    try:
        meta, _ = _generate(worker, None)
        assert meta["gc_s"] >= 0.0 and meta["gc_full"] >= 0 and meta["gc_before_s"] is None  # the first call
        gc.collect()  # between calls: the next call's gc_before_s
        second, _ = _generate(worker, None)
        assert second["gc_before_s"] > 0.0
        assert meta["compiles"] == 0 and meta["compile_s"] == 0.0  # the CPU path compiles nothing
        before = worker.host_pauses.reading()
        gc.collect()  # a collection during a call is counted in its gc_s: the clock sees every one
        assert worker.host_pauses.reading().since(before).gc_full == 1
    finally:
        worker.host_pauses.uninstall()
    callbacks = len(gc.callbacks)
    short_lived = ModelWorker(0, 1, "cpu")
    assert len(gc.callbacks) == callbacks + 1
    del short_lived
    gc.collect()
    assert len(gc.callbacks) == callbacks  # a worker's clock leaves with it
