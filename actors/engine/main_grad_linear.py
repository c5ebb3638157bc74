"""Linear layers whose weight gradient is accumulated straight into the optimizer's fp32 main grad.

Training sums the gradient of each bf16 weight over micro-batches in an fp32 buffer (the
optimizer's `main_grad`, actors/engine/optimizer.py). Through plain autograd every micro-batch
writes a bf16 weight gradient to `.grad` and a hook then adds it into the fp32 buffer: one
mixed-dtype elementwise pass per weight and micro-batch, and a rounding to bf16 before the sum
(at the peer bench's shape, 2,336 such adds and 87 ms of a 3.9 s step on an H200).
Megatron's "gradient accumulation fusion" instead lets the weight-gradient GEMM add its fp32
product into the buffer in its epilogue; here that is `torch.addmm(main, dY^T, X, out_dtype=fp32,
out=main)` on CUDA.

While the optimizer accumulates (`ShardedAdamW.fp32_accumulation`), each low-precision parameter
carries its fp32 view of the buffer as `param.main_grad` (Megatron's attribute). `linear(x, w, b)`
is F.linear when `w` has none (inference, CPU fp32 training) and otherwise an autograd function
whose backward accumulates the weight gradient into `w.main_grad` and returns none for `w` (so
`.grad` and the hook are skipped for it); the input and bias gradients are the usual ones.
"""

from __future__ import annotations

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


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear` above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


__all__ = ["Linear", "accumulate_weight_grad", "linear"]
