"""The Triton decode attention kernels (actors.kernels.decode_attention) against their torch twin and
the SDPA decode path: cache writes, GQA groups, per-sequence lengths (0 included), sliding windows,
the split-K variant for several split counts (and its automatic choice), and whole generations
token-for-token. Without CUDA the kernel runs in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay tiny."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.engine.model import Transformer
from actors.generation.decoding import GenerationConfig
from actors.generation.kv_cache import HeadMajorKVCache, resolve_decode_kernel
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from actors.kernels.decode_attention import gqa_decode_attention, gqa_decode_attention_reference
from actors.kernels.decode_launch import decode_splits
from actors.kernels.switch import E4M3_MIN_CAPABILITY, triton_runs
from planning.models import ModelSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_runs(DEVICE), reason="Triton cannot run here (no CUDA, no interpreter)")


def random_case(n_seqs: int, n_kv: int, group: int, head_dim: int, max_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    return (rand(n_seqs, n_kv * group, head_dim), rand(n_seqs, n_kv, head_dim), rand(n_seqs, n_kv, head_dim),
            rand(n_seqs, n_kv, max_len, head_dim), rand(n_seqs, n_kv, max_len, head_dim))


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_reference_and_writes_the_slot(window: int | None, group: int) -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(4, 2, group, 16, 40)
    lengths = torch.tensor([0, 7, 16, 39], device=DEVICE)  # empty, mid-block, block edge, last slot
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, window, block_n=16)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # same slots written, nothing else
    rows = torch.arange(4, device=DEVICE)
    assert torch.equal(k_cache[rows, :, lengths], k_new)


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_ignores_slots_past_each_length(splits: int) -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(2, 1, 2, 16, 24, seed=1)
    lengths = torch.tensor([3, 10], device=DEVICE)
    first = gqa_decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), lengths, block_n=16, splits=splits)
    k_cache[:, :, 11:] = 1e4  # garbage beyond every sequence's end (slot lengths + 1 onwards)
    v_cache[:, :, 11:] = float("nan")
    second = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, block_n=16, splits=splits)
    assert torch.equal(first, second)


@pytest.mark.parametrize(("splits", "window"), [(1, None), (2, 6), (3, None)])
def test_kernel_reads_shared_prompt_slots_from_the_prefix_row(splits: int, window: int | None) -> None:
    """Rows 1 and 2 read their first slots from row 0 (the prefill wrote equal K/V there; here
    they differ, so the test sees where each slot was read). Row 3 reads its own."""
    q, k_new, v_new, k_cache, v_cache = random_case(4, 2, 4, 16, 40, seed=2)
    lengths = torch.tensor([12, 20, 9, 30], device=DEVICE)
    prefix_rows = torch.tensor([0, 0, 0, 3], device=DEVICE)
    prefix_lengths = torch.tensor([12, 12, 12, 0], device=DEVICE)  # row 2's length is below it: clipped
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, window, block_n=16, splits=splits,
                               prefix_rows=prefix_rows, prefix_lengths=prefix_lengths)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths, window, prefix_rows, prefix_lengths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # writes go to each row's own slot
    own = gqa_decode_attention_reference(q, k_new, v_new, k_ref.clone(), v_ref.clone(), lengths, window)
    torch.testing.assert_close(out[3], own[3], rtol=1e-5, atol=1e-5)
    if window is None:
        assert not torch.allclose(out[1], own[1], atol=1e-3)  # row 1 read row 0's slots
    # With equal prompt slots (what the prefill writes), the shared read changes nothing.
    k_cache[1:3, :, :12], v_cache[1:3, :, :12] = k_cache[0, :, :12], v_cache[0, :, :12]
    shared = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, window, block_n=16, splits=splits,
                                  prefix_rows=prefix_rows, prefix_lengths=prefix_lengths)
    alone = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, window, block_n=16, splits=splits)
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="both or neither"):
        gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, prefix_rows=prefix_rows)


def test_kernel_rejects_bad_shapes() -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(2, 2, 2, 16, 8)
    lengths = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache"):
        gqa_decode_attention(q, k_new, v_new, k_cache[:, :1], v_cache, lengths)
    with pytest.raises(ValueError, match="head_dim=12"):
        gqa_decode_attention(q[..., :12], k_new[..., :12], v_new[..., :12], k_cache[..., :12].contiguous(),
                             v_cache[..., :12].contiguous(), lengths)


@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_split_kernel_matches_reference_and_writes_the_slot(splits: int, window: int | None, group: int) -> None:
    # Capacity 40, block 16: chunks of 32 (S=2) or 16 (S=3, 4; the 4th split is always empty).
    # Lengths: empty, mid-block, a chunk boundary (16; 32 for S=2), one past it, the last slot.
    q, k_new, v_new, k_cache, v_cache = random_case(6, 2, group, 16, 40, seed=5)
    lengths = torch.tensor([0, 7, 16, 17, 32, 39], device=DEVICE)
    k_one, v_one, k_ref, v_ref = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    out = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, window, block_n=16, splits=splits)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    unsplit = gqa_decode_attention(q, k_new, v_new, k_one, v_one, lengths, window, block_n=16, splits=1)
    torch.testing.assert_close(out, unsplit, rtol=1e-5, atol=1e-5)
    # The same slot written as by the unsplit kernel and the reference, nothing else touched.
    assert torch.equal(k_cache, k_one) and torch.equal(v_cache, v_one)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_split_kernel_takes_strided_views_and_more_splits_than_blocks() -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(3, 2, 2, 16, 20, seed=6)
    fused = torch.cat([q, k_new, v_new], dim=1)
    lengths = torch.tensor([2, 0, 19], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # 8 splits of a 20-slot cache in blocks of 16: chunks of 16, splits 2-7 empty everywhere.
    out = gqa_decode_attention(fused[:, :4], fused[:, 4:6], fused[:, 6:8], k_cache, v_cache, lengths,
                               block_n=16, splits=8)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_splits_fills_the_gpu_within_bounds() -> None:
    assert decode_splits(512, 8, 640, 132) == 1  # 4096 programs already fill 132 SMs
    assert decode_splits(8, 2, 8192, 132) > 1
    assert decode_splits(8, 2, 8192, 132) == 16  # 16 programs; chunks of 512 slots
    assert decode_splits(64, 8, 2048, 132) == 1  # 512 programs: about 4 per SM already
    assert decode_splits(16, 8, 4096, 132) == 8  # 128 programs: split to 1024
    assert decode_splits(1, 1, 300, 132) == 1  # a split would read chunks under 256 slots
    assert decode_splits(1, 1, 512, 132) == 2
    for n_seqs in (1, 3, 16, 100, 1024):
        for capacity in (1, 255, 1000, 4096, 1 << 20):
            splits = decode_splits(n_seqs, 4, capacity, 132)
            assert 1 <= splits <= 16 and splits & (splits - 1) == 0
            assert splits == 1 or capacity // splits >= 256


def test_auto_splits_off_cuda_is_the_unsplit_kernel() -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(2, 2, 2, 16, 12, seed=7)
    lengths = torch.tensor([5, 11], device=DEVICE)
    auto = gqa_decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), lengths, block_n=16)
    one = gqa_decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), lengths, block_n=16, splits=1)
    assert torch.equal(auto, one)


@pytest.mark.parametrize("splits", [0, -2])
def test_kernel_rejects_bad_splits(splits: int) -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(1, 1, 1, 16, 4)
    lengths = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=f"splits={splits}"):
        gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, splits=splits)


def test_kernel_choice() -> None:
    assert resolve_decode_kernel("auto", "cpu") == "sdpa"
    assert resolve_decode_kernel("triton", DEVICE) == "triton"
    assert resolve_decode_kernel("auto", DEVICE, head_dims=[8]) == "sdpa"  # tiny test models' heads
    assert resolve_decode_kernel("auto", DEVICE, head_dims=[64, 128]) == ("triton" if DEVICE == "cuda" else "sdpa")
    with pytest.raises(ValueError, match="head_dim=8 is not supported"):
        resolve_decode_kernel("triton", DEVICE, head_dims=[64, 8])
    with pytest.raises(ValueError, match="allowed: auto, triton, sdpa, matmul"):
        resolve_decode_kernel("flash", DEVICE)
    # An e4m3 cache: Triton reads it under the interpreter and on CUDA from compute capability 8.9
    # (below, Triton refuses the type and "auto" takes SDPA; the H200's run checks the CUDA side).
    e4m3 = torch.float8_e4m3fn
    assert resolve_decode_kernel("auto", "cpu", [64], e4m3) == "sdpa"
    assert resolve_decode_kernel("triton", DEVICE, [64], e4m3) == "triton"
    if DEVICE == "cuda":
        native = torch.cuda.get_device_capability() >= E4M3_MIN_CAPABILITY
        assert resolve_decode_kernel("auto", DEVICE, [64], e4m3) == ("triton" if native else "sdpa")


def tiny_model(sliding_window: int | None = None) -> Transformer:
    spec = ModelSpec(name="tiny-decode", family="mistral" if sliding_window else "llama", vocab_size=64, hidden_size=64, intermediate_size=96, n_layers=2,
                     n_heads=4, n_kv_heads=2, head_dim=16, sliding_window=sliding_window)
    torch.manual_seed(0)
    model = Transformer(spec, device=DEVICE)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_generation_with_triton_kernel_equals_sdpa(sliding_window: int | None) -> None:
    model = tiny_model(sliding_window)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 64, (n,), generator=gen).to(DEVICE) for n in (5, 9, 1)]
    greedy = SamplingParams(temperature=0.0)
    runs = {kernel: generate(model, prompts, GenerationConfig(6, greedy, decode_attention=kernel))
            for kernel in ("sdpa", "triton")}
    assert torch.equal(runs["sdpa"].tokens, runs["triton"].tokens)
    torch.testing.assert_close(runs["sdpa"].logprobs, runs["triton"].logprobs, rtol=1e-4, atol=1e-4)


def test_generation_from_shared_prompts_with_triton_kernel_equals_sdpa() -> None:
    """Samples of one prompt (rows holding one tensor): the kernel reads the prompt's slots from
    the group's first row (HeadMajorKVCache.prefix_rows), the SDPA path from each row."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    distinct = [torch.randint(1, 64, (n,), generator=gen).to(DEVICE) for n in (6, 3)]
    prompts = [p for p in distinct for _ in range(3)]
    sampled = SamplingParams(temperature=1.0)
    runs = {kernel: generate(model, prompts, GenerationConfig(5, sampled, seed=1, decode_attention=kernel))
            for kernel in ("sdpa", "triton")}
    assert torch.equal(runs["sdpa"].tokens, runs["triton"].tokens)
    torch.testing.assert_close(runs["sdpa"].logprobs, runs["triton"].logprobs, rtol=1e-4, atol=1e-4)


