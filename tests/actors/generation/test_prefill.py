"""The prefill runs once per distinct prompt (actors.generation.prefill): rows sharing a prompt
tensor get the cache, logits and samples that separate prompts give, and the forward sees only
the distinct prompts' tokens. CPU, float32, tiny random models."""

from __future__ import annotations

import pytest
import torch

from actors.engine.packing import pack_sequences
from actors.generation.decoding import GenerationConfig
from actors.generation.kv_cache import HeadMajorKVCache
from actors.generation.loop import generate
from actors.generation.multiturn import generate_turns
from actors.generation.prefill import group_members, group_table, prefill, prompt_sources
from actors.generation.sampling import SamplingParams
from actors.worker.multiturn import shared_prompt_tensors
from tests.actors.generation.test_generate import BASE, build_hf, ours_from_hf, random_prompts
from tests.actors.generation.test_multiturn import EOS, ScriptedTurns

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def grouped(distinct: list[torch.Tensor], group: int) -> list[torch.Tensor]:
    """Each prompt repeated `group` times in a row, as one shared tensor (what a worker passes)."""
    return [p for p in distinct for _ in range(group)]


def test_prompt_sources_number_distinct_objects_in_order() -> None:
    a, b, c = torch.tensor([1]), torch.tensor([1]), torch.tensor([2])
    assert prompt_sources([a, a, b, c, b, a]) == [0, 0, 1, 2, 1, 0]  # equal values, separate objects: separate


def test_group_table_chunks_each_prompt_and_pads() -> None:
    members = group_members([0, 1, 0, 2, 0, 1, 0, 0])  # prompt 0 in five rows, 1 in two, 2 alone
    assert members == [[0, 2, 4, 6, 7], [1, 5], [3]]
    table = group_table(members, 3, torch.device("cpu"))  # chunks of <= 3 rows: every row in one
    assert table.tolist() == [[0, 2, 4], [6, 7, -1], [1, 5, -1], [3, -1, -1]]
    assert group_table([[0], [1]], 3, torch.device("cpu")) is None  # nothing shared
    assert group_table(members, 0, torch.device("cpu")) is None  # a tile too small for two rows: no sharing


def count_embedded_tokens(model: torch.nn.Module) -> list[int]:
    """Token counts of every forward from now on (a hook on the embedding)."""
    seen: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_shared_prefill_fills_the_cache_a_full_prefill_fills(family: str) -> None:
    model = ours_from_hf(build_hf(family))
    prompts = grouped(random_prompts(BASE["vocab_size"], [5, 9, 1]), 3)
    separate = [p.clone() for p in prompts]
    results = []
    for rows in (separate, prompts):
        tokens, batch = pack_sequences(rows)
        cache = HeadMajorKVCache.for_model(model, len(rows), batch.max_seqlen + 2)
        seen = count_embedded_tokens(model) if rows is prompts else []
        with torch.no_grad():
            logits = prefill(model, rows, tokens, batch, cache)
        results.append((logits, cache))
    assert seen == [15]  # 5 + 9 + 1 distinct tokens, not 45
    (full_logits, full), (shared_logits, shared) = results
    torch.testing.assert_close(shared_logits, full_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(shared.lengths, full.lengths) and shared.prefilled
    # Decode attention reads each group's prompt from its first row; unshared rows read their own.
    assert shared.prefix_rows.tolist() == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert shared.prefix_lengths.tolist() == [5, 5, 5, 9, 9, 9, 1, 1, 1]
    assert full.prefix_rows.tolist() == list(range(9)) and not full.prefix_lengths.any()
    # The groups' table for the prompt part computed once per group (cascade); none without sharing.
    assert shared.prefix_groups.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and full.prefix_groups is None
    for layer in full.k:
        torch.testing.assert_close(shared.k[layer], full.k[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(shared.v[layer], full.v[layer], rtol=1e-5, atol=1e-5)


def test_generation_from_shared_prompts_equals_separate_prompts() -> None:
    model = ours_from_hf(build_hf("Llama", seed=2))
    prompts = grouped(random_prompts(BASE["vocab_size"], [4, 7, 2, 6]), 4)
    config = GenerationConfig(8, SamplingParams(temperature=1.0, top_k=20), seed=9, eos_token_id=5)
    shared = generate(model, prompts, config)
    separate = generate(model, [p.clone() for p in prompts], config)
    assert torch.equal(shared.tokens, separate.tokens)
    assert torch.equal(shared.kept_counts, separate.kept_counts)
    torch.testing.assert_close(shared.logprobs, separate.logprobs, rtol=1e-5, atol=1e-5)
    # The samples of one prompt differ (each row draws its own random numbers).
    assert len({tuple(r.tolist()) for r in shared.responses()[:4]}) > 1


def test_multiturn_rows_with_equal_prompt_ids_share_one_prefill() -> None:
    ids = [[5, 6, 7], [5, 6, 7], [9, 8], [5, 6, 7]]
    tensors = shared_prompt_tensors(ids, torch.device("cpu"))
    assert tensors[0] is tensors[1] is tensors[3] and tensors[2] is not tensors[0]
    assert [t.tolist() for t in tensors] == ids
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=3, eos_token_id=EOS)
    seen = count_embedded_tokens(model)
    shared = generate_turns(model, tensors, config, 30, ScriptedTurns(tensors, turns=[2, 1, 2, 2]))
    assert seen[0] == 5  # the first forward is the prefill: two distinct prompts
    separate = [torch.tensor(i) for i in ids]
    alone = generate_turns(model, separate, config, 30, ScriptedTurns(separate, turns=[2, 1, 2, 2]))
    assert [r.tolist() for r in shared.responses] == [r.tolist() for r in alone.responses]
    for a, b in zip(shared.logprobs, alone.logprobs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
