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
  report it, and `perf/throughput`: prompt + response tokens per second per GPU;
* `memory/<call>_peak_gib` and `memory/<call>_reserved_gib`: the largest peak of allocated and
  reserved GPU memory over the call's ranks (null on CPU), beside `memory/<call>_est_gib`, the
  plan's estimate of the fullest GPU during the call, and `timing_est_s/<call>`
  (`fidelity_metrics`), and `timing_gc_s/<call>` / `timing_compile_s/<call>`: the longest time
  Python's garbage collector / torch.compile held one of the call's ranks during it
  (actors.worker.host_pauses), `timing_gc_before_s/<call>` the longest collection on one of its
  ranks between that rank's previous call and this one; `memory_overruns` names the calls whose
  measured peak exceeds the estimate by more than a margin.

Call records carry the estimate of the plan they ran under (`call_estimates`: seconds and the
peak bytes per GPU while the call runs) next to what was measured. `write_gantt` draws measured
bars (one row per GPU) above the cost model's simulated bars of the same number of iterations,
each call bar labelled with its measured or estimated peak memory; `timing_table` lists each
call's mean measured time and largest peak beside the estimates, for docs/benchmarks.md.
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
from planning.hardware import GiB
from planning.plan import ExecutionPlan
from planning.simulate import complete_plan, simulate

GANTT_MAX_ITERATIONS = 4


@dataclass(frozen=True)
class TimelineRecord:
    """One op on one rank: kind is call | realloc | release | export. Calls also carry the
    rank's measured peak memory (None where the device cannot tell) and the plan's estimates."""

    iteration: int
    name: str
    kind: str
    rank: int
    start: float
    end: float
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    est_s: float | None = None
    est_peak_bytes: float | None = None
    gc_s: float | None = None  # Python garbage collection during the call (actors.worker.host_pauses)
    compile_s: float | None = None  # torch.compile compiling during the call (same)
    gc_before_s: float | None = None  # garbage collection between the rank's previous call and this one


@dataclass(frozen=True)
class CallEstimate:
    """The cost model's view of one call of a plan: seconds, and peak bytes on the fullest GPU
    of its mesh while it runs (resident models + the call's own memory)."""

    seconds: float
    peak_bytes: float


def call_estimates(problem: PlanningProblem, plan: ExecutionPlan) -> dict[str, CallEstimate]:
    """Every call's estimate at the placement and execution the plan gives it (and its optimizer
    offload: `PlanningProblem.for_plan`)."""
    problem = problem.for_plan(plan)
    sim = simulate(problem, plan, iterations=1)
    out = {}
    for mfc in problem.graph.mfcs:
        execution = plan.execution(mfc.name) or sim.executions.get(mfc.name)
        seconds = call_cost(problem, mfc, plan[mfc.name], execution=execution).time_s
        out[mfc.name] = CallEstimate(seconds, sim.call_mem_bytes.get(mfc.name, math.nan))
    return out


def records_of(iteration: int, name: str, kind: str, ranks: Sequence[int], metas: Sequence[Any],
               estimate: CallEstimate | None = None) -> list[TimelineRecord]:
    """Records of one op from its per-rank metadata (dicts with start/end; others are skipped)."""
    out = []
    for rank, meta in zip(ranks, metas):
        if isinstance(meta, dict) and "start" in meta and "end" in meta:
            out.append(TimelineRecord(
                iteration, name, kind, rank, float(meta["start"]), float(meta["end"]),
                _int_or_none(meta.get("peak_allocated_bytes")), _int_or_none(meta.get("peak_reserved_bytes")),
                estimate.seconds if estimate else None, estimate.peak_bytes if estimate else None,
                _float_or_none(meta.get("gc_s")), _float_or_none(meta.get("compile_s")),
                _float_or_none(meta.get("gc_before_s"))))
    return out


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def fidelity_metrics(records: Sequence[TimelineRecord]) -> dict[str, float]:
    """Per call: memory/<call>_peak_gib, memory/<call>_reserved_gib (largest over its ranks; nan,
    i.e. null, where unmeasured), memory/<call>_est_gib, timing_est_s/<call>, timing_gc_s/<call>,
    timing_gc_before_s/<call> and timing_compile_s/<call>."""
    metrics: dict[str, float] = {}
    for name, items in _calls_by_name(records).items():
        allocated = [r.peak_allocated_bytes for r in items if r.peak_allocated_bytes is not None]
        reserved = [r.peak_reserved_bytes for r in items if r.peak_reserved_bytes is not None]
        metrics[f"memory/{name}_peak_gib"] = max(allocated) / GiB if allocated else math.nan
        metrics[f"memory/{name}_reserved_gib"] = max(reserved) / GiB if reserved else math.nan
        if items[0].est_peak_bytes is not None:
            metrics[f"memory/{name}_est_gib"] = items[0].est_peak_bytes / GiB
        if items[0].est_s is not None:
            metrics[f"timing_est_s/{name}"] = items[0].est_s
        pauses = (("gc", [r.gc_s for r in items]), ("gc_before", [r.gc_before_s for r in items]),
                  ("compile", [r.compile_s for r in items]))
        for key, values in pauses:
            measured = [v for v in values if v is not None]
            if measured:
                metrics[f"timing_{key}_s/{name}"] = max(measured)
    return metrics