def test_cache_with_triton_kernel_ignores_attend_buckets() -> None:
    model = tiny_model()
    cache = HeadMajorKVCache.for_model(model, 2, 32, kernel="triton")
    cache.set_attend_len(8)
    assert cache.attend_len == 32  # the kernel reads each sequence's own length


def test_kernel_takes_strided_views() -> None:
    q, k_new, v_new, k_cache, v_cache = random_case(3, 2, 2, 16, 20, seed=4)
    # q/k/v as slices of one fused projection output [B, Hq + 2 Hkv, D], as a fused QKV would give.
    fused = torch.cat([q, k_new, v_new], dim=1)
    q_view, k_view, v_view = fused[:, :4], fused[:, 4:6], fused[:, 6:8]
    lengths = torch.tensor([2, 0, 19], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = gqa_decode_attention(q_view, k_view, v_view, k_cache, v_cache, lengths, block_n=16)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_reads_and_writes_an_fp8_cache(splits: int) -> None:
    """An e4m3 cache (GenerationConfig.kv_cache_dtype="fp8"): the kernel widens what it reads to
    the queries' dtype and rounds the new K/V into the cache. New K/V already on the e4m3 grid,
    so that the kernel's rounding and torch's cannot differ: the output equals the reference's."""
    q, k_new, v_new, k_cache, v_cache = random_case(4, 2, 4, 16, 40, seed=5)
    fp8 = torch.float8_e4m3fn
    k_new, v_new = k_new.to(fp8).float(), v_new.to(fp8).float()
    k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)
    lengths = torch.tensor([0, 7, 16, 39], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, None, block_n=16, splits=splits)
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_ref, v_ref, lengths, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache.float(), k_ref.float()) and torch.equal(v_cache.float(), v_ref.float())


def test_generation_with_an_fp8_cache_triton_equals_sdpa() -> None:
    """Shared prompts (the cascade path) and an e4m3 cache: the Triton kernel and the SDPA path
    read the same rounded K/V (each rounds the new tokens itself, hence the tolerance)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    distinct = [torch.randint(1, 64, (n,), generator=gen).to(DEVICE) for n in (6, 3)]
    prompts = [p for p in distinct for _ in range(3)]
    greedy = SamplingParams(temperature=0.0)
    runs = {kernel: generate(model, prompts, GenerationConfig(5, greedy, decode_attention=kernel, kv_cache_dtype="fp8"))
            for kernel in ("sdpa", "triton")}
    assert torch.equal(runs["sdpa"].tokens, runs["triton"].tokens)
    torch.testing.assert_close(runs["sdpa"].logprobs, runs["triton"].logprobs, rtol=1e-2, atol=1e-2)
