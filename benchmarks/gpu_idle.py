"""Where a profiled step leaves the GPU idle, and what the host was doing meanwhile.

A step whose GPU kernels sum to less than its wall time waits on the host somewhere: a sync
followed by host-side preparation (a few long gaps), or a stretch of small kernels the host
cannot launch as fast as the GPU runs them (many short gaps). `gpu_idle(prof)` merges the
profiled CUDA kernels into busy intervals, sizes the gaps between them, and sums the host's leaf
events (aten ops without children, CUDA runtime calls such as cudaStreamSynchronize) by the
time they overlap those gaps. Used by engine_bench.py --profile.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

# Gap sizes reported apart (microseconds): launch-bound stretches vs host-side pauses.
GAP_BINS_US = (10.0, 100.0, 1000.0)


@dataclass(frozen=True)
class IdleReport:
    busy_us: float  # union of kernel intervals
    span_us: float  # first kernel start to last kernel end
    gaps_us: tuple[tuple[str, int, float], ...]  # (bin label, count, idle us) per size bin
    host_during_gaps: tuple[tuple[str, float], ...]  # (host event name, overlap us), largest first


def busy_intervals(kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Kernel (start, end) intervals merged where they overlap or touch, in time order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _bin_label(lo: float, hi: float | None) -> str:
    def fmt(us: float) -> str:
        return f"{us / 1000:g} ms" if us >= 1000 else f"{us:g} us"
    return f">= {fmt(lo)}" if hi is None else f"{fmt(lo)}-{fmt(hi)}" if lo else f"< {fmt(hi)}"


def idle_report(kernels: list[tuple[float, float]], host: list[tuple[str, float, float]], top: int = 8) -> IdleReport:
    """kernels: (start, end) us of every GPU kernel; host: (name, start, end) us of the host's
    leaf events. Gaps are the idle stretches between busy intervals."""
    busy = busy_intervals(kernels)
    if not busy:
        return IdleReport(0.0, 0.0, (), ())
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in itertools.pairwise(busy)]
    edges = (0.0, *GAP_BINS_US, None)
    bins = []
    for lo, hi in itertools.pairwise(edges):
        sizes = [e - s for s, e in gaps if e - s >= lo and (hi is None or e - s < hi)]
        bins.append((_bin_label(lo, hi), len(sizes), sum(sizes)))
    overlap: dict[str, float] = {}
    starts = [s for s, _ in gaps]
    for name, h_start, h_end in host:
        i = max(0, bisect.bisect_right(starts, h_start) - 1)
        while i < len(gaps) and gaps[i][0] < h_end:
            shared = min(h_end, gaps[i][1]) - max(h_start, gaps[i][0])
            if shared > 0:
                overlap[name] = overlap.get(name, 0.0) + shared
            i += 1
    ranked = tuple(sorted(overlap.items(), key=lambda kv: -kv[1])[:top])
    return IdleReport(sum(e - s for s, e in busy), busy[-1][1] - busy[0][0], tuple(bins), ranked)


def gpu_idle(prof: torch.profiler.profile, top: int = 8) -> IdleReport:
    """idle_report over a finished profile's events (CPU and CUDA activities)."""
    kernels, host = [], []
    for event in prof.events():
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(span)
        elif not event.cpu_children:
            host.append((event.name, *span))
    return idle_report(kernels, host, top)


def format_report(report: IdleReport, title: str) -> str:
    """Three lines: busy and idle time, the gaps by size, the host's events during them."""
    idle = report.span_us - report.busy_us
    head = (f"GPU idle, {title}: busy {report.busy_us / 1e3:.1f} ms of {report.span_us / 1e3:.1f} ms "
            f"(idle {idle / 1e3:.1f} ms)")
    lines = [head,
             "  gaps by size: " + ", ".join(f"{label}: {n} = {us / 1e3:.1f} ms" for label, n, us in report.gaps_us),
             "  host during gaps: " + ", ".join(f"{name} {us / 1e3:.1f} ms" for name, us in report.host_during_gaps)]
    return "\n".join(lines)
