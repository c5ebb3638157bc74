"""What the GPU's clocks and power did while a benchmark ran, overall and per call of a run.

A call measured twice on the same code and machine can differ by 2x (the 0.5B fidelity shape in
docs/benchmarks.md, issue 27 tenth step). Before blaming the code, see whether the GPU ran at its
clocks: benchmarks/run_gpu.sh samples `nvidia-smi` every 200 ms into gpu_clocks.csv (the query
`NVIDIA_SMI_QUERY` below, no header, no units) and this script summarises it:

    python3 benchmarks/gpu_clocks.py gpu_clocks.csv [RUN_DIR_OR_TIMELINE ...]

Overall: the samples in which the GPU was busy (utilisation >= 50%), their SM clock (median,
lowest), power draw, and the clock-event reasons that were active (NVML's bits: power cap,
thermal and hardware slowdowns, ...) with how often. Per call of each timeline given (a run
directory's timeline.jsonl; a directory is searched for them): the same over the samples taken
between the call's first start and last end, by iteration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

NVIDIA_SMI_QUERY = ("timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,"
                    "clocks_event_reasons.active")
BUSY_UTILISATION = 50.0
# NVML clocks event reasons (nvmlClocksEventReason*); GpuIdle is left out: a busy GPU is not idle.
REASONS = {0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch (the machine's local time, as time.time())
    gpu: int
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temp_c: float
    util: float
    reasons: int


def _number(text: str) -> float:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return float("nan")


def parse_samples(lines: list[str]) -> list[Sample]:
    """Rows of `nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits`; lines
    that are not such rows (an error message, a cut last line) are skipped."""
    out = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 8:
            continue
        try:
            when = datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            reasons = int(cells[7], 16) if cells[7].startswith("0x") else 0
            out.append(Sample(when, int(cells[1]), *(_number(c) for c in cells[2:7]), reasons))
        except ValueError:
            continue
    return out


def summary(samples: list[Sample]) -> str:
    """One line over the busy samples: SM clock median / lowest, power, temperature, reasons."""
    busy = [s for s in samples if s.util >= BUSY_UTILISATION]
    if not busy:
        return f"{len(samples)} samples, none busy"
    clocks = [s.sm_mhz for s in busy]
    counts = {name: sum(1 for s in busy if s.reasons & bit) for bit, name in REASONS.items()}
    reasons = ", ".join(f"{name} {n}/{len(busy)}" for name, n in counts.items() if n) or "none"
    return (f"{len(busy)}/{len(samples)} busy samples: SM {statistics.median(clocks):.0f} MHz median, "
            f"{min(clocks):.0f} lowest; power {statistics.median(s.power_w for s in busy):.0f} W median, "
            f"{max(s.power_w for s in busy):.0f} W max; {max(s.temp_c for s in busy):.0f} C max; "
            f"clock-event reasons: {reasons}")


def call_spans(timeline: Path) -> list[tuple[int, str, float, float]]:
    """(iteration, call, first start, last end) of each call of a timeline.jsonl."""
    spans: dict[tuple[int, str], tuple[float, float]] = {}
    for line in timeline.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("kind") != "call":
            continue
        key = (int(record["iteration"]), str(record["name"]))
        start, end = spans.get(key, (record["start"], record["end"]))
        spans[key] = (min(start, record["start"]), max(end, record["end"]))
    return sorted(((it, name, s, e) for (it, name), (s, e) in spans.items()), key=lambda x: x[2])


def timelines(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        found += sorted(path.rglob("timeline.jsonl")) if path.is_dir() else [path]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="nvidia-smi samples (run_gpu.sh writes gpu_clocks.csv)")
    parser.add_argument("runs", nargs="*", help="timeline.jsonl files or directories holding them")
    args = parser.parse_args(argv)
    samples = parse_samples(Path(args.csv).read_text(errors="replace").splitlines())
    print(f"GPU clocks, all: {summary(samples)}")
    for timeline in timelines(args.runs):
        print(f"per call of {timeline.parent.name}:")
        for iteration, name, start, end in call_spans(timeline):
            inside = [s for s in samples if start <= s.time <= end]
            print(f"  {iteration:>3} {name:<14} {end - start:>8.3f} s  {summary(inside)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
