"""Parity of actors.engine.model with transformers (Llama incl. llama3 rope + tied, Qwen2, Mistral),
packing, the critic head, init and the KV cache (decode vs full recomputation). CPU, float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from actors.engine.attention import KVCache, packed_causal_mask
from actors.engine.model import Transformer
from actors.engine.packing import PackedBatch, pack_sequences, unpack_sequences
from actors.engine.rotary import rope_cos_sin, rope_inv_freq
from planning.models import ModelSpec, param_specs

torch.set_num_threads(1)

LENGTHS = [5, 11, 1, 8]

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "llama3_rope_tied": ("Llama", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama_attention_bias_mha": ("Llama", dict(attention_bias=True, num_key_value_heads=4)),
    "qwen2": ("Qwen2", dict(rope_theta=1e6)),
    "mistral_window": ("Mistral", dict(sliding_window=4, head_dim=16)),
}


def build_hf(prefix: str, overrides: dict[str, Any], head: str = "ForCausalLM") -> transformers.PreTrainedModel:
    config_cls = getattr(transformers, f"{prefix}Config")
    config = config_cls(**{**BASE, **overrides})
    if head == "ForSequenceClassification":
        config.num_labels = 1
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}{head}")(config).float().eval()
    return model


def ours_from_hf(hf: transformers.PreTrainedModel, critic: bool = False) -> Transformer:
    spec = ModelSpec.from_hf_config(hf.config.to_dict(), name="parity")
    model = Transformer(spec, critic=critic, device="meta")
    model.to_empty(device="cpu")
    hf_state = hf.state_dict()
    model.load_state_dict({name: hf_state[name] for name in model.state_dict()}, strict=True)
    return model.eval()


def random_seqs(vocab: int, lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3e} vs max |ref| {scale:.3e} (rel {err / scale:.2e})"


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(CASES))
def test_causal_lm_parity_packed_and_single(case: str) -> None:
    prefix, overrides = CASES[case]
    hf = build_hf(prefix, overrides)
    ours = ours_from_hf(hf)
    shapes = {name: tuple(param.shape) for name, param in ours.named_parameters()}
    assert shapes == {p.name: p.shape for p in param_specs(ours.spec)}
    seqs = random_seqs(hf.config.vocab_size, LENGTHS)
    tokens, batch = pack_sequences(seqs)
    with torch.no_grad():
        packed_logits = unpack_sequences(ours(tokens, batch), batch)
        for seq, logits in zip(seqs, packed_logits):
            ref = hf(seq[None]).logits[0]
            assert_rel_close(logits, ref)
            single = ours(seq, PackedBatch.from_lengths([len(seq)]))
            assert_rel_close(single, ref)


@pytest.mark.unit
def test_sliding_window_changes_the_result() -> None:
    """The Mistral window is honoured: with a window shorter than the sequence, a full-attention
    model gives other logits (so the parity above is not vacuous)."""
    hf = build_hf("Mistral", dict(sliding_window=4, head_dim=16))
    ours = ours_from_hf(hf)
    assert ours.spec.sliding_window == 4
    seq = random_seqs(hf.config.vocab_size, [12])[0]
    batch = PackedBatch.from_lengths([12])
    with torch.no_grad():
        windowed = ours(seq, batch)
        for layer in ours.model.layers.values():
            layer.self_attn.sliding_window = None
        full = ours(seq, batch)
    assert torch.allclose(windowed[:4], full[:4], atol=1e-6)
    assert not torch.allclose(windowed[4:], full[4:], atol=1e-4)


@pytest.mark.unit
def test_critic_values_match_sequence_classification() -> None:
    hf = build_hf("Llama", {}, head="ForSequenceClassification")
    ours = ours_from_hf(hf, critic=True)
    assert ours.score.weight.shape == (1, 32)
    seqs = random_seqs(hf.config.vocab_size, LENGTHS)
    tokens, batch = pack_sequences(seqs)
    with torch.no_grad():
        values = unpack_sequences(ours(tokens, batch), batch)
        for seq, vals in zip(seqs, values):
            assert vals.dtype == torch.float32 and vals.shape == seq.shape
            # HF pools the last token; the per-token path is its trunk's hidden -> score.
            pooled = hf(seq[None]).logits[0, 0]
            per_token = hf.score(hf.model(seq[None]).last_hidden_state)[0, :, 0]
            assert_rel_close(vals[-1:], pooled[None])
            assert_rel_close(vals, per_token)


@pytest.mark.unit
def test_llama3_inv_freq_matches_transformers() -> None:
    hf = build_hf("Llama", CASES["llama3_rope_tied"][1])
    spec = ModelSpec.from_hf_config(hf.config.to_dict())
    torch.testing.assert_close(rope_inv_freq(spec), hf.model.rotary_emb.inv_freq, rtol=0, atol=0)


@pytest.mark.unit
def test_unsupported_rope_type_names_the_field() -> None:
    spec = ModelSpec("x", "llama", 64, 32, 64, 1, 4, 2, 8, rope_scaling=(("factor", 2.0), ("rope_type", "yarn")))
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'"):
        Transformer(spec)(torch.zeros(3, dtype=torch.long), PackedBatch.from_lengths([3]))


@pytest.mark.unit
def test_packing_helpers() -> None:
    batch = PackedBatch.from_lengths([2, 3, 1])
    assert batch.cu_seqlens.tolist() == [0, 2, 5, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.positions.tolist() == [0, 1, 0, 1, 2, 0] and batch.positions.dtype == torch.int64
    assert batch.max_seqlen == 3 and batch.n_seqs == 3 and batch.n_tokens == 6
    assert batch.seq_ids().tolist() == [0, 0, 1, 1, 1, 2]
    assert batch.last_token_indices().tolist() == [1, 4, 5]
    mask = packed_causal_mask(batch)
    assert mask.sum().item() == 3 + 6 + 1 and not mask[2, 1] and mask[4, 2]
    with pytest.raises(ValueError, match="lengths"):
        PackedBatch.from_lengths([3, 0])


@pytest.mark.unit
def test_init_is_deterministic_and_stage_independent() -> None:
    spec = ModelSpec("t", "llama", 64, 32, 64, 4, 4, 2, 8)
    full = Transformer(spec, device="meta")
    full.to_empty(device="cpu")
    full.init_weights(seed=3)
    stage = Transformer(spec, device="meta")
    stage.keep_layers(2, 4, first=False, last=True)
    stage.to_empty(device="cpu")
    stage.init_weights(seed=3)
    full_state = full.state_dict()
    for name, tensor in stage.state_dict().items():
        torch.testing.assert_close(tensor, full_state[name], rtol=0, atol=0)
    assert full.model.norm.weight.eq(1).all()
    std = full.model.layers["0"].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025
    other = Transformer(spec)
    other.init_weights(seed=4)
    assert not torch.equal(other.lm_head.weight, full.lm_head.weight)


@pytest.mark.unit
def test_pipeline_stages_compose_to_full_model() -> None:
    spec = ModelSpec("t", "llama", 64, 32, 64, 4, 4, 2, 8, tie_embeddings=True)
    full = Transformer(spec)
    full.init_weights(seed=0)
    first, last = Transformer(spec), Transformer(spec)
    first.keep_layers(0, 2, first=True, last=False)
    last.keep_layers(2, 4, first=False, last=True)
    for stage in (first, last):
        stage.load_state_dict({n: full.state_dict()[n] for n in stage.state_dict()})
    assert first.has_embedding and not first.has_head
    assert last.has_head and not last.has_embedding and last.model.embed_tokens is not None
    tokens, batch = pack_sequences(random_seqs(64, [4, 6]))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens, batch), batch), full(tokens, batch))


@pytest.mark.unit
@pytest.mark.parametrize("case", ["llama", "mistral_window", "qwen2"])
def test_kv_cache_decode_equals_full_recomputation(case: str) -> None:
    prefix, overrides = CASES[case]
    ours = ours_from_hf(build_hf(prefix, overrides))
    prompts = random_seqs(ours.spec.vocab_size, [3, 6, 1], seed=5)
    steps = 5
    new_tokens = random_seqs(ours.spec.vocab_size, [steps] * 3, seed=6)
    cache = KVCache.for_model(ours, n_seqs=3, max_len=16)
    tokens, batch = pack_sequences(prompts)
    with torch.no_grad():
        prefill = ours(tokens, batch, cache)
        assert cache.lengths.tolist() == [3, 6, 1]
        last_logits = [prefill[int(i)] for i in batch.last_token_indices()]
        step_logits = []
        for t in range(steps):
            step = torch.stack([seq[t] for seq in new_tokens])
            step_logits.append(ours(step, cache.decode_batch(), cache))
        full_seqs = [torch.cat([p, n]) for p, n in zip(prompts, new_tokens)]
        full_tokens, full_batch = pack_sequences(full_seqs)
        full = unpack_sequences(ours(full_tokens, full_batch), full_batch)
    for b, (prompt, ref) in enumerate(zip(prompts, full)):
        torch.testing.assert_close(last_logits[b], ref[len(prompt) - 1], rtol=1e-5, atol=1e-5)
        for t in range(steps):
            torch.testing.assert_close(step_logits[t][b], ref[len(prompt) + t], rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [3 + steps, 6 + steps, 1 + steps]


@pytest.mark.unit
def test_replicated_kv_heads_map_query_heads() -> None:
    """Under tp=2 with K/V replicated (n_kv_heads=3 not divisible by 2), each rank holds 3 query
    heads and all KV heads; picking KV heads by global query index makes the two ranks' partial
    outputs (row-parallel o_proj) sum to the full attention output."""
    spec = ModelSpec("t", "llama", 64, 48, 64, 1, 6, 3, 8)
    model = Transformer(spec)
    model.init_weights(seed=1)
    full_attn = model.model.layers["0"].self_attn
    assert full_attn.kv_index(torch.device("cpu")) is None
    batch = PackedBatch.from_lengths([4, 7])
    x = torch.randn(batch.n_tokens, 48, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(spec), torch.float32)
    partial_sum = torch.zeros_like(x)
    with torch.no_grad():
        expected = full_attn(x, cos, sin, batch, None)
        for rank in range(2):
            local = Transformer(spec).model.layers["0"].self_attn
            local.load_state_dict(full_attn.state_dict())
            rows = slice(rank * 3 * 8, (rank + 1) * 3 * 8)  # this rank's query heads, 8 dims each
            local.q_proj.weight = torch.nn.Parameter(full_attn.q_proj.weight[rows].clone())
            local.o_proj.weight = torch.nn.Parameter(full_attn.o_proj.weight[:, rows].clone())
            local.n_heads, local.q_head_offset = 3, rank * 3
            assert local.kv_index(torch.device("cpu")).tolist() == [[0, 0, 1], [1, 2, 2]][rank]
            partial_sum += local(x, cos, sin, batch, None)
    torch.testing.assert_close(partial_sum, expected, rtol=1e-5, atol=1e-6)


def _cuda_model(dtype: torch.dtype, sliding_window: int | None = None) -> Transformer:
    spec = ModelSpec("gpu", "mistral", 128, 64, 128, 2, 4, 2, 16, sliding_window=sliding_window)
    model = Transformer(spec, device="meta")
    model.to_empty(device="cuda")
    model.init_weights(seed=0)
    return model.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_cuda_kernels_match_sdpa(sliding_window: int | None) -> None:
    """varlen_attn / flash_attn (bf16) agree with the SDPA mask path in forward and backward."""
    from actors.engine.attention import flash_attn_available, varlen_attn_available

    model = _cuda_model(torch.bfloat16, sliding_window)
    tokens, batch = pack_sequences(random_seqs(128, [7, 33, 1, 20]), device="cuda")
    kernels = [name for name, ok in (("varlen", varlen_attn_available()), ("flash", flash_attn_available())) if ok]
    assert kernels, "no CUDA varlen kernel available"
    results = {}
    for backend in ["sdpa", *kernels]:
        model.set_attention_backend(backend)
        model.zero_grad()
        logits = model(tokens, batch)
        logits.float().square().mean().backward()
        results[backend] = (logits.float(), model.model.layers["0"].self_attn.q_proj.weight.grad.float())
    ref_logits, ref_grad = results["sdpa"]
    for backend in kernels:
        logits, grad = results[backend]
        assert_rel_close(logits, ref_logits, rel=3e-2)
        assert_rel_close(grad, ref_grad, rel=5e-2)


@pytest.mark.gpu
def test_cuda_kv_cache_decode() -> None:
    model = _cuda_model(torch.float32, sliding_window=6)
    prompts = random_seqs(128, [4, 9], seed=3)
    new_tokens = random_seqs(128, [6, 6], seed=4)
    cache = KVCache.for_model(model, n_seqs=2, max_len=16)
    with torch.no_grad():
        tokens, batch = pack_sequences(prompts, device="cuda")
        model(tokens, batch, cache)
        steps = [model(torch.stack([s[t] for s in new_tokens]).cuda(), cache.decode_batch(), cache) for t in range(6)]
        full_tokens, full_batch = pack_sequences([torch.cat(p) for p in zip(prompts, new_tokens)], device="cuda")
        full = unpack_sequences(model(full_tokens, full_batch), full_batch)
    for b, prompt in enumerate(prompts):
        for t in range(6):
            torch.testing.assert_close(steps[t][b], full[b][len(prompt) + t], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_cuda_kernel_window_convention(sliding_window: int | None) -> None:
    """At the attention level the kernels match SDPA closely, and a window one key wider does
    not (so the (left, 0) translation of HF's window is exact, not off by one)."""
    from actors.engine.attention import packed_attention, varlen_attn_available

    if not varlen_attn_available():
        pytest.skip("torch.nn.attention.varlen not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = PackedBatch.from_lengths([9, 17, 2], device="cuda")
    q = torch.randn(batch.n_tokens, 4, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(batch.n_tokens, 2, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(batch.n_tokens, 2, 16, device="cuda", generator=gen, dtype=torch.bfloat16)
    kernel = packed_attention(q, k, v, batch, "varlen", sliding_window).float()
    exact = packed_attention(q.float(), k.float(), v.float(), batch, "sdpa", sliding_window)
    assert (kernel - exact).abs().max().item() < 2e-2
    if sliding_window is not None:
        wider = packed_attention(q.float(), k.float(), v.float(), batch, "sdpa", sliding_window + 1)
        assert (kernel - wider).abs().max().item() > 0.1


@pytest.mark.gpu
def test_cuda_varlen_gqa_gradients_match_sdpa() -> None:
    """varlen_attn with fewer KV heads than query heads (native GQA where this torch takes it,
    `varlen_native_gqa`; else repeated K/V): output and the gradients of q, k and v against the
    float32 SDPA path."""
    from actors.engine.attention import packed_attention, varlen_attn_available, varlen_native_gqa

    if not varlen_attn_available():
        pytest.skip("torch.nn.attention.varlen not installed")
    print(f"varlen native GQA on this torch ({torch.__version__}): {varlen_native_gqa(0)}")
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = PackedBatch.from_lengths([9, 40, 3, 17], device="cuda")
    inputs = [torch.randn(batch.n_tokens, heads, 64, device="cuda", generator=gen) for heads in (8, 2, 2)]
    results = {}
    for backend, dtype in (("varlen", torch.bfloat16), ("sdpa", torch.float32)):
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        out = packed_attention(q, k, v, batch, backend)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        results[backend] = [out.float(), *(g.float() for g in grads)]
    for got, exact in zip(results["varlen"], results["sdpa"], strict=True):
        assert_rel_close(got, exact, rel=3e-2)
