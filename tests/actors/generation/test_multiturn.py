"""Single-process tests of actors.generation.multiturn: a paused trajectory's cache, extended by its
observation ids, gives the logprobs a fresh prefill of the whole conversation gives; ids are the
sampled ids plus the observation ids, masked; paused rows do not disturb the others; budgets end
trajectories. CPU, float32, tiny random Qwen2-shaped models."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from actors.engine.packing import pack_sequences
from actors.generation.decoding import GenerationConfig
from actors.generation.loop import generate
from actors.generation.multiturn import TurnsOutput, generate_turns
from actors.generation.sampling import SamplingParams
from actors.generation.turns import TurnResult
from tests.actors.generation.test_generate import BASE, build_hf, ours_from_hf, random_prompts

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

EOS = 7


class ScriptedTurns:
    """A TurnSource answering each row's turn t with fixed observation ids after `delay_s[row]`
    seconds on a thread (so rows resume at different times), ending at `turns[row]` turns."""

    def __init__(self, prompts: list[torch.Tensor], turns: list[int], delay_s: list[float] | None = None,
                 observation: tuple[int, ...] = (11, 12, 13)) -> None:
        self._prompts, self.turns = prompts, turns
        self.delay_s = delay_s or [0.0] * len(prompts)
        self.observation = observation
        self.actions: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
        self._ready: list[TurnResult] = []
        self._lock = threading.Lock()
        self._pending = 0

    def prompts(self) -> list[list[int]]:
        return [p.tolist() for p in self._prompts]

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        self.actions[row].append(list(action_ids))
        done = last or len(self.actions[row]) >= self.turns[row]
        obs = tuple(t + row for t in self.observation)  # distinct per row
        self._pending += 1

        def answer() -> None:
            time.sleep(self.delay_s[row])
            with self._lock:
                self._ready.append(TurnResult(row, () if done else obs, done))

        threading.Thread(target=answer, daemon=True).start()

    def poll(self, wait_s: float) -> list[TurnResult]:
        deadline = time.perf_counter() + wait_s
        while True:
            with self._lock:
                out, self._ready = self._ready, []
            if out or time.perf_counter() >= deadline:
                self._pending -= len(out)
                return out
            time.sleep(0.001)

    def pending(self) -> int:
        return self._pending


def full_logprobs(model: torch.nn.Module, out: TurnsOutput, temperature: float = 1.0) -> list[torch.Tensor]:
    """Logprobs of every response id under one fresh forward of prompt + response (no cache)."""
    seqs = [torch.cat([p, r]) for p, r in zip(out.prompts, out.responses)]
    tokens, batch = pack_sequences(seqs, next(model.parameters()).device)
    with torch.no_grad():
        logits = model(tokens, batch).float() / temperature  # [T, V]
    logp = torch.log_softmax(logits, dim=-1).cpu()
    tokens = tokens.cpu()
    result, start = [], 0
    for p, r in zip(out.prompts, out.responses):
        rows = torch.arange(start + p.numel() - 1, start + p.numel() + r.numel() - 1)
        result.append(logp[rows, tokens[rows + 1]])
        start += p.numel() + r.numel()
    return result


@pytest.mark.parametrize("delays", [[0.0, 0.0, 0.0, 0.0], [0.0, 0.05, 0.01, 0.08]])
def test_resumed_cache_equals_fresh_prefill(delays: list[float]) -> None:
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6], seed=5)
    source = ScriptedTurns(prompts, turns=[3, 2, 3, 1], delay_s=delays)
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS)
    out = generate_turns(model, prompts, config, budget=40, source=source)
    fresh = full_logprobs(model, out)
    for i in range(len(prompts)):
        mask = out.response_masks[i].bool()
        assert out.responses[i].numel() == out.response_masks[i].numel() == out.logprobs[i].numel()
        # Sampled positions: the loop's sampling logprobs equal the fresh forward's.
        assert torch.allclose(out.logprobs[i][mask], fresh[i][mask], atol=1e-5)
        assert torch.all(out.logprobs[i][~mask] == 0)
    # Token in, token out: the responses are each turn's sampled ids, then that row's observation.
    for row, actions in source.actions.items():
        expected: list[int] = []
        for t, action in enumerate(actions):
            expected += action
            if t + 1 < len(actions):
                expected += [x + row for x in source.observation]
        assert out.responses[row].tolist() == expected
        assert out.turns[row] == len(actions) == source.turns[row]


def test_samples_do_not_depend_on_when_the_environment_answers() -> None:
    """Each row's j-th sampled token uses the j-th draw of its row, whatever the answer timing."""
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6], seed=5)
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS)
    at_once = generate_turns(model, prompts, config, 40, ScriptedTurns(prompts, turns=[3, 2, 3, 1]))
    staggered = generate_turns(model, prompts, config, 40,
                               ScriptedTurns(prompts, turns=[3, 2, 3, 1], delay_s=[0.03, 0.0, 0.06, 0.01]))
    assert [r.tolist() for r in at_once.responses] == [r.tolist() for r in staggered.responses]
    for a, b in zip(at_once.logprobs, staggered.logprobs):
        assert torch.allclose(a, b, atol=1e-5)


