"""Measured timelines of a run: per-rank records of every call and reallocation, the metrics an
iteration logs from them, and the run directory's Gantt chart and timing table.

Workers stamp each call and reallocation with wall-clock `start`/`end` (seconds since the
epoch); the driver turns the metadata into `TimelineRecord`s (one per op and rank), appends
them to `<run_dir>/timeline.jsonl`, and derives:

* `timing_s/<call>`: first start to last end over the call's ranks;
  `timing_s/realloc`: the same summed over the iteration's reallocations;
* `timing_s/iteration`: end of this iteration's last op minus end of the previous iteration's
  (its first op's start for the first iteration), so cross-iteration overlap shows;
* `rollout/reward_mean`, `rollout/response_length_mean` from the data owners' metadata, every
  other veRL-named scalar (`actor/pg_loss`, `critic/vf_loss`, ...) averaged over the ranks that
  report it, and `perf/throughput`: prompt + response tokens per second per GPU.

`write_gantt` draws measured bars (one row per GPU) above the cost model's simulated bars of
the same number of iterations; `timing_table` lists each call's mean measured time beside the
estimate, for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.reporting.report import GanttBar, draw_gantt, simulated_bars
from planning.cost import PlanningProblem, call_cost
from planning.plan import ExecutionPlan
from planning.simulate import simulate

GANTT_MAX_ITERATIONS = 4


@dataclass(frozen=True)
class TimelineRecord:
    """One op on one rank: kind is call | realloc | release | export."""

    iteration: int
    name: str
    kind: str
    rank: int
    start: float
    end: float


def records_of(iteration: int, name: str, kind: str, ranks: Sequence[int], metas: Sequence[Any]) -> list[TimelineRecord]:
    """Records of one op from its per-rank metadata (dicts with start/end; others are skipped)."""
    out = []
    for rank, meta in zip(ranks, metas):
        if isinstance(meta, dict) and "start" in meta and "end" in meta:
            out.append(TimelineRecord(iteration, name, kind, rank, float(meta["start"]), float(meta["end"])))
    return out


def span(records: Iterable[TimelineRecord]) -> tuple[float, float]:
    """(first start, last end) of some records; (nan, nan) when there are none."""
    items = list(records)
    if not items:
        return math.nan, math.nan
    return min(r.start for r in items), max(r.end for r in items)


def timing_metrics(records: Sequence[TimelineRecord], previous_end: float | None) -> dict[str, float]:
    """timing_s/<call>, timing_s/realloc and timing_s/iteration of one iteration's records."""
    by_op: dict[tuple[str, str], list[TimelineRecord]] = defaultdict(list)
    for record in records:
        by_op[(record.kind, record.name)].append(record)
    metrics: dict[str, float] = {}
    realloc_s = 0.0
    for (kind, name), items in by_op.items():
        start, end = span(items)
        if kind == "call":
            metrics[f"timing_s/{name}"] = end - start
        elif kind == "realloc":
            realloc_s += end - start
    metrics["timing_s/realloc"] = realloc_s
    first, last = span(records)
    metrics["timing_s/iteration"] = last - (previous_end if previous_end is not None else first)
    return metrics


def realloc_metrics(metas: Sequence[Any]) -> dict[str, float]:
    """Traffic of one iteration's reallocations from the ranks' metadata (dicts from
    `Worker.reallocate`): realloc/received_gb (from other GPUs, summed over ranks),
    realloc/pulled_gb (the part read straight from peers' memory over CUDA IPC, not sent with
    NCCL) and realloc/local_gb (copied on the same GPU)."""
    dicts = [m for m in metas if isinstance(m, dict)]
    received = sum(float(m.get("bytes_received", 0)) for m in dicts)
    pulled = sum(float(m.get("bytes_received", 0)) for m in dicts if m.get("pulled"))
    local = sum(float(m.get("local_bytes", 0)) for m in dicts)
    return {"realloc/received_gb": received / 1e9, "realloc/pulled_gb": pulled / 1e9, "realloc/local_gb": local / 1e9}


