"""Optimizer offload on one GPU: the host link, the streamed optimizer step, and a CPU step beside it.

    python3 benchmarks/offload_bench.py            # one H200 (kind nvidia-h200)
    python3 benchmarks/offload_bench.py --tiny     # CPU, seconds: checks the script

Measures (medians of timed repeats after a warm-up):
1. pinned host <-> device copies of --copy-gib GiB: host->device, device->host, and both at once
   (the streamed step overlaps the two directions);
2. ShardedAdamW.step over --params bf16 parameters with everything on the GPU, and with
   --fraction of the state in host memory (streamed in chunks, actors.engine.optimizer_offload);
3. the alternative the issue asks to weigh: AdamW stepped on the CPU (the same elementwise
   arithmetic on fp32 host tensors, all cores) per billion parameters, plus the gradient's trip to
   the host (fp32) and the parameters' trip back (bf16) at the measured link rates.
Prints a table last; docs/benchmarks.md records it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.optimizer import AdamWConfig, ShardedAdamW  # noqa: E402
from actors.engine.optimizer_offload import HostState  # noqa: E402

GiB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--params", type=float, default=2e9, help="parameters of the optimizer step")
    parser.add_argument("--fraction", type=float, default=1.0, help="host fraction of the streamed step")
    parser.add_argument("--copy-gib", type=float, default=2.0)
    parser.add_argument("--cpu-params", type=float, default=2e8, help="elements of the CPU step measured")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def median_time(fn, repeats: int, device: torch.device) -> float:
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_rates(gib: float, repeats: int, device: torch.device) -> tuple[float, float, float]:
    """Bytes/s host->device, device->host and each direction when both run at once."""
    n = int(gib * GiB) // 4
    host = HostState(n, pin=device.type == "cuda")
    up = host.parts["master"]
    down = host.parts["exp_avg"]
    dev = torch.empty(n, dtype=torch.float32, device=device)
    dev2 = torch.empty(n, dtype=torch.float32, device=device)
    h2d = median_time(lambda: dev.copy_(up, non_blocking=True), repeats, device)
    d2h = median_time(lambda: down.copy_(dev2, non_blocking=True), repeats, device)
    both = h2d
    if device.type == "cuda":
        side = torch.cuda.Stream()

        def duplex() -> None:
            side.wait_stream(torch.cuda.current_stream())
            dev.copy_(up, non_blocking=True)
            with torch.cuda.stream(side):
                down.copy_(dev2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)

        both = median_time(duplex, repeats, device)
    host.close()
    nbytes = n * 4
    return nbytes / h2d, nbytes / d2h, nbytes / both


def optimizer_step_s(n_params: int, fraction: float, repeats: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of one ShardedAdamW step over n_params parameters (in 64 tensors)."""
    sizes = [n_params // 64] * 64
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(size, dtype=dtype, device=device))) for i, size in enumerate(sizes)]
    optimizer = ShardedAdamW(params, AdamWConfig(lr=1e-4, weight_decay=0.1), None, None, host_fraction=fraction)

    def step() -> None:
        for _, p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        optimizer.zero_grad()

    seconds = median_time(step, repeats, device)
    if optimizer.host is not None:
        optimizer.host.close()
    return seconds


def cpu_step_s_per_billion(n: int, repeats: int) -> float:
    """Seconds per 1e9 parameters of the AdamW arithmetic on fp32 host tensors (all cores)."""
    params = [("p", torch.nn.Parameter(torch.zeros(n)))]
    optimizer = ShardedAdamW(params, AdamWConfig(lr=1e-4, weight_decay=0.1, max_grad_norm=None), None, None)
    grad = torch.full((n,), 1e-3)

    def update() -> None:
        optimizer.steps_done += 1
        optimizer._update(optimizer.master, optimizer.exp_avg, optimizer.exp_avg_sq, grad, 1e-4, 0)

    return median_time(update, repeats, torch.device("cpu")) * 1e9 / n


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n_params = int(1e6 if args.tiny else args.params)
    copy_gib = 0.01 if args.tiny else args.copy_gib
    torch.set_num_threads(max(1, torch.get_num_threads()))
    h2d, d2h, duplex = link_rates(copy_gib, args.repeats, device)
    on_device = optimizer_step_s(n_params, 0.0, args.repeats, device, dtype)
    streamed = optimizer_step_s(n_params, args.fraction, args.repeats, device, dtype)
    cpu_per_b = cpu_step_s_per_billion(int(1e6 if args.tiny else args.cpu_params), args.repeats)
    billions = n_params / 1e9
    # The CPU alternative: fp32 gradients to the host, the update there, bf16 weights back.
    cpu_total = billions * (cpu_per_b + 4e9 / d2h + 2e9 / h2d)
    streamed_bytes = args.fraction * 12 * n_params  # each way
    print(f"\n{device} ({torch.cuda.get_device_name(0) if cuda else 'cpu'}), {torch.get_num_threads()} CPU threads")
    print("| what | value |\n|---|---|")
    print(f"| pinned host -> device / device -> host / each way at once | {h2d / 1e9:.1f} / {d2h / 1e9:.1f} / "
          f"{duplex / 1e9:.1f} GB/s |")
    print(f"| optimizer step, {billions:.2f}B params, all state on the GPU | {on_device:.3f} s |")
    print(f"| the same, {args.fraction:.0%} of the state in host memory, streamed | {streamed:.3f} s "
          f"(+{streamed - on_device:.3f} s; {streamed_bytes / 1e9:.1f} GB each way) |")
    print(f"| AdamW on the CPU, per 1B params (update only) | {cpu_per_b:.3f} s |")
    print(f"| CPU step for {billions:.2f}B params: update + fp32 grads down + bf16 weights up | {cpu_total:.3f} s |")


if __name__ == "__main__":
    main()