def test_one_turn_equals_single_turn_generation() -> None:
    """With one turn the loop samples what `generate` samples (same seeds, same steps)."""
    model = ours_from_hf(build_hf("Qwen2", seed=2))
    prompts = random_prompts(BASE["vocab_size"], [4, 7, 3], seed=9)
    config = GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=1.0), seed=5, eos_token_id=EOS)
    single = generate(model, prompts, config)
    multi = generate_turns(model, prompts, config, budget=6, source=ScriptedTurns(prompts, turns=[1, 1, 1]))
    for i, response in enumerate(single.responses()):
        assert multi.responses[i].tolist() == response.tolist()
    assert torch.allclose(torch.cat(multi.logprobs), single.logprobs, atol=1e-6)


@pytest.mark.parametrize("options", [{"fp8_weights": True}, {"fp8_weights": True, "kv_cache_dtype": "fp8"}])
def test_fp8_turns_equal_single_turn_fp8_and_stay_close_to_full_precision(options: dict) -> None:
    """FP8 decode weights (and cache) in the turn loop: one turn samples what `generate` samples
    with the same settings; over three turns, with observation prefills between decode steps,
    the sampled logprobs stay within FP8's few percent of a logit of a fresh bf16 forward."""
    model = ours_from_hf(build_hf("Qwen2", seed=2))
    prompts = random_prompts(BASE["vocab_size"], [4, 7, 3], seed=9)
    config = GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=1.0), seed=5, eos_token_id=EOS,
                              **options)
    single = generate(model, prompts, config)
    multi = generate_turns(model, prompts, config, budget=6, source=ScriptedTurns(prompts, turns=[1, 1, 1]))
    assert [r.tolist() for r in multi.responses] == [r.tolist() for r in single.responses()]
    assert torch.allclose(torch.cat(multi.logprobs), single.logprobs, atol=1e-6)
    turns = generate_turns(model, prompts, config, budget=40, source=ScriptedTurns(prompts, turns=[3, 2, 3]))
    assert turns.turns == [3, 2, 3]
    gaps = torch.cat([(lp - fresh)[mask.bool()].abs() for lp, fresh, mask in
                      zip(turns.logprobs, full_logprobs(model, turns), turns.response_masks)])
    # The bounds of the GPU test (test_fp8_weights.py): an e4m3 cache's error grows with the
    # trajectory; a cache extended wrongly would be off by whole logits.
    assert 0 < gaps.max() < 0.6 and gaps.mean() < 0.15, gaps


@pytest.mark.parametrize("delays", [None, [0.0, 0.02, 0.0, 0.04, 0.01, 0.0, 0.03, 0.0]], ids=["at-once", "staggered"])
def test_finished_trajectories_leave_the_step_and_change_nothing(delays: list[float] | None) -> None:
    """Trajectories ending after 1 to 6 turns: the step drops the finished ones (while others
    wait for their environment) and every trajectory's ids, masks, logprobs and turns are those
    of the call that keeps every row; the resumed caches still equal a fresh forward."""
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6, 3, 7, 2, 4], seed=5)
    turns = [1, 5, 2, 6, 1, 3, 6, 2]
    runs = {}
    for fraction in (0.0, 0.75):
        config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3,
                                  eos_token_id=EOS, compact_fraction=fraction)
        runs[fraction] = generate_turns(model, prompts, config, 60, ScriptedTurns(prompts, turns, delay_s=delays))
    kept, compacted = runs[0.0], runs[0.75]
    assert kept.stats["compactions"] == 0 and compacted.stats["compactions"] >= 2
    assert compacted.turns == kept.turns == turns
    assert [r.tolist() for r in compacted.responses] == [r.tolist() for r in kept.responses]
    assert [m.tolist() for m in compacted.response_masks] == [m.tolist() for m in kept.response_masks]
    for a, b, fresh, mask in zip(compacted.logprobs, kept.logprobs, full_logprobs(model, compacted),
                                 compacted.response_masks):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a[mask.bool()], fresh[mask.bool()], atol=1e-5, rtol=0)


