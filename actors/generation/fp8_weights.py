"""FP8 copies of the MLP and output-head weights for decode steps (GenerationConfig.fp8_weights).

At the peer bench's 512 rows a 1B model's decode step is compute-bound in bf16: its projections
take ~2 ms of a ~4.2 ms step (docs/benchmarks.md, issue 27). On an H200 the MLP's [gate; up]
GEMM runs in 0.61x of its bf16 time with e4m3 operands, the down projection in 0.74x and the LM
head in 0.48x; q/k/v and o do not gain at these sizes (benchmarks/fp8_gemm_bench.py), so they
stay bf16. Only decode steps use the copies: prefill and every training or inference call keep
the bf16 weights, so the sampling distribution is the FP8 model's while the trainer's logprobs
are bf16; `ppo.rollout_is` corrects the gap (truncated importance sampling, actors.rl.importance).

Scaling: each weight row (output channel) gets its own float32 scale (amax / 448), and each
activation row its own, computed per step (dynamic). On CUDA with compute capability >= 8.9 the
product runs in `torch._scaled_mm` (fast accumulation); elsewhere it is emulated in float32 with
the same quantized operands, which is how the CPU tests see the same numbers up to summation
order.

    weights = Fp8DecodeWeights(model)       # once per generation call, after the weights settle
    cache.fp8 = weights                     # the model's decode steps then call weights.mlp / .head
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors.engine import reduce_from_tp_region
from actors.kernels import e4m3_native

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12
# torch._scaled_mm needs both dims of the weight to be multiples of 16; a weight that is not
# (an odd vocabulary slice) keeps its bf16 copy, on every device alike.
FP8_ALIGN = 16


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 operands in hardware (CUDA compute capability >= 8.9)."""
    return e4m3_native(device)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA GPU without FP8 matmuls: there the product would run the float32 emulation,
    dequantizing every weight each step (slower than bf16, and 4 bytes a weight at a time). The
    planner refuses such a GPU preset first (app.config); this catches a cluster.gpu that names
    another GPU than the one that runs."""
    if device.type == "cuda" and not fp8_matmul_supported(device):
        raise ValueError(fp8_gpu_error(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)))


def fp8_gpu_error(name: str, capability: tuple[int, int]) -> str:
    major, minor = capability
    return (f"sampling.fp8 (GenerationConfig.fp8_weights): {name} (compute capability {major}.{minor}) has no FP8 "
            "matmuls, which need >= 8.9; set sampling.fp8: false on this GPU")


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scale [R, 1]) with x ~= q * scale, one scale per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [N, K] as e4m3 `q` [N, K] and float32 `scale` [N, 1] (weight ~= q * scale)."""

    q: Tensor
    scale: Tensor

    @staticmethod
    def of(weight: Tensor) -> Fp8Weight:
        q, scale = quantize_rows(weight.detach())
        return Fp8Weight(q, scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def fp8_linear(x: Tensor, weight: Fp8Weight, hardware: bool | None = None) -> Tensor:
    """x [T, K] @ weight^T -> [T, N] in x's dtype, x quantized per row for this product.
    hardware: run `torch._scaled_mm` (None: ask `fp8_matmul_supported`; callers inside a decode
    step pass the answer they got once, so torch.compile never traces the device query)."""
    x8, x_scale = quantize_rows(x)
    if fp8_matmul_supported(x.device) if hardware is None else hardware:
        # mat2 must be column-major: q [N, K] row-major transposed is. Scales [T, 1] and [1, N].
        return torch._scaled_mm(x8, weight.q.t(), scale_a=x_scale, scale_b=weight.scale.t(), out_dtype=x.dtype,
                                use_fast_accum=True)
    return ((x8.float() * x_scale) @ (weight.q.float() * weight.scale).t()).to(x.dtype)


@dataclass(frozen=True)
class Fp8MLP:
    """One layer's SwiGLU MLP in FP8: [gate; up] as one weight [2F_local, H], down [H, F_local].
    `group`: the tp group the down projection's partial sums are reduced over (None: serial)."""

    gate_up: Fp8Weight
    down: Fp8Weight
    group: object
    hardware: bool  # fp8_matmul_supported on the weights' device

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = fp8_linear(x, self.gate_up, self.hardware).chunk(2, dim=-1)
        return reduce_from_tp_region(fp8_linear(F.silu(gate) * up, self.down, self.hardware), self.group)


class Fp8DecodeWeights:
    """Every layer's FP8 MLP and the FP8 head of `model` (a `Transformer` or pipeline stage),
    quantized from its current weights when built. Build it once per generation call: the
    optimizer changes the bf16 weights in place between calls, so a kept copy would go stale."""

    def __init__(self, model: nn.Module) -> None:
        # The model's MLPs are bias-free (actors.engine.model.MLP), so no bias is carried here.
        device = next(model.parameters()).device
        check_fp8_device(device)
        self.hardware = fp8_matmul_supported(device)
        with torch.no_grad():
            self.mlps: dict[int, Fp8MLP] = {
                int(idx): Fp8MLP(Fp8Weight.of(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])),
                                 Fp8Weight.of(layer.mlp.down_proj.weight), getattr(layer.mlp.down_proj, "group", None),
                                 self.hardware)
                for idx, layer in model.model.layers.items() if aligned(layer.mlp.down_proj.weight)
            }
            head = head_weight(model)
            self.head_weight = Fp8Weight.of(head) if head is not None else None

    @staticmethod
    def sources(model: nn.Module) -> list[Tensor]:
        """The bf16 weights of `model` that get FP8 copies: every aligned MLP's gate, up and down,
        and the head's weight when it is aligned."""
        weights = [part.weight for layer in model.model.layers.values() if aligned(layer.mlp.down_proj.weight)
                   for part in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        head = head_weight(model)
        return weights + ([head] if head is not None else [])

    @staticmethod
    def nbytes(model: nn.Module) -> int:
        """Bytes the copies take: one byte per weight element plus a float32 scale per row."""
        return sum(w.numel() + 4 * w.shape[0] for w in Fp8DecodeWeights.sources(model))

    def mlp(self, layer: int, x: Tensor) -> Tensor | None:
        fp8_mlp = self.mlps.get(layer)
        return fp8_mlp(x) if fp8_mlp is not None else None

    def head(self, hidden: Tensor) -> Tensor | None:
        """Logits [T, V_local] of this rank's vocab slice (never gathered, as the bf16 head)."""
        return fp8_linear(hidden, self.head_weight, self.hardware) if self.head_weight is not None else None


def aligned(weight: Tensor) -> bool:
    """Both dims multiples of FP8_ALIGN (a down projection's [H, F_local] decides for its MLP:
    gate and up are [F_local, H])."""
    return weight.shape[0] % FP8_ALIGN == 0 and weight.shape[1] % FP8_ALIGN == 0


def head_weight(model: nn.Module) -> Tensor | None:
    """The actor head's weight [V_local, H] (the embedding table when tied), None on a stage
    without a head, a critic, or a head that is not FP8_ALIGN-aligned."""
    if not getattr(model, "has_head", False) or getattr(model, "critic", False):
        return None
    # Tied: the embedding table (under tp the head is a TiedVocabParallelHead over that table,
    # which owns no parameter; either way the rows are this rank's vocab slice).
    if model.lm_head is not None and not model.spec.tie_embeddings:
        weight = model.lm_head.weight
    else:
        weight = model.model.embed_tokens.weight
    return weight if aligned(weight) else None


__all__ = ["FP8", "FP8_MAX", "Fp8DecodeWeights", "Fp8MLP", "Fp8Weight", "check_fp8_device", "fp8_gpu_error",
           "fp8_linear", "fp8_matmul_supported", "quantize_rows"]
