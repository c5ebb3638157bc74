"""Decode steps split into row lanes (actors.generation.decode_step): lane bounds, cache row views
that write into the parent cache, generation with lanes equal to generation without, the
automatic lane count, and the config's check. CPU float32 (lanes run one after the other there);
the gpu tier runs the lanes as forked streams inside one CUDA graph."""

from __future__ import annotations

import pytest
import torch

from actors.engine.packing import pack_sequences
from actors.generation.decode_step import DecodeStep, lane_bounds
from actors.generation.decoding import GenerationConfig
from actors.generation.kv_cache import HeadMajorKVCache
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from tests.actors.generation.test_generate import BASE, build_hf, ours_from_hf, random_prompts

torch.set_num_threads(1)

LENGTHS = [5, 9, 1, 6, 3, 8, 2]


@pytest.mark.unit
@pytest.mark.parametrize(("n_seqs", "lanes", "expected"), [
    (7, 1, [(0, 7)]), (7, 2, [(0, 3), (3, 7)]), (7, 3, [(0, 2), (2, 4), (4, 7)]), (2, 4, [(0, 1), (1, 2)]),
    (512, 2, [(0, 256), (256, 512)]),
])
def test_lane_bounds_cover_the_rows_in_order(n_seqs: int, lanes: int, expected: list[tuple[int, int]]) -> None:
    assert lane_bounds(n_seqs, lanes) == expected


@pytest.mark.unit
def test_row_slice_views_the_parent_cache() -> None:
    cache = HeadMajorKVCache({0: _shape(), 1: _shape()}, n_seqs=5, max_len=6, dtype=torch.float32, device="cpu")
    view = cache.row_slice(2, 5)
    assert view.n_seqs == 3 and view.k[1].shape == (3, 2, 6, 4)
    view.k[1][0, 1, 2] = 7.0
    view.lengths += 3
    view.step_increment.zero_()
    assert torch.all(cache.k[1][2, 1, 2] == 7.0)
    assert cache.lengths.tolist() == [0, 0, 3, 3, 3]
    assert cache.step_increment.tolist() == [1, 1, 0, 0, 0]
    assert view.rows.tolist() == [0, 1, 2] and view.step_masks is not cache.step_masks
    for start, stop in ((3, 3), (-1, 2), (0, 6)):
        with pytest.raises(ValueError, match=rf"row_slice\({start}, {stop}\).*n_seqs=5"):
            cache.row_slice(start, stop)


@pytest.mark.unit
@pytest.mark.parametrize("kernel", ["sdpa", "matmul"])
def test_generation_with_lanes_equals_one_lane(kernel: str) -> None:
    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], LENGTHS)
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    one = generate(model, prompts, GenerationConfig(10, sampled, seed=4, eos_token_id=5, decode_lanes=1,
                                                    decode_attention=kernel))
    for lanes in (2, 3, len(LENGTHS)):
        split = generate(model, prompts, GenerationConfig(10, sampled, seed=4, eos_token_id=5, decode_lanes=lanes,
                                                          decode_attention=kernel))
        assert torch.equal(one.tokens, split.tokens), lanes
        assert torch.equal(one.response_lengths, split.response_lengths), lanes
        torch.testing.assert_close(one.logprobs, split.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_decode_step_lanes_advance_only_unpaused_rows() -> None:
    """A step split into 3 lanes writes the same cache and logits as one step, paused rows
    (step_increment 0) included."""
    model = ours_from_hf(build_hf("Qwen2", seed=2))
    prompts = random_prompts(BASE["vocab_size"], LENGTHS)
    results = []
    for lanes in (1, 3):
        tokens, batch = pack_sequences(prompts)
        with torch.no_grad():
            cache = HeadMajorKVCache.for_model(model, len(prompts), batch.max_seqlen + 4)
            model(tokens, batch, cache)
            cache.step_increment.copy_(torch.tensor([1, 0, 1, 1, 0, 1, 1]))
            step = DecodeStep(model, cache, use_cuda_graph=False, lanes=lanes)
            assert step.n_lanes == lanes
            logits = step(torch.arange(len(prompts)) + 3, attend_len=batch.max_seqlen + 1)
        results.append((logits, cache.lengths.clone(), cache.k[1].clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])
    assert results[1][1].tolist() == [n + i for n, i in zip(LENGTHS, [1, 0, 1, 1, 0, 1, 1])]
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-6, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("lanes", [0, -1, 1.5])
def test_config_refuses_bad_lanes(lanes: object) -> None:
    with pytest.raises(ValueError, match=rf"decode_lanes={lanes}.*int >= 1"):
        GenerationConfig(4, decode_lanes=lanes)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_graph_lanes_equal_one_lane() -> None:
    """On CUDA (float32): a graph that forks two lanes onto two streams gives the tokens and
    logprobs of the one-lane graph and of eager decoding, Triton attention and compile included."""
    model = ours_from_hf(build_hf("Llama")).cuda()
    prompts = [p.cuda() for p in random_prompts(BASE["vocab_size"], LENGTHS)]
    greedy = SamplingParams(temperature=0.0)
    eager = generate(model, prompts, GenerationConfig(12, greedy))
    for options in ({}, {"compile_decode": True}, {"decode_attention": "sdpa"}):
        for lanes in (1, 2, 3):
            graph = generate(model, prompts, GenerationConfig(12, greedy, use_cuda_graph=True, decode_lanes=lanes,
                                                              **options))
            assert torch.equal(eager.tokens, graph.tokens), (options, lanes)
            assert torch.allclose(eager.logprobs, graph.logprobs, atol=1e-4), (options, lanes)


def _shape() -> object:
    from actors.engine import CacheLayerShape

    return CacheLayerShape(2, 4)
