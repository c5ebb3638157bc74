"""The fused sampling kernel (actors.kernels.fused_sampling) against its torch twin: greedy (first
maximum, plain-softmax logprob) and inverse-CDF sampling with a temperature, rows longer than one
block, and the twin's agreement with sample_logits. Without CUDA the kernel runs in Triton's
interpreter (tests/conftest.py), so rows stay short."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.generation.sampling import SamplingParams, sample_logits  # noqa: E402
from actors.kernels.fused_sampling import sample_rows, sample_rows_reference  # noqa: E402
from actors.kernels.switch import triton_runs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_runs(DEVICE), reason="Triton cannot run here")


def logits_and_uniforms(n_rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    return logits.to(DEVICE), torch.rand(n_rows, generator=gen).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("vocab", [7, 64, 100])  # inside one block, exactly blocks, a ragged last block
def test_greedy_matches_twin(vocab: int) -> None:
    logits, _ = logits_and_uniforms(6, vocab)
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie: the first maximum wins
    logits[1, 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across chunks (when several)
    tokens, logprobs = sample_rows(logits, 0.0, None, block=16, max_chunks=4)
    ref_tokens, ref_logprobs = sample_rows_reference(logits, 0.0, None)
    assert torch.equal(tokens, ref_tokens) and tokens[0] == 3 and tokens[1] == 2
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


@needs_triton
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_matches_twin(temperature: float) -> None:
    logits, uniforms = logits_and_uniforms(32, 100, seed=1)
    ref_tokens, ref_logprobs = sample_rows_reference(logits, temperature, uniforms)
    for max_chunks in (1, 3, 16):  # one chunk per row, a ragged split, one chunk per block
        tokens, logprobs = sample_rows(logits, temperature, uniforms, block=16, max_chunks=max_chunks)
        assert torch.equal(tokens, ref_tokens), max_chunks
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


def test_twin_is_an_exact_inverse_cdf() -> None:
    logits, uniforms = logits_and_uniforms(200, 12, seed=2)
    tokens, logprobs = sample_rows_reference(logits, 0.5, uniforms)
    probs = torch.softmax(logits.float() / 0.5, dim=-1)
    cdf = probs.cumsum(-1)
    below = cdf.gather(-1, tokens[:, None]).squeeze(-1) - probs.gather(-1, tokens[:, None]).squeeze(-1)
    # u falls in the chosen token's CDF interval [cdf before it, cdf through it).
    assert torch.all(below <= uniforms + 1e-6) and torch.all(uniforms < cdf.gather(-1, tokens[:, None]).squeeze(-1) + 1e-6)
    torch.testing.assert_close(logprobs, probs.gather(-1, tokens[:, None]).squeeze(-1).log())


def test_sample_logits_uses_the_twin_without_truncation() -> None:
    logits, uniforms = logits_and_uniforms(5, 30, seed=3)
    sampled = sample_logits(logits, SamplingParams(temperature=0.8), uniforms)
    tokens, logprobs = sample_rows_reference(logits, 0.8, uniforms)
    assert torch.equal(sampled.tokens, tokens) and torch.equal(sampled.logprobs, logprobs)
    assert torch.all(sampled.kept_counts == 30)
    greedy = sample_logits(logits, SamplingParams(temperature=0.0), None)
    assert torch.equal(greedy.tokens, logits.argmax(-1)) and torch.all(greedy.kept_counts == 1)


@needs_triton
def test_kernel_rejects_bad_uniforms() -> None:
    logits, uniforms = logits_and_uniforms(4, 10)
    with pytest.raises(ValueError, match="uniforms"):
        sample_rows(logits, 1.0, uniforms[:3])
