"""The optimizer's fp32 main gradient, and the two ways gradients reach it.

Training sums the gradient of each bf16 parameter over micro-batches in an fp32 buffer (the
optimizer's `main_grad`, actors/engine/optimizer.py; a bf16 `.grad` would round the running sum
after every micro-batch). While it accumulates (`attach_main_grads`), each such parameter
carries its fp32 view of the buffer as `param.main_grad` (Megatron's attribute), and:

* the linear layers (`Linear`, `linear`; the tp layers call `linear` too) add their weight
  gradient into it inside the GEMM: `torch.addmm(main, dY^T, X, out_dtype=fp32, out=main)` on
  CUDA, Megatron's "gradient accumulation fusion". Their backward returns no gradient for the
  weight, so `.grad` and the hook below never run for it. Through plain autograd each micro-batch
  wrote a bf16 weight gradient and the hook added it in: at the peer bench's shape 2,336
  mixed-dtype adds, 87 ms of a 3.9 s step on an H200;
* every other parameter (the embedding, a tied head, norms, biases) gets its `.grad` from
  autograd, which a post-accumulate-grad hook adds into its view and frees.

`linear(x, w, b)` is plain F.linear when `w` has no main_grad (inference, fp32 training on CPU).

Projections that read one input (q, k and v; gate and up) run through `shared_input_linears`
while gradients are recorded: its backward writes the input's gradient with one GEMM and adds
the others' into it in place (`addmm_`, beta = 1: the add happens in the GEMM's epilogue),
where autograd would write one gradient per projection and sum them with separate add kernels
(at the peer bench's shape ~3 adds of [T, H] per layer and micro-batch, ~80 ms of a 3.7 s step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def accumulate_weight_grad(main_grad: Tensor, grad_out: Tensor, x: Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_out^T @ x, grad_out [N, out] and x [N, in] in the
    training dtype; on CUDA in the GEMM's epilogue, elsewhere through an fp32 product."""
    if main_grad.is_cuda and grad_out.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_out.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_out.t().to(main_grad.dtype), x.to(main_grad.dtype))


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
        accumulate_weight_grad(weight.main_grad, grad_2d, x.reshape(-1, x.shape[-1]))
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, with the weight gradient accumulated into `weight.main_grad` when it has one and
    gradients are being recorded (module docstring)."""
    if weight.requires_grad and torch.is_grad_enabled() and getattr(weight, "main_grad", None) is not None:
        return _LinearIntoMainGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _SharedInputLinears(torch.autograd.Function):
    """[F.linear(x, w_i, b_i)] for one input x [..., in]: weight gradients into main_grad where a
    weight has one (else returned), the input's gradient sum_i dY_i W_i accumulated in place."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, n: int,
                *params: Tensor | None) -> tuple[Tensor, ...]:
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.n, ctx.has_bias = n, [b is not None for b in biases]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        n, needs = ctx.n, ctx.needs_input_grad
        x_2d = x.reshape(-1, x.shape[-1])  # [N, in]
        grad_x: Tensor | None = None
        weight_grads: list[Tensor | None] = []
        bias_grads: list[Tensor | None] = []
        for i, (weight, grad) in enumerate(zip(weights, grads)):
            grad_2d = grad.reshape(-1, grad.shape[-1])  # [N, out_i]
            weight_grads.append(_weight_grad(weight, grad_2d, x_2d) if needs[2 + i] else None)
            bias_grads.append(grad_2d.sum(0) if ctx.has_bias[i] and needs[2 + n + i] else None)
            if needs[0]:
                # [N, in]: the first product written, the next ones added by the GEMM itself.
                grad_x = grad_2d @ weight if grad_x is None else grad_x.addmm_(grad_2d, weight)
        grad_x = grad_x.view_as(x) if grad_x is not None else None
        return grad_x, None, *weight_grads, *bias_grads


def _weight_grad(weight: Tensor, grad_2d: Tensor, x_2d: Tensor) -> Tensor | None:
    """Into weight.main_grad where it has one (None returned), else dW [out, in] = dY^T X."""
    if getattr(weight, "main_grad", None) is not None:
        accumulate_weight_grad(weight.main_grad, grad_2d, x_2d)
        return None
    return grad_2d.t() @ x_2d


def shared_input_linears(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
    """[layer(x) for layer in layers], through one autograd node when every layer is a plain
    linear map of x (`reads_input_as_is()`: this module's `Linear`, the tp layers inside a tp
    region) and gradients are recorded (module docstring); else each layer is called."""
    plain = all(getattr(layer, "reads_input_as_is", None) is not None and layer.reads_input_as_is()
                for layer in layers)
    if not (plain and torch.is_grad_enabled()):
        return [layer(x) for layer in layers]
    params = [layer.weight for layer in layers] + [layer.bias for layer in layers]
    return list(_SharedInputLinears.apply(x, len(layers), *params))


@contextmanager
def attach_main_grads(views: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """For each (parameter, its fp32 view of the buffer): set `param.main_grad` and hook `.grad`
    into it, for the length of the context."""
    handles = [p.register_post_accumulate_grad_hook(_mover(view)) for p, view in views]
    for p, view in views:
        p.main_grad = view
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p, _ in views:
            del p.main_grad


def _mover(target: Tensor) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook adding a parameter's .grad into `target` (fp32, same shape)
    and freeing it, so the next backward starts a fresh low-precision gradient."""

    def hook(param: Tensor) -> None:
        if param.grad is not None:
            target.add_(param.grad)
            param.grad = None

    return hook


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear` above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def reads_input_as_is(self) -> bool:
        """forward(x) is linear(x, weight, bias) (shared_input_linears)."""
        return True


__all__ = ["Linear", "accumulate_weight_grad", "attach_main_grads", "linear", "shared_input_linears"]
