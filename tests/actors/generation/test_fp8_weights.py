"""FP8 generation: decode weights (actors.generation.fp8_weights: the row-wise quantization, the
FP8 product, exact where the operands are representable, emulated on CPU, `torch._scaled_mm` on a
GPU) and the FP8 KV cache (GenerationConfig.kv_cache_dtype). Generation with either keeps the
prefill's first token, stays close to full precision, and the memory check counts the bytes.
CPU, float32 unless marked gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.generation.decoding import GenerationConfig
from actors.generation.fp8_weights import (
    FP8_ALIGN,
    FP8_MAX,
    Fp8DecodeWeights,
    Fp8Weight,
    check_fp8_device,
    fp8_gpu_error,
    fp8_linear,
    quantize_rows,
)
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from planning.cost_terms import FP8_ALIGN as PLANNED_FP8_ALIGN
from tests.actors.generation.test_generate import BASE, build_hf, forward_logprobs, ours_from_hf, random_prompts

torch.set_num_threads(1)


@pytest.mark.unit
def test_quantize_rows_scales_each_row_to_the_fp8_range() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen) * torch.logspace(-3, 3, 6)[:, None]  # rows of very different size
    x[2] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(q[2].float(), torch.zeros(40))  # an all-zero row stays zero (no 0 / 0)
    for row in (0, 1, 3, 4, 5):
        assert q[row].float().abs().max() == FP8_MAX  # each row's largest value maps to 448
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, relative to the row's scale.
        err = (q[row].float() * scale[row] - x[row]).abs()
        assert torch.all(err <= x[row].abs() / 16 + scale[row] * 2**-9), row


@pytest.mark.unit
def test_fp8_linear_is_exact_on_representable_operands() -> None:
    """Rows whose largest entry is 2 and whose entries are in {-1, 0, 1, 2}: q = 224 x is exact in
    e4m3, so the FP8 product equals the float32 one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-1, 3, (5, 32), generator=gen).float()
    w = torch.randint(-1, 3, (12, 32), generator=gen).float()
    x[:, 0], w[:, 0] = 2.0, 2.0
    assert torch.equal(fp8_linear(x, Fp8Weight.of(w)), F.linear(x, w))


@pytest.mark.unit
def test_fp8_linear_is_close_to_the_full_precision_product() -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 256, generator=gen), torch.randn(64, 256, generator=gen) * 0.02
    ref = F.linear(x, w)
    rel = (fp8_linear(x, Fp8Weight.of(w)) - ref).norm() / ref.norm()
    assert 0 < rel < 0.06  # ~3.7% on Gaussian data (two 3-bit mantissas), never zero


@pytest.mark.unit
@pytest.mark.parametrize("family,overrides", [("Llama", {}), ("Llama", {"tie_word_embeddings": True}),
                                              ("Qwen2", {})])
def test_fp8_decode_keeps_the_prefill_and_stays_close(family: str, overrides: dict) -> None:
    model = ours_from_hf(build_hf(family, **overrides))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6])
    sampling = SamplingParams(temperature=1.0)
    bf16 = generate(model, prompts, GenerationConfig(6, sampling, seed=3))
    fp8 = generate(model, prompts, GenerationConfig(6, sampling, seed=3, fp8_weights=True))
    per_seq = fp8.response_lengths.tolist()
    first = torch.tensor([sum(per_seq[:b]) for b in range(len(per_seq))])  # each response's first token
    # The first token comes from the prefill, which keeps the bf16 weights: the same draw, same logprob.
    assert torch.equal(fp8.responses()[0][:1], bf16.responses()[0][:1])
    torch.testing.assert_close(fp8.logprobs[first], bf16.logprobs[first], rtol=0, atol=1e-6)
    # The later tokens were sampled from the FP8 model: its logprobs differ from what the bf16
    # model gives the same tokens (the gap rollout_is corrects), by a few percent of these tiny
    # models' large logits (initializer_range 0.2); a broken copy would be off by nats.
    full = forward_logprobs(model, fp8)
    later = torch.ones_like(fp8.logprobs, dtype=torch.bool)
    later[first] = False
    gap = (fp8.logprobs[later] - full[later]).abs()
    assert 0 < gap.mean() < 0.1 and gap.max() < 0.4, gap