def memory_overruns(records: Sequence[TimelineRecord], margin: float) -> list[str]:
    """One line per call whose measured peak (largest over its ranks) exceeds its estimate by
    more than `margin` (a fraction of the estimate)."""
    lines = []
    for name, items in _calls_by_name(records).items():
        measured = [r for r in items if r.peak_allocated_bytes is not None and r.est_peak_bytes]
        if not measured:
            continue
        worst = max(measured, key=lambda r: r.peak_allocated_bytes or 0)
        assert worst.peak_allocated_bytes is not None and worst.est_peak_bytes is not None
        if worst.peak_allocated_bytes > worst.est_peak_bytes * (1.0 + margin):
            lines.append(f"call {name} (iteration {worst.iteration}): measured peak {worst.peak_allocated_bytes / GiB:.3g} "
                         f"GiB on rank {worst.rank} exceeds its estimate {worst.est_peak_bytes / GiB:.3g} GiB by more "
                         f"than plan.memory_margin={margin:g}")
    return lines


def _calls_by_name(records: Sequence[TimelineRecord]) -> dict[str, list[TimelineRecord]]:
    by_name: dict[str, list[TimelineRecord]] = defaultdict(list)
    for record in records:
        if record.kind == "call":
            by_name[record.name].append(record)
    return by_name


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
    """veRL-named scalars averaged over the ranks reporting them (those a data owner lists under
    `summed`, counters such as env/errors, added up instead); rewards and response lengths
    from the owners' metadata where no call reported `rollout/reward_mean` and
    `rollout/response_length_mean` itself.

    call_metas: call name -> metadata dicts of its ranks. kinds: call name -> generate | ... .
    """
    rewards: list[float] = []
    lengths: list[float] = []
    scalars: dict[str, list[float]] = defaultdict(list)
    summed: dict[str, float] = defaultdict(float)
    for name, metas in call_metas.items():
        for meta in metas:
            owner = bool(meta.get("owner", True))
            if owner:  # counters of the data owners (e.g. env/errors per dp rank) add up
                for key, value in meta.get("summed", {}).items():
                    summed[key] += float(value)
            if owner and kinds.get(name) == "generate":
                lengths.extend(float(x) for x in meta.get("response_lengths", []))
            if owner and "rewards" in meta and kinds.get(name) == "inference":
                rewards.extend(float(x) for x in meta["rewards"])
            for key, value in {**meta, **meta.get("stats", {})}.items():
                if "/" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                    scalars[key].append(float(value))
    metrics = {key: sum(values) / len(values) for key, values in scalars.items()}
    metrics.update(summed)
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
    """Measured records as Gantt bars (calls and reallocations), times relative to `t0`; a call
    bar shows the rank's measured peak memory when there is one."""
    bars = []
    for r in records:
        if r.kind not in ("call", "realloc"):
            continue
        label = f"{r.name} #{r.iteration}" if r.kind == "call" else f"realloc>{r.name} #{r.iteration}"
        if r.kind == "call" and r.peak_allocated_bytes is not None:
            label += f" {r.peak_allocated_bytes / GiB:.1f}G"
        bars.append(GanttBar(r.rank + row_offset, r.start - t0, r.end - t0, label, r.kind))
    return bars


