"""actors/engine/fusion.py on CPU (inductor's C++ kernels): a fused function compiles one graph per
static signature and none per token count, also for the shared-prefix merge, whose lse inputs are
slices `lse[:, n_prompt:]` with a stride and offset that change with every micro-batch (a static
stride there recompiled per micro-batch size and slowed the 0.5B fidelity run, ninth step). Values
equal the eager functions'."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from actors.engine.fusion import fused
from actors.engine.model import add_rms_norm
from actors.engine.rotary import apply_rotary
from actors.engine.shared_prefix_attention import merge_partials

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 16


def rotary_inputs(tokens: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, heads, HEAD_DIM), torch.randn(tokens, HEAD_DIM), torch.randn(tokens, HEAD_DIM)


def merge_inputs(tokens: int, prompt: int) -> tuple[torch.Tensor, ...]:
    """As the cascade passes them: the self part's rows after the prompt, sliced from [T, H, D]
    and [H, T]; the cross part whole."""
    out, lse = torch.randn(tokens, HEADS, HEAD_DIM), torch.randn(HEADS, tokens)
    rest = tokens - prompt
    return out[prompt:], lse[:, prompt:], torch.randn(rest, HEADS, HEAD_DIM), torch.randn(HEADS, rest)


def as_tuple(result: object) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def check(fn: Callable[..., object], args: tuple) -> None:
    """fused(fn) equals fn on args (the merge names its token dims: lse are [heads, tokens])."""
    token_dims = (0, 1, 0, 1) if fn is merge_partials else None
    for got, want in zip(as_tuple(fused(fn, token_dims)(*args)), as_tuple(fn(*args))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_new_token_counts_and_prompt_offsets_reuse_the_compiled_graphs() -> None:
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN)
    warm, later = ((40, 7), (52, 11)), ((33, 5), (61, 20), (47, 9))
    for stance_tokens in (warm, later):
        stance = "fail_on_recompile" if stance_tokens is later else "default"
        with torch.compiler.set_stance(stance):
            for tokens, prompt in stance_tokens:
                check(apply_rotary, rotary_inputs(tokens, HEADS))  # q and k: two static graphs
                check(apply_rotary, rotary_inputs(tokens, KV_HEADS))
                check(add_rms_norm, (torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN), weight, 1e-6))
                check(merge_partials, merge_inputs(tokens, prompt))


def test_backward_through_a_fused_function_matches_eager() -> None:
    torch.manual_seed(0)
    x, cos, sin = rotary_inputs(30, HEADS)
    leaf = x.clone().requires_grad_()
    fused(apply_rotary)(leaf, cos, sin).pow(2).sum().backward()
    reference = x.clone().requires_grad_()
    apply_rotary(reference, cos, sin).pow(2).sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-5)
