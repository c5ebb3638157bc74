"""One collected iteration as timeline records and the metrics row it logs.

The driver hands over the iteration's submitted ops with their per-rank metadata; this turns
them into `TimelineRecord`s (each call's record beside the plan's estimate for it) and the row of
metrics.jsonl / W&B: timings, reallocation traffic, rollout statistics, estimated next to
measured time and memory, and throughput. Memory peaks over the estimate by more than the
plan's margin are warnings naming the call.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from app.reporting import (
    CallEstimate,
    TimelineRecord,
    fidelity_metrics,
    memory_overruns,
    realloc_metrics,
    records_of,
    rollout_metrics,
    timing_metrics,
)
from app.run.collect import SubmittedOp
from planning.dataflow import Graph


@dataclass(frozen=True)
class CollectedIteration:
    """records: the iteration's timeline records; call_metas: per call, its ranks' metadata dicts;
    metrics: the row's values (throughput and the driver's own additions come later)."""

    records: list[TimelineRecord]
    call_metas: dict[str, list[dict[str, Any]]]
    metrics: dict[str, float]


def collect_iteration(iteration: int, ops: list[SubmittedOp], metas: dict[SubmittedOp, list[Any]],
                      estimates: dict[str, CallEstimate], graph: Graph, previous_end: float | None,
                      memory_margin: float) -> CollectedIteration:
    """Records and metrics of iteration `iteration` from its ops' metadata (see the module doc);
    previous_end: when the iteration before it ended (its wall time is measured from there)."""
    records: list[TimelineRecord] = []
    call_metas: dict[str, list[dict[str, Any]]] = {}
    realloc_metas: list[Any] = []
    for sub in ops:
        estimate = estimates.get(sub.name) if sub.kind == "call" else None
        records += records_of(iteration, sub.name, sub.kind, sub.ranks, metas[sub], estimate)
        if sub.kind == "call":
            call_metas[sub.name] = [m for m in metas[sub] if isinstance(m, dict)]
        elif sub.kind == "realloc":
            realloc_metas += metas[sub]
    kinds = {m.name: m.kind for m in graph.mfcs}
    metrics = {**timing_metrics(records, previous_end), **realloc_metrics(realloc_metas),
               **rollout_metrics(call_metas, kinds), **fidelity_metrics(records)}
    for line in memory_overruns(records, memory_margin):
        warnings.warn(line, stacklevel=3)
    return CollectedIteration(records, call_metas, metrics)


__all__ = ["CollectedIteration", "collect_iteration"]