def rollout_metrics(call_metas: dict[str, list[dict[str, Any]]], kinds: dict[str, str]) -> dict[str, float]:
    """veRL-named scalars averaged over the ranks reporting them; rewards and response lengths
    from the owners' metadata where no call reported `rollout/reward_mean` and
    `rollout/response_length_mean` itself.

    call_metas: call name -> metadata dicts of its ranks. kinds: call name -> generate | ... .
    """
    rewards: list[float] = []
    lengths: list[float] = []
    scalars: dict[str, list[float]] = defaultdict(list)
    for name, metas in call_metas.items():
        for meta in metas:
            owner = bool(meta.get("owner", True))
            if owner and kinds.get(name) == "generate":
                lengths.extend(float(x) for x in meta.get("response_lengths", []))
            if owner and "rewards" in meta and kinds.get(name) == "inference":
                rewards.extend(float(x) for x in meta["rewards"])
            for key, value in {**meta, **meta.get("stats", {})}.items():
                if "/" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                    scalars[key].append(float(value))
    metrics = {key: sum(values) / len(values) for key, values in scalars.items()}
    # The train call's own figures (whole batch, sampled responses only) win over these.
    if rewards:
        metrics.setdefault("rollout/reward_mean", sum(rewards) / len(rewards))
    if lengths:
        metrics.setdefault("rollout/response_length_mean", sum(lengths) / len(lengths))
    return metrics


def throughput(prompt_tokens: int, metrics: dict[str, float], n_rows: int, n_gpus: int) -> float:
    """perf/throughput: (prompt + response tokens) / iteration seconds / GPUs."""
    seconds = metrics.get("timing_s/iteration", math.nan)
    response_tokens = metrics.get("rollout/response_length_mean", 0.0) * n_rows
    if not seconds or not math.isfinite(seconds) or seconds <= 0:
        return math.nan
    return (prompt_tokens + response_tokens) / seconds / n_gpus


def append_records(path: Path, records: Sequence[TimelineRecord]) -> None:
    """Append records to a JSONL file, flushed, so a crashed run keeps what finished."""
    with path.open("a", encoding="utf-8") as sink:
        for record in records:
            sink.write(json.dumps(asdict(record)) + "\n")


def read_records(path: Path) -> list[TimelineRecord]:
    if not path.is_file():
        return []
    return [TimelineRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def measured_bars(records: Sequence[TimelineRecord], t0: float, row_offset: int = 0) -> list[GanttBar]:
    """Measured records as Gantt bars (calls and reallocations), times relative to `t0`."""
    bars = []
    for r in records:
        if r.kind not in ("call", "realloc"):
            continue
        label = f"{r.name} #{r.iteration}" if r.kind == "call" else f"realloc>{r.name} #{r.iteration}"
        bars.append(GanttBar(r.rank + row_offset, r.start - t0, r.end - t0, label, r.kind))
    return bars


def write_gantt(records: Sequence[TimelineRecord], problem: PlanningProblem, plan: ExecutionPlan,
                path: Path) -> None:
    """Measured bars of the first iterations on rows 0..G-1, the simulation's on rows G..2G-1."""
    n_gpus = problem.cluster.n_gpus
    shown = sorted({r.iteration for r in records})[:GANTT_MAX_ITERATIONS]
    measured = [r for r in records if r.iteration in shown]
    if not measured:
        return
    t0 = min(r.start for r in measured)
    bars = measured_bars(measured, t0)
    sim = simulate(problem, plan, iterations=max(len(shown), 1))
    estimated = [GanttBar(b.row + n_gpus, b.start_s, b.end_s, b.label, "estimate" if b.kind == "call" else b.kind)
                 for b in simulated_bars(sim)]
    labels = [f"GPU {g} measured" for g in range(n_gpus)] + [f"GPU {g} estimated" for g in range(n_gpus)]
    title = (f"{len(shown)} iteration(s): measured (top) vs cost-model estimate (bottom, "
             f"{sim.iteration_s:.3g} s/iteration)")
    draw_gantt(bars + estimated, path, title=title, n_rows=2 * n_gpus, row_labels=labels)


def timing_table(records: Sequence[TimelineRecord], problem: PlanningProblem, plan: ExecutionPlan) -> list[dict[str, Any]]:
    """Per call: placement, mean measured seconds (iterations after the first when there are
    several: the first carries warm-up) and the cost model's estimate."""
    iterations = sorted({r.iteration for r in records})
    steady = [r for r in records if r.iteration != iterations[0]] if len(iterations) > 1 else list(records)
    rows = []
    for mfc in problem.graph.mfcs:
        placement = plan[mfc.name]
        per_iteration = [span(r for r in steady if r.kind == "call" and r.name == mfc.name and r.iteration == i)
                         for i in iterations]
        seconds = [end - start for start, end in per_iteration if math.isfinite(start)]
        rows.append({
            "call": mfc.name, "mesh": str(placement.mesh), "layout": str(placement.layout),
            "measured_s": sum(seconds) / len(seconds) if seconds else None,
            "estimated_s": call_cost(problem, mfc, placement).time_s,
        })
    return rows


__all__ = [
    "GANTT_MAX_ITERATIONS", "TimelineRecord", "append_records", "measured_bars", "read_records", "records_of",
    "rollout_metrics", "span", "throughput", "timing_metrics", "timing_table", "write_gantt",
]