@pytest.mark.unit
def test_fp8_copies_cover_every_mlp_and_the_head_and_their_bytes_are_counted() -> None:
    model = ours_from_hf(build_hf("Llama", tie_word_embeddings=True))
    weights = Fp8DecodeWeights(model)
    assert sorted(weights.mlps) == [int(i) for i in model.model.layers]
    mlp = model.model.layers["1"].mlp
    assert weights.mlps[1].gate_up.q.shape == (2 * mlp.gate_proj.weight.shape[0], mlp.gate_proj.weight.shape[1])
    assert weights.head_weight is not None  # tied: the embedding table's copy
    assert weights.head_weight.q.shape == model.model.embed_tokens.weight.shape
    built = sum(m.gate_up.nbytes + m.down.nbytes for m in weights.mlps.values()) + weights.head_weight.nbytes
    assert Fp8DecodeWeights.nbytes(model) == built
    # The x the model's MLP would get, through the copy and through the bf16 weights.
    x = torch.randn(3, BASE["hidden_size"], generator=torch.Generator().manual_seed(5))
    ref = mlp(x)
    assert (weights.mlp(1, x) - ref).norm() / ref.norm() < 0.06


@pytest.mark.unit
def test_weights_that_scaled_mm_cannot_take_keep_their_bf16_copy() -> None:
    """A vocabulary of 100 (not a multiple of 16): the head stays bf16, the MLPs go FP8."""
    model = ours_from_hf(build_hf("Llama", vocab_size=100))
    weights = Fp8DecodeWeights(model)
    assert weights.head_weight is None and len(weights.mlps) == BASE["num_hidden_layers"]
    assert weights.head(torch.zeros(2, BASE["hidden_size"])) is None  # the model then runs its own head
    mlp_bytes = sum(m.gate_up.nbytes + m.down.nbytes for m in weights.mlps.values())
    assert Fp8DecodeWeights.nbytes(model) == mlp_bytes
    out = generate(model, random_prompts(100, [4, 6]), GenerationConfig(4, SamplingParams(temperature=0.0),
                                                                        fp8_weights=True))
    assert out.response_lengths.tolist() == [4, 4]


@pytest.mark.unit
def test_a_gpu_without_fp8_matmuls_is_refused_naming_it_and_the_setting() -> None:
    """On CUDA below compute capability 8.9 the product would be the float32 emulation; the CPU
    keeps it (the tests run it), so only the message can be checked here."""
    check_fp8_device(torch.device("cpu"))  # no error: the emulation is the CPU path
    message = fp8_gpu_error("NVIDIA A100-SXM4-80GB", (8, 0))
    assert "sampling.fp8" in message and "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in message
    assert ">= 8.9" in message and "set sampling.fp8: false" in message


@pytest.mark.unit
def test_the_planner_prices_the_same_alignment_rule() -> None:
    """planning.cost_terms prices FP8 copies only for the weights this module quantizes."""
    assert FP8_ALIGN == PLANNED_FP8_ALIGN


@pytest.mark.unit
def test_fp8_copies_count_in_the_memory_check() -> None:
    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], [4, 4])
    plain = GenerationConfig(2, SamplingParams(temperature=0.0), fuse_qkv=False)
    with pytest.raises(MemoryError) as info:
        generate(model, prompts, GenerationConfig(**{**plain.__dict__, "fp8_weights": True, "memory_limit_bytes": 1}))
    assert f"fp8_weights {Fp8DecodeWeights.nbytes(model):,}" in str(info.value)


