"""Training curves of a run from its `metrics.jsonl`: one PNG of panels and a text summary.

`curve_panels` picks what a run logged, in this order: reward, response length, KL (`actor/kl`,
`actor/kl_loss`), losses (`actor/pg_loss`, `critic/vf_loss`, `actor/dpo_loss`, ...), per-call
times (`timing_s/<call>`, plus the iteration) and throughput. `draw_curves` draws them over
iterations into one PNG (matplotlib's Agg canvas: no display needed); `run_summary` gives the
lines `python -m app report` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PANEL_COLUMNS = 3
PANEL_SIZE_IN = (4.2, 3.0)
SUMMARY_WINDOW = 5  # iterations averaged at the start and the end of the run


@dataclass(frozen=True)
class Panel:
    """One plot: a title, its y label and the metric names drawn as lines."""

    title: str
    ylabel: str
    metrics: tuple[str, ...]


def _logged(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Metric names with at least one finite value, in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value):
                names.setdefault(key, None)
    return list(names)


def curve_panels(rows: Sequence[dict[str, Any]]) -> list[Panel]:
    """The panels worth drawing for these rows (a panel without any logged metric is left out)."""
    logged = _logged(rows)

    def having(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(n for n in names if n in logged)

    losses = [n for n in logged if n.endswith("_loss") and n != "actor/kl_loss"]
    timings = [n for n in logged if n.startswith("timing_s/") and n != "timing_s/realloc"]
    candidates = [
        Panel("reward", "mean reward", having(["rollout/reward_mean", "actor/reward_mean", "rollout/reward"])),
        Panel("response length", "tokens", having(["rollout/response_length_mean"])),
        Panel("KL to the reference", "KL", having(["actor/kl", "actor/kl_loss"])),
        Panel("losses", "loss", having(losses)),
        Panel("time per call", "seconds", having(timings)),
        Panel("throughput", "tokens / s / GPU", having(["perf/throughput"])),
    ]
    return [p for p in candidates if p.metrics]


def series(rows: Sequence[dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    """(iterations, values) where `metric` has a finite value."""
    xs, ys = [], []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(int(row.get("iteration", len(xs))))
            ys.append(float(value))
    return xs, ys


def draw_curves(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> list[Panel]:
    """Draw the panels of `rows` over iterations into a PNG at `path`; returns the panels drawn.
    ValueError when no row holds a plottable metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = curve_panels(rows)
    if not panels:
        raise ValueError("metrics.jsonl holds no numeric metric to draw")
    n_rows = math.ceil(len(panels) / PANEL_COLUMNS)
    n_cols = min(len(panels), PANEL_COLUMNS)
    figure = Figure(figsize=(PANEL_SIZE_IN[0] * n_cols, PANEL_SIZE_IN[1] * n_rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(n_rows, n_cols, squeeze=False)
    for index, panel in enumerate(panels):
        ax = axes[index // PANEL_COLUMNS][index % PANEL_COLUMNS]
        for metric in panel.metrics:
            xs, ys = series(rows, metric)
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=metric.removeprefix("timing_s/"))
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(panel.metrics) > 1:
            ax.legend(fontsize=6)
    for index in range(len(panels), n_rows * n_cols):  # empty cells of the last row
        axes[index // PANEL_COLUMNS][index % PANEL_COLUMNS].set_axis_off()
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(str(path), dpi=100)
    return panels


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def run_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Lines: iterations; reward (and KL, response length) at the start vs the end; seconds per
    iteration and per call; throughput. Windows are the first and last SUMMARY_WINDOW iterations."""
    lines = [f"{len(rows)} iterations"]
    for label, metric in (("reward", "rollout/reward_mean"), ("response length", "rollout/response_length_mean"),
                          ("kl", "actor/kl")):
        _, ys = series(rows, metric)
        if ys:
            first, last = ys[:SUMMARY_WINDOW], ys[-SUMMARY_WINDOW:]
            lines.append(f"{label}: first {len(first)} {_mean(first):.4g} -> last {len(last)} {_mean(last):.4g}")
    timings = [n for n in _logged(rows) if n.startswith("timing_s/")]
    if timings:
        per_call = ", ".join(f"{n.removeprefix('timing_s/')} {_mean(series(rows, n)[1]):.3g}" for n in timings)
        lines.append(f"mean seconds: {per_call}")
    _, throughput = series(rows, "perf/throughput")
    if throughput:
        lines.append(f"throughput: {_mean(throughput):.4g} tokens/s/GPU (mean)")
    return lines


__all__ = ["Panel", "curve_panels", "draw_curves", "run_summary", "series"]
