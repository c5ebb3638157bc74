"""The bf16 matmul rate a GPU sustains, second by second, against its first-second burst.

The ceilings this project reports against (785 TFLOP/s bf16 matmul on an H200) were measured in
short bursts. Under minutes of load the H200 holds its 700 W power limit by lowering its SM clock
(run_gpu.sh's gpu_clocks.csv shows `sw_power_cap` active in most busy samples of a training call,
at 1575-1815 MHz against 1980), so a long call runs against a lower ceiling. This script keeps
one square GEMM busy for --seconds and prints the TFLOP/s of every second; with run_gpu.sh's
clock sampler beside it (ONLY=sustained) the clocks explain the curve.

    python3 benchmarks/sustained_gemm.py --seconds 30           # GPU: n = 8192, bf16
    python3 benchmarks/sustained_gemm.py --cpu --n 256 --seconds 2   # functional check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def run(n: int, seconds: float, device: torch.device, dtype: torch.dtype, batch: int) -> list[float]:
    """TFLOP/s of each whole second of back-to-back n x n x n matmuls (batches of `batch`
    launches between synchronisations)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    flops = 2.0 * n**3

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b, out=out)  # cuBLAS picks its kernel before the clock starts
    sync()
    rates: list[float] = []
    start = second_start = time.perf_counter()
    done = 0
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        sync()
        done += batch
        now = time.perf_counter()
        if now - second_start >= 1.0:
            rates.append(done * flops / (now - second_start) / 1e12)
            second_start, done = now, 0
    return rates


def report(rates: list[float], n: int, device_name: str) -> str:
    if not rates:
        return "no whole second measured: raise --seconds"
    steady = statistics.median(rates[len(rates) // 2:])
    summary = (f"first second {rates[0]:.1f}, best {max(rates):.1f}, median of the second half {steady:.1f} "
               f"({steady / max(rates):.1%} of the best)")
    return "\n".join([f"sustained bf16 GEMM, n={n}, {device_name}: TFLOP/s per second",
                      " ".join(f"{r:.0f}" for r in rates), summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--n", type=int, default=8192, help="matrix size (n x n x n per matmul)")
    parser.add_argument("--batch", type=int, default=20, help="matmuls between synchronisations")
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU: checks the script")
    args = parser.parse_args(argv)
    if args.n < 1 or args.seconds <= 0 or args.batch < 1:
        parser.error(f"--n={args.n}, --seconds={args.seconds}, --batch={args.batch}: all must be positive")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --cpu for the functional check")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    name = "CPU" if args.cpu else torch.cuda.get_device_name(device)
    print(report(run(args.n, args.seconds, device, dtype, args.batch), args.n, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
