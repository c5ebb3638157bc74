"""What a run and a plan show people: plan tables and Gantt charts, measured timelines, tracking.

May import planning (no torch or ray). In dependency order:
  model_memory  per trained model: weights and optimizer state on the GPU and in host memory (offload)
  report    the planner's per-call table, its JSON form and Gantt charts of simulated iterations
  timeline  measured records of every call and reallocation (time, peak memory, the estimates),
            and the metrics derived from them
  tracking  the console progress line, `metrics.jsonl` and Weights & Biases
  curves    training curves of a run (reward, length, KL, losses, call times) in one PNG, and a summary
  samples   a few decoded rollouts per iteration with their rewards (`samples.jsonl`)
  ray_metrics  the run's metrics as Ray Gauges for the cluster's Prometheus / Grafana (imports Ray lazily)
"""

from __future__ import annotations

from app.reporting.curves import Panel, curve_panels, draw_curves, run_summary
from app.reporting.ray_metrics import RayMetricsExporter, gauge_name, gauge_values
from app.reporting.report import (
    PlanReport,
    draw_gantt,
    format_plan_table,
    plan_json,
    plan_report,
    simulated_bars,
)
from app.reporting.samples import append_samples, read_samples, rollout_samples
from app.reporting.timeline import (
    CallEstimate,
    TimelineRecord,
    append_records,
    call_estimates,
    fidelity_metrics,
    memory_overruns,
    realloc_metrics,
    records_of,
    rollout_metrics,
    span,
    throughput,
    timing_metrics,
    timing_table,
    write_gantt,
)
from app.reporting.tracking import Tracker

__all__ = [
    # report.py
    "PlanReport", "draw_gantt", "format_plan_table", "plan_json", "plan_report", "simulated_bars",
    # timeline.py
    "CallEstimate", "TimelineRecord", "append_records", "call_estimates", "fidelity_metrics", "memory_overruns",
    "realloc_metrics", "records_of", "rollout_metrics", "span", "throughput", "timing_metrics", "timing_table",
    "write_gantt",
    # tracking.py
    "Tracker",
    # curves.py
    "Panel", "curve_panels", "draw_curves", "run_summary",
    # samples.py
    "append_samples", "read_samples", "rollout_samples",
    # ray_metrics.py
    "RayMetricsExporter", "gauge_name", "gauge_values",
]
