"""What a run and a plan show people: plan tables and Gantt charts, measured timelines, tracking.

May import planning (no torch or ray). In dependency order:
  report    the planner's per-call table, its JSON form and Gantt charts of simulated iterations
  timeline  measured records of every call and reallocation (time, peak memory, the estimates),
            and the metrics derived from them
  tracking  the console progress line, `metrics.jsonl` and Weights & Biases
"""

from __future__ import annotations

from app.reporting.report import (
    PlanReport,
    draw_gantt,
    format_plan_table,
    plan_json,
    plan_report,
    simulated_bars,
)
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
]