def test_compiled_turns_compile_once_for_every_row_count() -> None:
    """torch.compile (inductor on CPU): trajectories that end drop out of the step, and the
    smaller steps reuse the first compile (the row count symbolic from the start,
    GenerationConfig.compile_dynamic_rows), sampling what the eager steps sample."""
    from torch._dynamo.utils import counters

    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6, 3, 7, 2, 4], seed=5)
    turns = [1, 5, 2, 6, 1, 3, 6, 2]
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS)
    eager = generate_turns(model, prompts, config, 60, ScriptedTurns(prompts, turns))
    torch._dynamo.reset()
    counters.clear()
    compiled = generate_turns(model, prompts, dataclasses.replace(config, compile_decode=True), 60,
                              ScriptedTurns(prompts, turns))
    assert compiled.stats["compactions"] >= 2
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [r.tolist() for r in compiled.responses] == [r.tolist() for r in eager.responses]
    for a, b in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("read_lag", [1, 4])
def test_reading_steps_later_changes_nothing(read_lag: int) -> None:
    """The host reading each step's ids up to `read_lag` steps after queueing it (the device
    pausing rows itself) samples what reading every step at once samples: same ids, masks,
    logprobs, turns, stop flags, with environments answering at different times, turns ending
    at EOS and at max_new_tokens, budgets ending trajectories and finished rows dropped."""
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6, 3, 7], seed=5)
    turns = [1, 4, 2, 5, 1, 3]
    config = GenerationConfig(max_new_tokens=5, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS)
    delays = [0.0, 0.02, 0.0, 0.03, 0.01, 0.0]
    runs = [generate_turns(model, prompts, config, 30, ScriptedTurns(prompts, turns, delay_s=delays), read_lag=lag)
            for lag in (0, read_lag)]
    now, later = runs
    assert later.stats["compactions"] >= 1
    assert any(now.length_cut) and not all(now.no_eos)  # both endings are exercised
    assert [r.tolist() for r in later.responses] == [r.tolist() for r in now.responses]
    assert [m.tolist() for m in later.response_masks] == [m.tolist() for m in now.response_masks]
    assert (later.turns, later.no_eos, later.length_cut) == (now.turns, now.no_eos, now.length_cut)
    for a, b, fresh, mask in zip(later.logprobs, now.logprobs, full_logprobs(model, later), later.response_masks):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(a[mask.bool()], fresh[mask.bool()], atol=1e-5, rtol=0)


class CountedTurns(ScriptedTurns):
    """Answers row r's turn after (r % 5) * 3 polls, one answer per poll at most: no threads, so
    the loop sees answers trickle in while other rows decode, the same way on every run."""

    def __init__(self, prompts: list[torch.Tensor], turns: list[int]) -> None:
        super().__init__(prompts, turns)
        self.queue: list[tuple[int, TurnResult]] = []  # (polls left, answer)

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        self.actions[row].append(list(action_ids))
        done = last or len(self.actions[row]) >= self.turns[row]
        obs = tuple(t + row for t in self.observation)  # as ScriptedTurns answers
        self.queue.append(((row % 5) * 3, TurnResult(row, () if done else obs, done)))

    def poll(self, wait_s: float) -> list[TurnResult]:
        self.queue = [(left - 1, result) for left, result in self.queue]
        ready = next((i for i, (left, _) in enumerate(self.queue) if left <= 0), None)
        return [self.queue.pop(ready)[1]] if ready is not None else []


def test_observations_arriving_one_by_one_are_prefilled_together() -> None:
    """Answers that trickle in while other rows decode wait for one observation prefill together
    (at most RESUME_AFTER_STEPS steps): fewer prefills than resumed turns, and the same ids as
    answering every row at once."""
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], [3 + i % 4 for i in range(32)], seed=5)
    turns = [3] * 32
    config = GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=None)
    trickled = generate_turns(model, prompts, config, 40, CountedTurns(prompts, turns))
    at_once = generate_turns(model, prompts, config, 40, ScriptedTurns(prompts, turns))
    assert trickled.turns == turns
    assert trickled.stats["extensions"] < sum(t - 1 for t in turns) / 2, trickled.stats
    assert [r.tolist() for r in trickled.responses] == [r.tolist() for r in at_once.responses]
    for a, b in zip(trickled.logprobs, at_once.logprobs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_negative_read_lag_is_refused() -> None:
    model = ours_from_hf(build_hf("Qwen2", seed=3))
    prompts = random_prompts(BASE["vocab_size"], [3], seed=1)
    with pytest.raises(ValueError, match="read_lag=-1"):
        generate_turns(model, prompts, GenerationConfig(max_new_tokens=2), budget=8,
                       source=ScriptedTurns(prompts, turns=[1]), read_lag=-1)


def test_budget_ends_trajectories_and_observations_that_do_not_fit() -> None:
    model = ours_from_hf(build_hf("Qwen2", seed=3))
    prompts = random_prompts(BASE["vocab_size"], [3, 3], seed=1)
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=1, eos_token_id=None)
    out = generate_turns(model, prompts, config, budget=9, source=ScriptedTurns(prompts, turns=[10, 10]))
    for i in range(2):
        # 4 sampled + 3 observed = 7, then 3 more observed ids would leave no room: the row ends.
        assert out.responses[i].numel() <= 9
        assert out.length_cut[i]
        assert out.no_eos[i]


