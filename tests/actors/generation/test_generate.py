"""Single-process tests of actors.generation.decoding and actors.generation.sampling: greedy parity with
transformers' generate (tiny random Llama and Qwen2), EOS stopping, logprobs equal to a forward
pass, seeded reproducibility, the sampling distribution (chi-square on a tiny vocabulary, with
top-k/top-p truncation) and the memory check. CPU, float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from actors.engine.model import Transformer
from actors.engine.packing import pack_sequences
from actors.generation.decoding import GenerationConfig, GenerationOutput
from actors.generation.loop import generate
from actors.generation.sampling import (
    SamplingParams,
    allowed_tokens,
    sample_logits,
    step_uniforms,
    token_logprobs_full,
    truncate_logits,
)
from planning.models import ModelSpec

torch.set_num_threads(1)

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
FAMILIES: dict[str, dict[str, Any]] = {"Llama": {}, "Qwen2": {"rope_theta": 1e6}}
PROMPT_LENGTHS = [5, 9, 1, 6]


def build_hf(prefix: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **FAMILIES.get(prefix, {}), **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()


def ours_from_hf(hf: transformers.PreTrainedModel) -> Transformer:
    spec = ModelSpec.from_hf_config(hf.config.to_dict(), name="gen-test")
    model = Transformer(spec, device="meta")
    model.to_empty(device="cpu")
    state = hf.state_dict()
    model.load_state_dict({name: state[name] for name in model.state_dict()}, strict=True)
    return model.eval()


def random_prompts(vocab: int, lengths: list[int], seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def hf_greedy(hf: transformers.PreTrainedModel, prompt: torch.Tensor, max_new: int, eos: int | None) -> list[int]:
    """transformers' greedy decoding of one prompt (batch of one: no padding involved)."""
    out = hf.generate(prompt[None], max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long))
    return out[0, prompt.numel():].tolist()


def response_rows(out: GenerationOutput) -> torch.Tensor:
    """int64 [R]: row of the packed prompt+response forward that predicts each response token
    (response token j of sequence b sits at start_b + prompt_b + j, predicted one row earlier)."""
    starts = out.cu_seqlens[:-1].long().tolist()
    return torch.cat([torch.arange(p - 1, p - 1 + r) + s for s, p, r in
                      zip(starts, out.prompt_lengths.tolist(), out.response_lengths.tolist())])


def forward_logprobs(model: Transformer, out: GenerationOutput, kept_counts: bool = True) -> torch.Tensor:
    """Logprobs of the response tokens from one packed forward over prompt+response."""
    with torch.no_grad():
        logits = model(out.tokens, out.packed_batch())  # [T, V]
    rows = response_rows(out)
    counts = out.kept_counts if kept_counts else None
    return token_logprobs_full(logits[rows], out.tokens[rows + 1], out.sampling, counts)


@pytest.mark.unit
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_generate(family: str) -> None:
    hf = build_hf(family)
    model = ours_from_hf(hf)
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    max_new = 8
    # Pick as EOS a token that sequence 1 emits at its 4th step, so EOS stopping is exercised.
    eos = hf_greedy(hf, prompts[1], max_new, None)[3]
    config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(temperature=0.0), eos_token_id=eos)
    out = generate(model, prompts, config)
    for b, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, max_new, eos)
        assert out.responses()[b].tolist() == ref, f"sequence {b}"
        assert bool(out.no_eos[b]) == (ref[-1] != eos)
    assert int(out.response_lengths[1]) <= 4 and not bool(out.no_eos[1])
    assert out.tokens.numel() == int(out.cu_seqlens[-1]) == int((out.prompt_lengths + out.response_lengths).sum())
    assert out.logprobs.dtype == torch.float32 and out.kept_counts is None
    assert torch.allclose(out.logprobs, forward_logprobs(model, out), atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.8, top_k=20)])
