"""The decode loop's stop check read one step late (actors.generation.loop.FinishedFlag), the
seconds of a call's phases (PhaseClock, GenerationOutput.stats) and the worker's move of a
call's output to the host (actors.worker.execution.rows_on_host). CPU, float32, tiny models;
the CUDA path of the flag (page-locked copy behind an event) in the gpu tier."""

from __future__ import annotations

import pickle

import pytest
import torch

from actors.engine.model import Transformer
from actors.generation.decoding import GenerationConfig
from actors.generation.loop import FinishedFlag, generate
from actors.generation.sampling import SamplingParams
from actors.worker.execution import generate_in_rounds, rows_on_host
from planning.models import ModelSpec

torch.set_num_threads(1)

SPEC = ModelSpec(name="loop-phases", family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=128)
PHASES = {"prefill_s", "decode_s", "capture_s", "sync_wait_s", "decode_steps"}


def tiny_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
               spec: ModelSpec = SPEC) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(spec, device="meta")
    model.to_empty(device=device)
    for param in model.parameters():
        torch.nn.init.normal_(param, 0.0, 0.3)
    return model.to(dtype).eval()


def always_emits_token_0(model: Transformer) -> Transformer:
    """A zero LM head: every logit is 0, and greedy takes the first maximum, token 0."""
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def prompts(lengths: list[int], device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, SPEC.vocab_size, (n,), generator=gen).to(device) for n in lengths]


@pytest.mark.unit
def test_stop_check_ends_the_loop_one_step_after_every_sequence_finished() -> None:
    """Every sequence emits the stop token at its first step: one decode step is queued before
    the host reads the flag (and discarded); the output equals a run that never stops early,
    cut at the stop token."""
    model = always_emits_token_0(tiny_model())
    greedy = SamplingParams(temperature=0.0)
    stopped = generate(model, prompts([4, 7, 2]), GenerationConfig(12, greedy, eos_token_id=0, pad_token_id=5))
    assert stopped.response_lengths.tolist() == [1, 1, 1] and not bool(stopped.no_eos.any())
    assert stopped.stats["decode_steps"] == 1.0
    full = generate(model, prompts([4, 7, 2]), GenerationConfig(12, greedy, eos_token_id=0, ignore_eos=True))
    assert full.stats["decode_steps"] == 11.0 and full.response_lengths.tolist() == [12] * 3
    assert all(r.tolist() == [0] for r in stopped.responses())


@pytest.mark.unit
def test_sequences_finishing_at_different_steps_match_a_run_without_stop_checks() -> None:
    """Rows that stop at different steps: the late flag changes neither tokens nor logprobs."""
    model = tiny_model(seed=2)
    params = SamplingParams(temperature=1.0)
    batch = prompts([3, 5, 8, 2, 6])
    free = generate(model, batch, GenerationConfig(16, params, seed=4))
    stop = int(free.responses()[1][3])  # row 1 stops at step 3 (others where they sample it)
    stopped = generate(model, batch, GenerationConfig(16, params, seed=4, eos_token_id=stop))
    for row, (a, b) in enumerate(zip(stopped.responses(), free.responses())):
        cut = b.tolist().index(stop) + 1 if stop in b.tolist() else len(b)
        assert a.tolist() == b.tolist()[:cut], row
    assert torch.equal(stopped.response_lengths, torch.tensor([len(r) for r in stopped.responses()]))
    per_row = torch.split(free.logprobs, free.response_lengths.tolist())
    for a, b in zip(torch.split(stopped.logprobs, stopped.response_lengths.tolist()), per_row):
        assert torch.equal(a, b[:len(a)])
    assert stopped.stats["decode_steps"] <= free.stats["decode_steps"]


@pytest.mark.unit
def test_phase_seconds_are_reported_and_add_up_over_rounds() -> None:
    model = tiny_model()
    config = GenerationConfig(6, SamplingParams(temperature=1.0), seed=1, eos_token_id=63)
    out = generate(model, prompts([4, 4]), config)
    assert PHASES <= set(out.stats) and all(v >= 0.0 for v in out.stats.values())
    assert out.stats["prefill_s"] > 0.0 and out.stats["decode_s"] >= out.stats["capture_s"]
    rounds = generate_in_rounds(model, None, prompts([4, 4, 5, 3]), [range(0, 2), range(2, 4)],
                                lambda part: GenerationConfig(6, SamplingParams(temperature=0.0), eos_token_id=None))
    assert rounds.seconds["decode_steps"] == 10.0  # 5 per round, added up
    assert rounds.seconds["to_host_s"] > 0.0 and PHASES <= set(rounds.seconds)


@pytest.mark.unit
def test_rows_on_host_equal_the_output_rows_and_pickle_alone() -> None:
    model = tiny_model(seed=1)
    out = generate(model, prompts([3, 9, 1, 5]), GenerationConfig(7, SamplingParams(temperature=1.0), seed=3,
                                                                  eos_token_id=11))
    responses, logprobs, lengths, no_eos = rows_on_host(out)
    assert [r.tolist() for r in responses] == [r.tolist() for r in out.responses()]
    assert all(torch.equal(a, b) for a, b in zip(logprobs, out.response_logprobs()))
    assert lengths == out.response_lengths.tolist() and no_eos == out.no_eos.tolist()
    whole = len(pickle.dumps(out.tokens))
    for row in responses:  # a row's pickle carries its own elements, not the call's whole storage
        assert row.untyped_storage().nbytes() == row.numel() * row.element_size()
        assert len(pickle.dumps(row)) < whole


@pytest.mark.unit
def test_finished_flag_on_cpu_reads_the_snapshot_not_later_changes() -> None:
    flag = FinishedFlag(torch.device("cpu"))
    finished = torch.tensor([True, False])
    flag.snapshot(finished)
    finished[1] = True  # after the snapshot: not seen
    assert flag.all_set() is False
    flag.snapshot(finished)
    assert flag.all_set() is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_loop_with_late_stop_check_equals_eager() -> None:
    """On CUDA (graph, page-locked flag): the same tokens as the eager loop, with sequences
    finishing at different steps, and the loop ends early once all have finished."""
    model = tiny_model(seed=3, device="cuda", dtype=torch.bfloat16)
    batch = prompts([3, 5, 8, 2, 6], device="cuda")
    greedy = SamplingParams(temperature=0.0)
    free = generate(model, batch, GenerationConfig(24, greedy))
    stop = int(free.responses()[0][2])
    eager = generate(model, batch, GenerationConfig(24, greedy, eos_token_id=stop))
    graph = generate(model, batch, GenerationConfig(24, greedy, eos_token_id=stop, use_cuda_graph=True))
    assert [r.tolist() for r in graph.responses()] == [r.tolist() for r in eager.responses()]
    assert graph.stats["decode_steps"] == eager.stats["decode_steps"]
    if all(stop in r.tolist() for r in free.responses()):
        assert graph.stats["decode_steps"] < 23
    assert graph.stats["decode_s"] > 0.0 and graph.stats["capture_s"] > 0.0

