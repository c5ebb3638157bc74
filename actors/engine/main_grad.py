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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


__all__ = ["Linear", "accumulate_weight_grad", "attach_main_grads", "linear"]