def write_gantt(records: Sequence[TimelineRecord], problem: PlanningProblem, plan: ExecutionPlan,
                path: Path) -> None:
    """Measured bars of the first iterations on rows 0..G-1, the simulation's on rows G..2G-1
    (call bars of both labelled with their peak GPU memory, measured or estimated)."""
    n_gpus = problem.cluster.n_gpus
    shown = sorted({r.iteration for r in records})[:GANTT_MAX_ITERATIONS]
    measured = [r for r in records if r.iteration in shown]
    if not measured:
        return
    t0 = min(r.start for r in measured)
    bars = measured_bars(measured, t0)
    sim = simulate(problem, plan, iterations=max(len(shown), 1))
    estimated = [GanttBar(b.row + n_gpus, b.start_s, b.end_s, _with_memory(b, sim.call_mem_bytes),
                          "estimate" if b.kind == "call" else b.kind)
                 for b in simulated_bars(sim)]
    labels = [f"GPU {g} measured" for g in range(n_gpus)] + [f"GPU {g} estimated" for g in range(n_gpus)]
    title = (f"{len(shown)} iteration(s): measured (top) vs cost-model estimate (bottom, "
             f"{sim.iteration_s:.3g} s/iteration)")
    draw_gantt(bars + estimated, path, title=title, n_rows=2 * n_gpus, row_labels=labels)


def _with_memory(bar: GanttBar, call_mem: dict[str, float]) -> str:
    """A simulated call bar's label with the estimated peak GiB of its GPU during the call."""
    name = bar.label.split(" #", 1)[0]
    if bar.kind != "call" or name not in call_mem:
        return bar.label
    return f"{bar.label} {call_mem[name] / GiB:.1f}G"


def timing_table(records: Sequence[TimelineRecord], problem: PlanningProblem, plan: ExecutionPlan) -> list[dict[str, Any]]:
    """Per call: placement and execution, mean measured seconds (iterations after the first when
    there are several: the first carries warm-up), the largest measured peak allocated and
    reserved GiB over its ranks and iterations (None on CPU), and the cost model's estimates."""
    iterations = sorted({r.iteration for r in records})
    steady = [r for r in records if r.iteration != iterations[0]] if len(iterations) > 1 else list(records)
    estimates = call_estimates(problem, plan)
    complete = complete_plan(problem, plan)
    rows = []
    for mfc in problem.graph.mfcs:
        placement = plan[mfc.name]
        per_iteration = [span(r for r in steady if r.kind == "call" and r.name == mfc.name and r.iteration == i)
                         for i in iterations]
        seconds = [end - start for start, end in per_iteration if math.isfinite(start)]
        calls = [r for r in records if r.kind == "call" and r.name == mfc.name]
        allocated = [r.peak_allocated_bytes for r in calls if r.peak_allocated_bytes is not None]
        reserved = [r.peak_reserved_bytes for r in calls if r.peak_reserved_bytes is not None]
        execution = complete.execution(mfc.name)
        rows.append({
            "call": mfc.name, "mesh": str(placement.mesh), "layout": str(placement.layout),
            **(execution.as_dict() if execution else {}),
            "measured_s": sum(seconds) / len(seconds) if seconds else None,
            "estimated_s": estimates[mfc.name].seconds,
            "measured_peak_gib": max(allocated) / GiB if allocated else None,
            "measured_reserved_gib": max(reserved) / GiB if reserved else None,
            "estimated_peak_gib": _finite_or_none(estimates[mfc.name].peak_bytes / GiB),
        })
    return rows


__all__ = [
    "GANTT_MAX_ITERATIONS", "CallEstimate", "TimelineRecord", "append_records", "call_estimates", "fidelity_metrics",
    "measured_bars", "memory_overruns", "read_records", "records_of", "rollout_metrics", "span", "throughput",
    "timing_metrics", "timing_table", "write_gantt",
]
