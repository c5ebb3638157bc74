"""actors/engine/main_grad.py: a linear layer whose weight gradient is accumulated straight
into the weight's fp32 main_grad. Against float64 sums of the weight-gradient products and against
F.linear's own input and bias gradients; the CUDA path (addmm into an fp32 buffer from bf16
operands) in the gpu tier."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.engine import AdamWConfig, ModelEngine, ParallelGroups
from actors.engine.main_grad import Linear, linear, shared_input_linears
from planning.layout import Layout
from planning.models import ModelSpec

SPEC = ModelSpec("main-grad", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def two_backwards(weight: torch.Tensor, bias: torch.Tensor, inputs: list[torch.Tensor],
                  grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Input gradients of linear(x, weight, bias) for each (x, grad) pair, in order."""
    out = []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        linear(x, weight, bias).backward(g)
        out.append(x.grad)
    return out


@pytest.mark.unit
def test_weight_grads_sum_into_main_grad_and_other_grads_match_f_linear() -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 4, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    weight.main_grad = torch.zeros(6, 4, dtype=torch.float64)
    inputs = [torch.randn(2, 5, 4), torch.randn(7, 4)]
    grads = [torch.randn(2, 5, 6), torch.randn(7, 6)]
    x_grads = two_backwards(weight, bias, inputs, grads)
    expected = sum(g.reshape(-1, 6).double().t() @ x.reshape(-1, 4).double() for x, g in zip(inputs, grads))
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    assert weight.grad is None  # never materialised: the buffer holds it
    reference_weight = weight.detach().clone().requires_grad_()
    reference_bias = bias.detach().clone().requires_grad_()
    for x, g, x_grad in zip(inputs, grads, x_grads):
        x = x.clone().requires_grad_()
        F.linear(x, reference_weight, reference_bias).backward(g)
        torch.testing.assert_close(x_grad, x.grad)
    torch.testing.assert_close(bias.grad, reference_bias.grad)


@pytest.mark.unit
def test_without_main_grad_or_without_grad_mode_it_is_f_linear() -> None:
    torch.manual_seed(0)
    layer = Linear(4, 3, bias=False)
    x = torch.randn(5, 4)
    layer(x).sum().backward()
    assert layer.weight.grad is not None  # plain autograd: no buffer attached
    layer.weight.main_grad = torch.zeros(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert layer.weight.main_grad.abs().sum() == 0


@pytest.mark.unit
def test_the_optimizer_attaches_main_grad_only_while_accumulating() -> None:
    groups = ParallelGroups(Layout(), 0, 0, 0, None, None, None, None, None, (0,), (0,))
    engine = ModelEngine(SPEC, False, groups, "cpu", dtype=torch.bfloat16, seed=0, optim_config=AdamWConfig(lr=0.0))
    q_proj = engine.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, Linear)
    with engine.optimizer.fp32_accumulation():
        view = q_proj.weight.main_grad
        assert view.dtype == torch.float32 and view.shape == q_proj.weight.shape
        assert view.data_ptr() == engine.optimizer.grad_of("model.layers.0.self_attn.q_proj.weight").data_ptr()
    assert not hasattr(q_proj.weight, "main_grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_weight_grads_accumulate_in_the_gemm_into_fp32() -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight.main_grad = torch.zeros(256, 128, device="cuda")
    inputs = [torch.randn(300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads = [torch.randn(300, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    two_backwards(weight, None, inputs, grads)
    expected = sum(g.double().t() @ x.double() for x, g in zip(inputs, grads))
    torch.testing.assert_close(weight.main_grad.double(), expected, rtol=1e-5, atol=1e-3)
    assert weight.grad is None


def separate_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                     grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor | None],
                                                         list[torch.Tensor | None]]:
    """(outputs, input grad, weight grads, bias grads) of F.linear per weight, through autograd."""
    x = x.detach().clone().requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in weights]
    biases = [None if b is None else b.detach().clone().requires_grad_() for b in biases]
    outs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    torch.autograd.backward(outs, grads)
    return outs, x.grad, [w.grad for w in weights], [None if b is None else b.grad for b in biases]


@pytest.mark.unit
@pytest.mark.parametrize("with_main_grad", [False, True])
def test_shared_input_linears_match_separate_layers_with_one_input_gradient(with_main_grad: bool) -> None:
    torch.manual_seed(0)
    layers = [Linear(8, 12, bias=True), Linear(8, 4, bias=True), Linear(8, 4, bias=False)]  # q, k, v
    if with_main_grad:
        for layer in layers:
            layer.weight.main_grad = torch.zeros_like(layer.weight)
    x = torch.randn(3, 5, 8, requires_grad=True)
    outs = shared_input_linears(x, layers)
    assert len({out.grad_fn for out in outs}) == 1  # one autograd node for the three products
    grads = [torch.randn_like(out) for out in outs]
    torch.autograd.backward(outs, grads)
    ref_outs, ref_x_grad, ref_w_grads, ref_b_grads = separate_linears(
        x, [layer.weight for layer in layers], [layer.bias for layer in layers], grads)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_x_grad)
    for layer, w_grad, b_grad in zip(layers, ref_w_grads, ref_b_grads):
        if with_main_grad:
            assert layer.weight.grad is None
            torch.testing.assert_close(layer.weight.main_grad, w_grad)
        else:
            torch.testing.assert_close(layer.weight.grad, w_grad)
        if b_grad is not None:
            torch.testing.assert_close(layer.bias.grad, b_grad)


@pytest.mark.unit
def test_shared_input_linears_call_each_layer_without_grad_mode_or_for_other_layers() -> None:
    torch.manual_seed(0)
    layers = [Linear(6, 3, bias=False), torch.nn.Linear(6, 2)]  # torch's own Linear: not known to read x as is
    x = torch.randn(4, 6, requires_grad=True)
    outs = shared_input_linears(x, layers)
    assert outs[0].grad_fn is not outs[1].grad_fn
    with torch.no_grad():
        plain = shared_input_linears(x, layers[:1])
    assert plain[0].grad_fn is None
    torch.testing.assert_close(plain[0], F.linear(x, layers[0].weight))


@pytest.mark.unit
def test_serial_tp_layers_read_their_input_as_is() -> None:
    # Without a tp group every tp layer is a plain linear map (tp > 1: test_tp_regions_dist.py).
    from actors.engine.tp_layers import ColumnParallelLinear, ReplicatedLinear

    assert ColumnParallelLinear(8, 8, False, None, device="meta", gather_output=True).reads_input_as_is()
    assert ReplicatedLinear(8, 8, False, None, device="meta").reads_input_as_is()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_shared_input_gradient_matches_separate_layers() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(n, 256, device="cuda", dtype=torch.bfloat16) / 16 for n in (512, 128, 128)]
    layers = []
    for w in weights:
        layer = Linear(256, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        layer.weight.data.copy_(w)
        layer.weight.main_grad = torch.zeros(w.shape, device="cuda")
        layers.append(layer)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = shared_input_linears(x, layers)
    grads = [torch.randn_like(out) for out in outs]
    torch.autograd.backward(outs, grads)
    expected = sum(g.double() @ w.double() for g, w in zip(grads, weights))
    torch.testing.assert_close(x.grad.double(), expected, rtol=2e-2, atol=2e-2)
    for layer, g in zip(layers, grads):
        torch.testing.assert_close(layer.weight.main_grad.double(), g.double().t() @ x.detach().double(),
                                   rtol=1e-4, atol=1e-2)