@pytest.mark.unit
def test_fp8_kv_cache_halves_its_bytes_and_stays_close() -> None:
    from actors.generation.decoding import kv_cache_bytes

    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6])
    sampling = SamplingParams(temperature=1.0)
    full = generate(model, prompts, GenerationConfig(6, sampling, seed=3))
    fp8 = generate(model, prompts, GenerationConfig(6, sampling, seed=3, kv_cache_dtype="fp8"))
    first = torch.tensor([0] + fp8.response_lengths.cumsum(0)[:-1].tolist())
    torch.testing.assert_close(fp8.logprobs[first], full.logprobs[first], rtol=0, atol=1e-6)  # prefill: own K/V
    gap = (fp8.logprobs - forward_logprobs(model, fp8)).abs()
    assert 0 < gap.max() < 0.4 and gap.mean() < 0.1, gap
    assert kv_cache_bytes(model, 4, 16, torch.float8_e4m3fn) * 4 == kv_cache_bytes(model, 4, 16, torch.float32)
    limit = GenerationConfig(2, sampling, kv_cache_dtype="fp8", fuse_qkv=False, memory_limit_bytes=1)
    with pytest.raises(MemoryError, match=f"kv_cache {kv_cache_bytes(model, 4, 11, torch.float8_e4m3fn):,}"):
        generate(model, prompts, limit)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8': unknown; allowed: auto, fp8"):
        GenerationConfig(2, kv_cache_dtype="int8")


@pytest.mark.unit
def test_compiled_decode_runs_the_fp8_path_in_one_graph() -> None:
    """torch.compile (inductor on CPU) traces the decode step through the cache's FP8 MLPs, head
    and e4m3 cache without a graph break and samples what the eager FP8 step samples."""
    from torch._dynamo.utils import counters

    model = ours_from_hf(build_hf("Llama", tie_word_embeddings=True))
    prompts = random_prompts(BASE["vocab_size"], [5, 9, 1, 6])
    config = {"max_new_tokens": 6, "sampling": SamplingParams(temperature=0.0), "fp8_weights": True,
              "kv_cache_dtype": "fp8"}
    eager = generate(model, prompts, GenerationConfig(**config))
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(model, prompts, GenerationConfig(**config, compile_decode=True))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(eager.tokens, compiled.tokens)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_scaled_mm_matches_the_emulated_product_on_gpu() -> None:
    from actors.generation.fp8_weights import fp8_matmul_supported

    device = torch.device("cuda")
    if not fp8_matmul_supported(device):
        pytest.skip("needs compute capability >= 8.9")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(512, 2048, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
    weight = Fp8Weight.of(w)
    x8, x_scale = quantize_rows(x)
    emulated = (x8.float() * x_scale) @ (weight.q.float() * weight.scale).t()
    got = fp8_linear(x, weight).float()
    assert (got - emulated).norm() / emulated.norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"fp8_weights": True}, {"kv_cache_dtype": "fp8"},
                                     {"fp8_weights": True, "kv_cache_dtype": "fp8"}])
def test_fp8_generation_on_gpu_under_graph_and_compile(options: dict) -> None:
    """The CUDA path end to end (scaled_mm, the Triton kernel reading e4m3, CUDA graph, compile):
    the prefill's token unchanged, the later ones close to the bf16 model's logprobs."""
    model = ours_from_hf(build_hf("Llama", tie_word_embeddings=True)).cuda().to(torch.bfloat16)
    prompts = [p.cuda() for p in random_prompts(BASE["vocab_size"], [5, 9, 1, 6])]
    base = {"max_new_tokens": 6, "sampling": SamplingParams(temperature=1.0), "seed": 3, "use_cuda_graph": True,
            "compile_decode": True}
    full = generate(model, prompts, GenerationConfig(**base))
    fp8 = generate(model, prompts, GenerationConfig(**base, **options))
    first = torch.tensor([0] + fp8.response_lengths.cumsum(0)[:-1].tolist(), device="cuda")
    torch.testing.assert_close(fp8.logprobs[first], full.logprobs[first], rtol=0, atol=1e-6)
    gap = (fp8.logprobs - forward_logprobs(model, fp8)).abs()
    assert gap.mean() < 0.15 and gap.max() < 0.6, gap