def test_pipeline_layout_is_refused() -> None:
    from actors.engine.process_groups import ParallelGroups
    from planning.layout import Layout

    model = ours_from_hf(build_hf("Qwen2", seed=3))
    groups = ParallelGroups(Layout(1, 1, 2), 0, 0, 0, None, None, None, None, None, (0, 1), (0,))
    with pytest.raises(ValueError, match="pp=1"):
        generate_turns(model, random_prompts(BASE["vocab_size"], [3], seed=1), GenerationConfig(max_new_tokens=2),
                       budget=8, source=ScriptedTurns([], turns=[]), groups=groups)


@pytest.mark.gpu
def test_cuda_graph_decode_and_varlen_prefill_equal_a_fresh_forward() -> None:
    """On CUDA: CUDA-graph decode steps with the Triton decode attention (head_dim 32), paused rows
    (step_increment 0), observation prefills through the varlen kernel (bf16) and finished rows
    dropped from the step, against one fresh forward of each whole conversation."""
    device = torch.device("cuda")
    hf = build_hf("Llama", seed=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2)
    model = ours_from_hf(hf).to(device=device, dtype=torch.bfloat16)
    prompts = [p.to(device) for p in random_prompts(BASE["vocab_size"], [5, 9, 1, 6], seed=5)]
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS,
                              use_cuda_graph=True, compact_min_row_steps=0)  # tiny: compact anyway
    out = generate_turns(model, prompts, config, 40, ScriptedTurns(prompts, turns=[3, 2, 3, 1],
                                                                   delay_s=[0.02, 0.0, 0.05, 0.01]))
    fresh = full_logprobs(model, out)
    for i in range(len(prompts)):
        mask = out.response_masks[i].bool()
        assert torch.allclose(out.logprobs[i][mask], fresh[i][mask], atol=0.1)  # bf16
    assert sum(out.turns) == 9
    assert out.stats["compactions"] >= 1  # finished rows left the step: a new graph over the rest


@pytest.mark.gpu
def test_observation_prefill_reads_the_cache_in_place() -> None:
    """On CUDA (bf16): attention of new tokens over their rows of the head-major cache, read in
    place through a strided view (FlashAttention with seqused_k), equals attention over the same
    rows' history gathered token-major; rows out of order, GQA (4 query heads per KV head)."""
    from actors.engine.attention import attention_over_history
    from actors.generation.cache_extension import attend_rows_in_place

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    n_seqs, n_kv, max_len, head_dim, group = 6, 2, 96, 64, 4
    cache_k = torch.randn(n_seqs, n_kv, max_len, head_dim, device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    rows = torch.tensor([4, 1, 5], device=device)
    key_counts = torch.tensor([70, 33, 96], device=device)  # history + new tokens per row
    new = [5, 1, 12]
    cu_q = torch.tensor([0, 5, 6, 18], dtype=torch.int32, device=device)
    q = torch.randn(18, n_kv * group, head_dim, device=device, dtype=dtype)
    starts = torch.zeros(4, dtype=torch.int32, device=device)
    starts[:-1] = (rows * n_kv * max_len).to(torch.int32)
    starts[-1] = starts[-2] + key_counts[-1].to(torch.int32)
    out = attend_rows_in_place(q, cache_k, cache_v, cu_q, starts, key_counts.to(torch.int32), max(new), 96, None)
    assert out is not None, "this build's FlashAttention refused the in-place view"
    keys = torch.cat([cache_k[r, :, :n].transpose(0, 1) for r, n in zip(rows.tolist(), key_counts.tolist())])
    values = torch.cat([cache_v[r, :, :n].transpose(0, 1) for r, n in zip(rows.tolist(), key_counts.tolist())])
    cu_k = torch.zeros(4, dtype=torch.int32, device=device)
    cu_k[1:] = torch.cumsum(key_counts, 0).to(torch.int32)
    expected = attention_over_history(q, keys, values, cu_q, cu_k, max(new), 96)
    assert torch.allclose(out.float(), expected.float(), atol=2e-2)
