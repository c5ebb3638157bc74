"""Benchmark the multi-copy kernel of actors.kernels.segment_copy against torch copies on one GPU.

Two workloads in bf16, each timed (CUDA events, median of repetitions) with one launch of the
kernel per tile shape and with one torch `copy_` per copy (what the reallocation executor did
before the kernel):
  dense    one contiguous 1 GiB copy (the HBM copy ceiling);
  halves   the copies a GPU makes in a tp2 -> pp2 reallocation of 8 Llama-3.2-1B layers: each
           tp shard of q/k/v/gate/up (dim-0 halves: contiguous) and o/down (dim-1 halves: rows
           of half the destination's width) from its own source tensor into one flat buffer.
Bandwidth counts bytes read plus bytes written.

    python benchmarks/segment_copy_bench.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.kernels.segment_copy import (
    Copy2D,
    CopyTable,
    copy_reference,
    launch_copies,
    resolve_fields,
    source_deltas,
)  # noqa: E402

TILES = [(16, 256, 4), (32, 256, 4), (32, 512, 8)]
PROGRAMS = [128, 264, 1024]


def _dense(device: torch.device) -> tuple[list[torch.Tensor], int, list[Copy2D]]:
    n = 2**29  # 1 GiB of bf16
    return [torch.randn(n, device=device, dtype=torch.bfloat16)], n, [Copy2D(0, 0, 0, 1, n, n, n)]


def _halves(device: torch.device, layers: int = 8) -> tuple[list[torch.Tensor], int, list[Copy2D]]:
    hidden, inter, kv = 2048, 8192, 512
    sources: list[torch.Tensor] = []
    copies: list[Copy2D] = []
    at = 0
    for _ in range(layers):
        # (destination shape, tp split dim): the half held by one tp rank goes to its place.
        for (rows, cols), dim in [((hidden, hidden), 0), ((kv, hidden), 0), ((kv, hidden), 0), ((hidden, hidden), 1),
                                  ((inter, hidden), 0), ((inter, hidden), 0), ((hidden, inter), 1)]:
            half = (rows // 2, cols) if dim == 0 else (rows, cols // 2)
            sources.append(torch.randn(half, device=device, dtype=torch.bfloat16))
            if dim == 0:
                copies.append(Copy2D(len(sources) - 1, 0, at, 1, half[0] * half[1], half[0] * half[1], half[0] * half[1]))
            else:
                copies.append(Copy2D(len(sources) - 1, 0, at, rows, cols // 2, cols // 2, cols))
            at += rows * cols
    return sources, at, copies


def median_cuda_seconds(step: Callable[[], object], reps: int) -> float:
    """Median seconds of `step` on the current CUDA stream over reps (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _run(name: str, sources: list[torch.Tensor], numel: int, copies: list[Copy2D],
         reps: int) -> list[tuple[str, str, float, float, bool]]:
    moved = 2 * sum(c.rows * c.cols for c in copies) * 2  # bf16, read + write
    dst = torch.empty(numel, device=sources[0].device, dtype=torch.bfloat16)
    reference = CopyTable.build(copies, 2)
    seconds = median_cuda_seconds(lambda: copy_reference(reference, sources, dst), reps)
    rows = [(name, "torch copy_ per copy", seconds, moved / seconds / 1e9, True)]
    want = dst.clone()
    for (block_r, block_c, warps), programs in [(t, p) for t in TILES for p in PROGRAMS]:
        table = CopyTable.build(copies, 2, block_r, block_c)
        fields = torch.from_numpy(resolve_fields(table, source_deltas(sources)).reshape(-1)).to(dst.device)
        starts = torch.from_numpy(table.tile_start).to(dst.device)
        dst.zero_()

        def step() -> None:
            launch_copies(table, fields, starts, sources[0], dst, table.aligned, programs, warps)

        seconds = median_cuda_seconds(step, reps)
        rows.append((name, f"{block_r}x{block_c}, {warps} warps, {programs} blocks", seconds, moved / seconds / 1e9,
                     torch.equal(dst, want)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for name, build in (("dense", _dense), ("halves", _halves)):
        rows += _run(name, *build(device), args.reps)
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, bf16, median of {args.reps}; GB/s = (read + write) / time")
    print(f"{'workload':<8} {'copies (kernel: tile, warps, blocks)':<36} {'ms':>8} {'GB/s':>8} {'exact':>5}")
    for name, how, seconds, gbps, exact in rows:
        print(f"{name:<8} {how:<36} {seconds * 1e3:>8.3f} {gbps:>8.0f} {str(exact):>5}")


if __name__ == "__main__":
    main()
