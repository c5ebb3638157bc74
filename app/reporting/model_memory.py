"""What lives where for each trained model of a plan: its weights and optimizer state on the GPUs
of its train mesh, the part of the optimizer state in host memory (optimizer offload,
`planning.offload`) and what streaming that part costs per iteration.

`model_rows` reads them off the cost model at the plan's placement and offload (per GPU of the
fullest pipeline stage, as the cost model counts memory); `format_model_rows` is the block
`python -m app plan` prints under the call table and `model_rows_json` its JSON form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planning.cost import PlanningProblem, call_cost
from planning.hardware import GiB
from planning.offload import describe_fractions, fraction_text, host_capacity_bytes
from planning.plan import ExecutionPlan
from planning.simulate import SimResult


@dataclass(frozen=True)
class ModelRow:
    """One trained model: per GPU of its train mesh, GiB of weights and of optimizer state on the
    GPU and in host memory, the fraction offloaded and the offload's seconds per iteration."""

    role: str
    train_call: str
    mesh: str
    weights_gib: float
    optimizer_gpu_gib: float
    optimizer_host_gib: float
    offload_fraction: float
    offload_s: float


def model_rows(problem: PlanningProblem, plan: ExecutionPlan, sim: SimResult) -> tuple[ModelRow, ...]:
    """A row per trained role, from its train call's cost at the plan's placement, execution and
    offload; `sim` (the simulation of `plan`) gives the offload seconds per iteration."""
    problem = problem.for_plan(plan)
    rows = []
    for mfc in problem.graph.mfcs:
        if mfc.kind != "train":
            continue
        execution = plan.execution(mfc.name) or sim.executions.get(mfc.name)
        cost = call_cost(problem, mfc, plan[mfc.name], execution=execution)
        parts = cost.breakdown
        rows.append(ModelRow(mfc.role, mfc.name, str(plan[mfc.name].mesh), parts.get("weights_bytes", 0.0) / GiB,
                             parts.get("optimizer_bytes", 0.0) / GiB, cost.host_bytes / GiB,
                             plan.offload_fraction(mfc.role), sim.offload_s.get(mfc.name, 0.0)))
    return tuple(rows)


def format_model_rows(rows: tuple[ModelRow, ...], problem: PlanningProblem) -> list[str]:
    """The lines `python -m app plan` prints for the trained models (none without any), e.g.

        trained model  mesh  GPU weights GiB  GPU optimizer GiB  host optimizer GiB  offload  offload s/iter
        actor          n0               15.0               33.6                56.1  5/8      1.22 s
    """
    if not rows:
        return []
    header = ("trained model", "mesh", "GPU weights GiB", "GPU optimizer GiB", "host optimizer GiB", "offload",
              "offload s/iter")
    body = [(r.role, r.mesh, f"{r.weights_gib:.1f}", f"{r.optimizer_gpu_gib:.1f}", f"{r.optimizer_host_gib:.1f}",
             fraction_text(r.offload_fraction) if r.offload_fraction else "none",
             f"{r.offload_s:.2f} s" if r.offload_s else "-") for r in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    numeric = {2, 3, 4, 6}
    lines = ["  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                       for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
             for cells in [header, *body]]
    offloaded = [r for r in rows if r.offload_fraction]
    if offloaded:
        hw = problem.cluster.hardware
        lines.append(f"optimizer offload: {describe_fractions({r.role: r.offload_fraction for r in offloaded})} of the "
                     f"optimizer state in pinned host memory ({host_capacity_bytes(hw) / GiB:.1f} GiB usable per GPU), "
                     f"streamed at {hw.host_bw / 1e9:.0f} GB/s: "
                     f"{sum(r.offload_s for r in offloaded):.2f} s per iteration")
    return lines


def model_rows_json(rows: tuple[ModelRow, ...]) -> list[dict[str, Any]]:
    """The rows as JSON-ready dicts (GiB per GPU, seconds per iteration)."""
    return [{"role": r.role, "train_call": r.train_call, "mesh": r.mesh, "weights_gib": r.weights_gib,
             "optimizer_gpu_gib": r.optimizer_gpu_gib, "optimizer_host_gib": r.optimizer_host_gib,
             "offload_fraction": r.offload_fraction, "offload_s": r.offload_s} for r in rows]


__all__ = ["ModelRow", "format_model_rows", "model_rows", "model_rows_json"]
