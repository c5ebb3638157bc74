"""The Triton GEMM for decode-sized batches (actors.kernels.skinny_matmul) against cuBLAS (F.linear).

Times y = x W^T for the projections of a decode step: a 1B Llama (fused qkv, o, gate/up, down, and
the vocabulary head, which `linear` leaves to cuBLAS) and an 8B Llama's, at M = 128 ... 1024 rows.
Each product cycles through 16 copies of its weight, as a decode step reads 16 layers' weights,
so the weight comes from HBM and not from L2. The calls are captured in a CUDA graph (as a decode
step runs them; Triton's Python launch path costs ~50 us a call, more than these products) after
the kernel's tuning (first call of each shape), and the graph's replays are timed. Prints us per call, TFLOP/s, the weight-streaming
bound and the speed-up, and checks the two agree (bf16 tolerance).

    python3 benchmarks/skinny_matmul_bench.py [--rows 128,256,512,1024] [--reps 20]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from actors.kernels.skinny_matmul import skinny_linear

PEAK_FLOPS = 785e12  # measured bf16 matmul on the H200
HBM_BYTES_PER_S = 4.3e12
SHAPES = {  # name -> (N, K)
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate|up": (8192, 2048), "1b down": (2048, 8192),
    "1b head": (128256, 2048),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate|up": (14336, 4096), "8b down": (4096, 14336),
}
COPIES = 16


def time_us(fn: object, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights:  # tuning and warm-up, off the capturing stream
            fn(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="128,256,512,1024")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    lines = []
    with torch.no_grad():
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                err = (skinny_linear(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
                cublas = time_us(F.linear, x, weights, args.reps)
                triton_us = time_us(skinny_linear, x, weights, args.reps)
                flops, stream_us = 2 * m * n * k, n * k * 2 / HBM_BYTES_PER_S * 1e6
                lines.append(f"{name:<11} {m:>5} {cublas:>9.1f} {triton_us:>9.1f} {flops / cublas / 1e6:>10.0f} "
                             f"{flops / triton_us / 1e6:>11.0f} {stream_us:>9.1f} {cublas / triton_us:>8.2f}x {err:>8.3f}")
                print(lines[-1], flush=True)
            del weights
    print(f"\ny = x W^T, bf16, {torch.cuda.get_device_name(0)}, {COPIES} weight copies per shape "
          f"(peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s, HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s)")
    print(f"{'shape':<11} {'rows':>5} {'cuBLAS us':>9} {'Triton us':>9} {'cuBLAS TF/s':>10} {'Triton TF/s':>11} "
          f"{'stream us':>9} {'speed-up':>9} {'max diff':>8}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