def test_sampled_logprobs_equal_forward_and_seed_reproducible(params: SamplingParams) -> None:
    model = ours_from_hf(build_hf("Qwen2", seed=1))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS, seed=5)
    config = GenerationConfig(max_new_tokens=10, sampling=params, seed=11, eos_token_id=7)
    first, second = generate(model, prompts, config), generate(model, prompts, config)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.logprobs, second.logprobs)
    other = generate(model, prompts, GenerationConfig(max_new_tokens=10, sampling=params, seed=12, eos_token_id=7))
    assert not torch.equal(first.tokens, other.tokens)
    assert torch.allclose(first.logprobs, forward_logprobs(model, first), atol=1e-5)
    if params.truncates:
        assert first.kept_counts is not None and first.kept_counts.shape == first.logprobs.shape
        if params.top_k:
            assert int(first.kept_counts.max()) <= params.top_k
        # Recomputing the truncation from the forward's logits gives the same result here.
        assert torch.allclose(first.logprobs, forward_logprobs(model, first, kept_counts=False), atol=1e-5)
        # The train-side path: the `allowed` mask into actors.engine.logprobs's vocab-parallel logprobs.
        from actors.engine.logprobs import vocab_parallel_logprobs

        with torch.no_grad():
            logits = model(first.tokens, first.packed_batch())[response_rows(first)]
        allowed = allowed_tokens(logits, params, first.kept_counts)
        train_side = vocab_parallel_logprobs(logits, first.tokens[response_rows(first) + 1], None,
                                             params.temperature, allowed)
        assert torch.allclose(first.logprobs, train_side, atol=1e-5)


@pytest.mark.unit
def test_ignore_eos_runs_to_max_new_tokens() -> None:
    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    greedy = SamplingParams(temperature=0.0)
    eos = generate(model, prompts, GenerationConfig(6, greedy)).responses()[0][1].item()
    stopped = generate(model, prompts, GenerationConfig(6, greedy, eos_token_id=eos))
    full = generate(model, prompts, GenerationConfig(6, greedy, eos_token_id=eos, ignore_eos=True))
    assert int(stopped.response_lengths[0]) == 2 and not bool(stopped.no_eos[0])
    assert full.response_lengths.tolist() == [6] * len(prompts) and bool(full.no_eos.all())


def expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference distribution written independently of actors.generation.sampling (one row [V])."""
    scaled = logits / params.temperature
    order = torch.argsort(scaled, descending=True)
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    if params.top_k:
        keep[order[params.top_k:]] = True  # True = dropped
    scaled = scaled.masked_fill(keep, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if params.top_p < 1.0:
        mass = 0.0
        dropped = torch.ones_like(keep)
        for idx in order.tolist():
            if mass >= params.top_p or probs[idx] == 0:
                break
            dropped[idx] = False
            mass += probs[idx].item()
        probs = torch.softmax(scaled.masked_fill(dropped, float("-inf")), -1)
    return probs


@pytest.mark.unit
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.7)])
def test_sampling_distribution_chi_square(params: SamplingParams) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 40_000
    uniforms = step_uniforms(seed=0, step=0, n_seqs=n, device="cpu")
    sampled = sample_logits(logits.expand(n, -1), params, uniforms)
    counts = torch.bincount(sampled.tokens, minlength=logits.numel()).double()
    probs = expected_probs(logits, params).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the top-k/top-p set"
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    # 99.9% quantile of chi-square with <= 7 degrees of freedom is 24.3.
    assert chi2 < 24.3, f"chi2={chi2:.1f}, counts={counts.tolist()}, expected={(probs * n).tolist()}"
    assert torch.allclose(sampled.logprobs, torch.log(probs.float())[sampled.tokens], atol=1e-5)


@pytest.mark.unit
def test_truncate_logits_with_kept_counts() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [1.0, 1.0, 5.0, 0.0]])
    params = SamplingParams(temperature=2.0, top_k=2)
    out = truncate_logits(logits, params, torch.tensor([2, 1]))
    inf = float("-inf")
    assert torch.equal(out, torch.tensor([[inf, 1.5, inf, 1.0], [inf, inf, 2.5, inf]]))
    assert torch.equal(truncate_logits(logits, params), torch.tensor([[inf, 1.5, inf, 1.0], [0.5, inf, 2.5, inf]]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.unit
def test_memory_check_fails_before_allocating() -> None:
    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    config = GenerationConfig(max_new_tokens=4, memory_limit_bytes=1000)
    with pytest.raises(MemoryError, match=r"generation needs [\d,]+ bytes \(kv_cache [\d,]+, fused_qkv [\d,]+, logits [\d,]+\) but 1,000"):
        generate(model, prompts, config)
    with pytest.raises(ValueError, match="prompts"):
        generate(model, [torch.tensor([], dtype=torch.long)], config)


@pytest.mark.unit
@pytest.mark.parametrize("family", ["Llama", "Mistral"])
def test_head_major_cache_decode_equals_base_cache_and_buckets_change_nothing(family: str) -> None:
    from actors.engine.attention import KVCache
    from actors.generation.kv_cache import HeadMajorKVCache

    model = ours_from_hf(build_hf(family, sliding_window=4) if family == "Mistral" else build_hf(family))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    tokens, batch = pack_sequences(prompts)
    caches = [KVCache.for_model(model, len(prompts), 16), HeadMajorKVCache.for_model(model, len(prompts), 16),
              HeadMajorKVCache.for_model(model, len(prompts), 16, kernel="matmul")]
    step_tokens = torch.arange(len(prompts)) + 3
    with torch.no_grad():
        outs = []
        for cache in caches:
            model(tokens, batch, cache)
            outs.append([model(step_tokens + i, cache.decode_batch(), cache) for i in range(3)])
    for base, sdpa, matmul in zip(*outs):
        torch.testing.assert_close(sdpa, base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(matmul, base, rtol=1e-5, atol=1e-5)
    config = GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=0.9), seed=2)
    bucketed = GenerationConfig(**{**config.__dict__, "attend_bucket": 3})
    assert torch.equal(generate(model, prompts, config).tokens, generate(model, prompts, bucketed).tokens)


@pytest.mark.unit
def test_kv_cache_bytes_match_the_allocated_cache() -> None:
    from actors.generation.decoding import kv_cache_bytes, prepare_cache

    model = ours_from_hf(build_hf("Qwen2"))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    config = GenerationConfig(max_new_tokens=5)
    _, batch, cache = prepare_cache(model, prompts, config, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for t in [*cache.k.values(), *cache.v.values()])
    assert allocated == kv_cache_bytes(model, len(prompts), batch.max_seqlen + 5, torch.float32)
    assert cache.k[0].shape == (len(prompts), 2, batch.max_seqlen + 5, 8)  # [B, Hkv, max_len, D]


@pytest.mark.unit
def test_packed_prompt_order_and_single_prompt() -> None:
    model = ours_from_hf(build_hf("Llama"))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    config = GenerationConfig(max_new_tokens=5, sampling=SamplingParams(temperature=0.0))
    batched = generate(model, prompts, config)
    tokens, _ = pack_sequences(prompts)
    for b, prompt in enumerate(prompts):
        alone = generate(model, [prompt], config)
        assert torch.equal(alone.responses()[0], batched.responses()[b])
        start = int(batched.cu_seqlens[b])
        assert torch.equal(batched.tokens[start:start + prompt.numel()], prompt)


# ---- the CLI -------------------------------------------------------------------------------------


def save_tiny_checkpoint(root: Any, family: str = "Llama") -> Any:
    """A tiny random HF model plus a word-level tokenizer (no downloads) in one directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = build_hf(family)
    path = root / "tiny-model"
    hf.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, BASE["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.save_pretrained(path)
    return path


def run_cli(argv: list[str]) -> int:
    from app.cli import main

    return main(argv)


@pytest.mark.unit
def test_cli_generate_end_to_end(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = save_tiny_checkpoint(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "w5 w17 w40"}\n\n{"prompt": "w8", "id": 3}\n')
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(path), "--data", str(data), "--out", str(out), "--max-new-tokens", "5",
            "--temperature", "0", "--device", "cpu", "--local"]
    assert run_cli(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["w5 w17 w40", "w8"]
    hf = build_hf("Llama")
    for record in records:
        prompt_ids = torch.tensor([int(w[1:]) for w in record["prompt"].split()])
        assert record["response_tokens"] == hf_greedy(hf, prompt_ids, 5, 2)
        assert len(record["logprobs"]) == len(record["response_tokens"])
        words = [f"w{t}" for t in record["response_tokens"] if t > 2]
        assert record["response"] == " ".join(words)
    # Sampling with a seed is reproducible through the CLI as well.
    sampled = argv[:-5] + ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "10", "--seed", "3", "--device", "cpu", "--local"]
    assert run_cli(sampled) == 0
    first = out.read_text()
    assert run_cli(sampled) == 0 and out.read_text() == first


@pytest.mark.unit
def test_cli_generate_errors_exit_2_with_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_tiny_checkpoint(tmp_path)
    capsys.readouterr()  # drop save_pretrained's progress bar
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w5"}\n{"text": "w6"}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "w5"}\n')
    base = ["generate", "--model", str(path), "--out", str(tmp_path / "o.jsonl"), "--device", "cpu", "--local"]
    cases = [
        (["--data", str(bad)], f"{bad} line 2: no field 'prompt'"),
        (["--data", str(tmp_path / "missing.jsonl")], "missing.jsonl': no such file"),
        (["--data", str(good), "--top-p", "1.5"], "--top-p=1.5"),
        (["--data", str(good), "--layout", "tp3"], "tp=3 does not divide"),
    ]
    for extra, message in cases:
        assert run_cli(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert run_cli(["generate", "--model", str(tmp_path), "--data", str(bad), "--out", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


# ---- CUDA graphs (gpu tier) --------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_and_recaptures_after_weights_move() -> None:
    from actors.generation.decode_step import DecodeStep
    from actors.generation.kv_cache import HeadMajorKVCache

    model = ours_from_hf(build_hf("Llama")).cuda()
    prompts = [p.cuda() for p in random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)]
    greedy = SamplingParams(temperature=0.0)
    eager = generate(model, prompts, GenerationConfig(8, greedy))
    graph = generate(model, prompts, GenerationConfig(8, greedy, use_cuda_graph=True))
    assert torch.equal(eager.tokens, graph.tokens)
    assert torch.allclose(eager.logprobs, graph.logprobs, atol=1e-5)
    for options in ({"decode_attention": "sdpa"}, {"decode_attention": "matmul"}, {"compile_decode": True}):
        other = generate(model, prompts, GenerationConfig(8, greedy, use_cuda_graph=True, **options))
        assert torch.equal(eager.tokens, other.tokens), options
        assert torch.allclose(eager.logprobs, other.logprobs, atol=1e-4), options

    tokens, batch = pack_sequences(prompts)
    with torch.no_grad():
        cache = HeadMajorKVCache.for_model(model, len(prompts), batch.max_seqlen + 4)
        model(tokens, batch, cache)
        step = DecodeStep(model, cache, use_cuda_graph=True)
        next_tokens = torch.arange(len(prompts), device="cuda") + 3
        first = step(next_tokens).clone()
        first_key = step.key
        cache.lengths -= 1  # undo the step, then move (and double) the head's weight
        model.lm_head.weight.data = model.lm_head.weight.data * 2
        second = step(next_tokens).clone()
    assert step.key != first_key
    assert torch.allclose(second, 2 * first, atol=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("family", ["Llama", "Qwen2"])  # Qwen2: q/k/v biases are concatenated too
def test_fused_qkv_decode_equals_separate_projections(family: str) -> None:
    model = ours_from_hf(build_hf(family))
    prompts = random_prompts(BASE["vocab_size"], PROMPT_LENGTHS)
    greedy = SamplingParams(temperature=0.0)
    fused = generate(model, prompts, GenerationConfig(6, greedy, fuse_qkv=True))
    separate = generate(model, prompts, GenerationConfig(6, greedy, fuse_qkv=False))
    assert torch.equal(fused.tokens, separate.tokens)
    torch.testing.assert_close(fused.logprobs, separate.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_fused_qkv_rebuilds_only_when_weights_move() -> None:
    from actors.generation.kv_cache import FusedQKV

    model = ours_from_hf(build_hf("Llama"))
    fused = FusedQKV(model)
    attn = model.model.layers["0"].self_attn
    weight, _ = fused.weights[0]
    assert torch.equal(weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert not fused.refresh() and fused.weights[0][0] is weight
    attn.k_proj.weight.data = attn.k_proj.weight.data * 2  # new storage, as reallocation gives
    assert fused.refresh()
    torch.testing.assert_close(fused.weights[0][0][attn.q_proj.weight.shape[0]:][: attn.k_proj.weight.shape[0]],
                               attn.k_proj.weight.detach())
    assert FusedQKV.nbytes(model) == sum(w.numel() * w.element_size() for w, _ in fused.weights.values())
