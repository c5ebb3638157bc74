"""Decode-step projections in bf16 against FP8 (e4m3, row-wise scales) at the peer bench's shapes.

At 512 rows a decode step of the 1B model is compute-bound in bf16 (docs/benchmarks.md, issue 27,
fifth step): its projections alone take ~2 ms of the ~4.2 ms step. This script measures what FP8
weights with per-row activation scales (`torch._scaled_mm`, the path an FP8 rollout would take)
buy at those shapes, with and without the activation's quantization, before any of it is built.

    python3 benchmarks/fp8_gemm_bench.py                 # GPU (sm_89+), rows 512 and 256
    python3 benchmarks/fp8_gemm_bench.py --cpu --rows 8  # functional check (emulated FP8)

Every timing is the median of --repeats CUDA-graph replays of --inner launches, so launch
overhead stays out of it; the table prints TFLOP/s and the FP8/bf16 time ratio per projection,
then the sum over one step's projections of the 16 layers and the LM head.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from actors.generation.fp8_weights import Fp8Weight, fp8_linear, quantize_rows

# (name, out, in, per step): Llama-3.2-1B's projections; gate and up fused as one GEMM.
SHAPES = (("qkv", 3072, 2048, 16), ("o", 2048, 2048, 16), ("gate_up", 16384, 2048, 16),
          ("down", 2048, 8192, 16), ("lm_head", 128256, 2048, 1))


def fp8_mm(x8: Tensor, x_scale: Tensor, weight: Fp8Weight, fast: bool) -> Tensor:
    """The product alone, activation already quantized: x8 [M, K] -> bf16 [M, N] (as
    actors.generation.fp8_weights.fp8_linear runs it, with the accumulation mode a knob here);
    emulated in float32 off CUDA."""
    if x8.device.type != "cuda":
        return ((x8.float() * x_scale) @ (weight.q.float() * weight.scale).t()).to(torch.bfloat16)
    return torch._scaled_mm(x8, weight.q.t(), scale_a=x_scale, scale_b=weight.scale.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


def time_ms(fn: Callable[[], Tensor], inner: int, repeats: int, cuda: bool) -> float:
    """Median milliseconds of one fn() call."""
    if not cuda:
        fn()
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def bench_shape(rows: int, out_f: int, in_f: int, device: torch.device, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of one projection four ways (bf16; FP8 matmul alone, exact and fast
    accumulation; FP8 with the activation's quantization, compiled)."""
    cuda = device.type == "cuda"
    x = torch.randn(rows, in_f, device=device, dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) * 0.02
    weight = Fp8Weight.of(w)
    x8, x_scale = quantize_rows(x)
    # The engine's own product (quantization of x included), compiled as a decode step would be.
    quant_mm = torch.compile(lambda a: fp8_linear(a, weight)) if cuda else (lambda a: fp8_linear(a, weight))
    with torch.no_grad():
        ref = F.linear(x, w).float()
        err = (fp8_mm(x8, x_scale, weight, True).float() - ref).norm() / ref.norm()
        return {
            "bf16": time_ms(lambda: F.linear(x, w), args.inner, args.repeats, cuda),
            "fp8": time_ms(lambda: fp8_mm(x8, x_scale, weight, False), args.inner, args.repeats, cuda),
            "fp8_fast": time_ms(lambda: fp8_mm(x8, x_scale, weight, True), args.inner, args.repeats, cuda),
            "fp8_quant": time_ms(lambda: quant_mm(x), args.inner, args.repeats, cuda),
            "rel_err": float(err),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="functional check on CPU (no timings)")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 256])
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__)
    lines = ["| rows | proj | bf16 ms | TFLOP/s | fp8 ms | fp8 fast ms | fp8+quant ms | fast/bf16 | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rows in args.rows:
        totals = dict.fromkeys(("bf16", "fp8", "fp8_fast", "fp8_quant"), 0.0)
        for name, out_f, in_f, per_step in SHAPES:
            t = bench_shape(rows, out_f, in_f, device, args)
            for key in totals:
                totals[key] += t[key] * per_step
            tflops = 2 * rows * out_f * in_f / (t["bf16"] * 1e-3) / 1e12
            lines.append(f"| {rows} | {name} | {t['bf16']:.4f} | {tflops:.0f} | {t['fp8']:.4f} | {t['fp8_fast']:.4f} "
                         f"| {t['fp8_quant']:.4f} | {t['fp8_fast'] / t['bf16']:.2f} | {t['rel_err']:.4f} |")
        lines.append(f"| {rows} | step | {totals['bf16']:.3f} | | {totals['fp8']:.3f} | {totals['fp8_fast']:.3f} "
                     f"| {totals['fp8_quant']:.3f} | {totals['fp8_fast'] / totals['bf16']:.2f} | |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
