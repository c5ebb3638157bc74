"""What the planner reports to people: the per-call plan table, its JSON form and Gantt charts.

`plan_report` collects, for a chosen plan, each call's placement, how it runs (micro-batch token
budget and count, or generation rounds; a multi-turn generation's turns and environment
seconds) and its estimated time and memory into a frozen `PlanReport`; `format_plan_table` and
`plan_json` render it for the terminal and for machines. `draw_gantt` draws any list of
`GanttBar`s (one row per GPU), so the same function draws the simulator's estimated timeline
(`simulated_bars`) and, later, measured timelines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.reporting.model_memory import ModelRow, format_model_rows, model_rows, model_rows_json
from planning.cost import PlanningProblem, call_cost
from planning.hardware import GiB
from planning.plan import ExecutionPlan
from planning.simulate import SimResult

GANTT_WIDTH_IN = 12.0
GANTT_FONT_PT = 7


@dataclass(frozen=True)
class CallRow:
    """One call of a plan with its placement and the cost model's estimates."""

    name: str
    role: str
    kind: str
    mesh: str
    dp: int
    tp: int
    pp: int
    est_time_s: float
    est_mem_gib: float
    feasible: bool
    reason: str = ""
    micro_batch_tokens: int | None = None  # inference / train: tokens per micro-batch
    micro_batches: int | None = None  # ... and how many per dp replica (and minibatch) at full length
    gen_rounds: int | None = None  # generate: rounds per dp replica
    est_peak_gib: float = math.nan  # the fullest GPU of the mesh while the call runs (resident + call)
    turns: float | None = None  # multi-turn generate: turns per trajectory the estimate charges
    env_step_s: float | None = None  # ... seconds of one environment step
    env_wait_s: float | None = None  # ... the call's seconds waiting on environments (all rounds and runs)
    model_free: bool = False  # runs no model: a rule-based reward on the workers' host threads

    @property
    def runs_as(self) -> str:
        """'4 x 16384 tok', '2 rounds', '1 round, 4 turns, env 80.0 ms', 'host, no model' or ''
        (for tables)."""
        if self.model_free:
            return "host, no model"
        if self.gen_rounds is not None:
            rounds = f"{self.gen_rounds} round{'s' if self.gen_rounds > 1 else ''}"
            return rounds + self.turns_note
        if self.micro_batch_tokens is not None:
            return f"{self.micro_batches or '?'} x {self.micro_batch_tokens} tok"
        return self.turns_note.lstrip(", ")

    @property
    def turns_note(self) -> str:
        """', 4 turns, env 80.0 ms' for a multi-turn generate call (env: its environment wait); ''."""
        if self.turns is None:
            return ""
        turns = f"{self.turns:g}" if float(self.turns).is_integer() else f"{self.turns:.2f}"
        env = "" if self.env_wait_s is None else f", env {_seconds(self.env_wait_s)}"
        return f", {turns} turn{'' if self.turns == 1 else 's'}{env}"


@dataclass(frozen=True)
class PlanReport:
    """A plan and its estimates next to the symmetric baseline's."""

    algorithm: str
    cluster: str
    mode: str
    calls: tuple[CallRow, ...]
    est_iteration_s: float
    baseline_iteration_s: float
    search_s: float
    evaluated_plans: int
    peak_mem_gib: float  # fullest GPU over the simulated iterations: resident weights + largest transient
    gpu_mem_gib: float  # usable memory of one GPU
    memory_margin: float = 0.0  # fraction of gpu_mem_gib the plan keeps free
    max_staleness: int = 0  # run.max_staleness of the graph planned
    on_policy_iteration_s: float | None = None  # with max_staleness > 0: the best plan's estimate at k = 0
    models: tuple[ModelRow, ...] = ()  # trained models: weights and optimizer state on GPU and host
    offload_lines: tuple[str, ...] = ()  # their block of the printed table (app.reporting.model_memory)

    @property
    def speedup(self) -> float:
        """baseline / chosen iteration time; nan when either is not a finite positive time."""
        if _finite(self.baseline_iteration_s) and _finite(self.est_iteration_s) and self.est_iteration_s > 0:
            return self.baseline_iteration_s / self.est_iteration_s
        return math.nan

    @property
    def staleness_speedup(self) -> float:
        """on-policy (k = 0) / bounded-staleness estimate; nan without both."""
        on_policy = self.on_policy_iteration_s
        if on_policy is not None and _finite(on_policy) and _finite(self.est_iteration_s) and self.est_iteration_s > 0:
            return on_policy / self.est_iteration_s
        return math.nan


@dataclass(frozen=True)
class GanttBar:
    """One bar of a timeline: `row` (a GPU), [start_s, end_s), its text and kind (call, realloc, ...)."""

    row: int
    start_s: float
    end_s: float
    label: str
    kind: str


def plan_report(
    problem: PlanningProblem,
    plan: ExecutionPlan,
    sim: SimResult,
    *,
    mode: str,
    est_iteration_s: float,
    baseline_iteration_s: float,
    search_s: float,
    evaluated_plans: int,
    on_policy_iteration_s: float | None = None,
) -> PlanReport:
    """Rows of `plan` in graph order, each with call_cost's time and memory estimate at the
    execution the plan gives it (the simulator's choice where it names none); the peaks come
    from `sim`, the simulation of `plan`. on_policy_iteration_s: with bounded staleness, the
    estimate of the best on-policy plan beside it. Everything is priced with the plan's optimizer
    offload (`PlanningProblem.for_plan`)."""
    problem = problem.for_plan(plan)
    rows = []
    for mfc in problem.graph.mfcs:
        placement = plan[mfc.name]
        execution = plan.execution(mfc.name) or sim.executions.get(mfc.name)
        cost = call_cost(problem, mfc, placement, execution=execution)
        layout = placement.layout
        micro = cost.breakdown.get("micro_batches")
        turns = mfc.multi_turn
        env_wait = cost.breakdown.get("env_wait_s")
        rows.append(CallRow(mfc.name, mfc.role, mfc.kind, str(placement.mesh), layout.dp, layout.tp, layout.pp,
                            cost.time_s, cost.mem_bytes / GiB, cost.feasible, cost.reason,
                            execution.micro_batch_tokens if execution else None, int(micro) if micro else None,
                            execution.gen_rounds if execution else None,
                            sim.call_mem_bytes.get(mfc.name, math.nan) / GiB,
                            turns.turns if turns else None, turns.env_step_s if turns else None,
                            env_wait * mfc.expected_runs if turns and env_wait is not None else None,
                            mfc.model_free))
    models = model_rows(problem, plan, sim)
    c = problem.cluster
    return PlanReport(
        algorithm=problem.graph.algorithm,
        cluster=f"{c.nodes}x{c.gpus_per_node} {c.hardware.name}",
        mode=mode,
        calls=tuple(rows),
        est_iteration_s=est_iteration_s,
        baseline_iteration_s=baseline_iteration_s,
        search_s=search_s,
        evaluated_plans=evaluated_plans,
        peak_mem_gib=max(sim.peak_mem_bytes.values(), default=0.0) / GiB,
        gpu_mem_gib=c.hardware.mem_bytes / GiB,
        memory_margin=problem.memory_margin,
        max_staleness=problem.graph.max_staleness,
        on_policy_iteration_s=on_policy_iteration_s,
        models=models,
        offload_lines=tuple(format_model_rows(models, problem)),
    )


def format_plan_table(report: PlanReport) -> str:
    """The per-call table and the summary lines, as printed by `python -m app plan`."""
    header = ("call", "role", "kind", "mesh", "dp", "tp", "pp", "runs as", "est. time", "est. mem GiB",
              "GPU peak GiB")
    body = [
        (r.name, r.role, r.kind, r.mesh, str(r.dp), str(r.tp), str(r.pp), r.runs_as, _seconds(r.est_time_s),
         _gib(r.est_mem_gib) + ("" if r.feasible else " (infeasible)"), _gib(r.est_peak_gib))
        for r in report.calls
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    # Text columns align left, numbers right.
    numeric = {4, 5, 6, 8, 9, 10}

    def line(cells: tuple[str, ...]) -> str:
        padded = (c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    rule = "-" * len(line(header))
    speedup = "n/a" if math.isnan(report.speedup) else f"{report.speedup:.2f}x"
    summary = [
        f"{report.algorithm} on {report.cluster}, plan mode {report.mode}",
        f"estimated iteration time: {_seconds(report.est_iteration_s)}   "
        f"symmetric baseline: {_seconds(report.baseline_iteration_s)}   speedup: {speedup}",
        f"peak GPU memory: {_gib(report.peak_mem_gib)} of {_gib(report.gpu_mem_gib)} GiB"
        + (f" ({report.memory_margin:.0%} kept free)" if report.memory_margin else ""),
        f"search time: {report.search_s:.2f} s   evaluated plans: {report.evaluated_plans}",
    ]
    if report.max_staleness:
        gain = "n/a" if math.isnan(report.staleness_speedup) else f"{report.staleness_speedup:.2f}x"
        on_policy = math.nan if report.on_policy_iteration_s is None else report.on_policy_iteration_s
        summary.insert(2, f"max_staleness {report.max_staleness}: {_seconds(report.est_iteration_s)}   "
                          f"on-policy (max_staleness 0): {_seconds(on_policy)}   staleness speedup: {gain}")
    return "\n".join([line(header), rule, *map(line, body), rule, *report.offload_lines, *summary])


def plan_json(report: PlanReport) -> dict[str, Any]:
    """The report as a JSON-ready dict; non-finite numbers become None (strict JSON has no inf)."""
    return {
        "algorithm": report.algorithm,
        "cluster": report.cluster,
        "mode": report.mode,
        "calls": [
            {"name": r.name, "role": r.role, "kind": r.kind, "mesh": r.mesh, "dp": r.dp, "tp": r.tp, "pp": r.pp,
             "layout": f"dp{r.dp}tp{r.tp}pp{r.pp}", "micro_batch_tokens": r.micro_batch_tokens,
             "micro_batches": r.micro_batches, "gen_rounds": r.gen_rounds, "est_time_s": _json_number(r.est_time_s),
             "est_mem_gib": _json_number(r.est_mem_gib), "est_peak_gib": _json_number(r.est_peak_gib),
             "feasible": r.feasible, "turns": r.turns, "env_step_s": r.env_step_s,
             "env_wait_s": None if r.env_wait_s is None else _json_number(r.env_wait_s), "model_free": r.model_free}
            for r in report.calls
        ],
        "est_iteration_s": _json_number(report.est_iteration_s),
        "baseline_iteration_s": _json_number(report.baseline_iteration_s),
        "speedup": _json_number(report.speedup),
        # The plan in the shape of the config's plan.manual section, so it can be pinned as it is.
        "plan": {r.name: manual_entry(r) for r in report.calls},
        "peak_mem_gib": _json_number(report.peak_mem_gib),
        "gpu_mem_gib": report.gpu_mem_gib,
        "memory_margin": report.memory_margin,
        "search_s": report.search_s,
        "evaluated_plans": report.evaluated_plans,
        "max_staleness": report.max_staleness,
        "on_policy_iteration_s": _json_number(math.nan if report.on_policy_iteration_s is None
                                              else report.on_policy_iteration_s),
        "staleness_speedup": _json_number(report.staleness_speedup),
        # Per trained model, GiB per GPU on the GPU and in host memory; the offload in the shape of
        # the config's plan.optimizer_offload, so it can be pinned as it is.
        "models": model_rows_json(report.models),
        "optimizer_offload": {r.role: r.offload_fraction for r in report.models if r.offload_fraction},
    }


def manual_entry(row: CallRow) -> dict[str, Any]:
    """One call as a `plan.manual.<call>` entry: mesh, layout, and its micro-batching or rounds."""
    entry: dict[str, Any] = {"mesh": row.mesh, "layout": f"dp{row.dp}tp{row.tp}pp{row.pp}"}
    if row.micro_batch_tokens is not None:
        entry["micro_batch_tokens"] = row.micro_batch_tokens
    if row.gen_rounds is not None:
        entry["gen_rounds"] = row.gen_rounds
    return entry


def simulated_bars(sim: SimResult) -> list[GanttBar]:
    """One bar per (task, GPU) of a simulated timeline; labels carry the iteration number.

    Reallocation tasks ('realloc:actor_train->actor_gen') are labelled by their destination call.
    A train call with optimizer offload ends in its own bar of kind 'offload' ('actor_train #0
    offload'): the seconds its optimizer steps spend streaming host memory (`SimResult.offload_s`;
    spread over its steps in reality, drawn as one segment)."""
    bars = []
    for task in sim.tasks:
        name = "realloc>" + task.name.rsplit("->", 1)[-1] if task.kind == "realloc" else task.name
        label = f"{name} #{task.iteration}"
        offload = min(sim.offload_s.get(task.name, 0.0), task.end_s - task.start_s) if task.kind == "call" else 0.0
        split = task.end_s - offload
        bars.extend(GanttBar(gpu, task.start_s, split, label, task.kind) for gpu in task.gpus)
        if offload > 0:
            bars.extend(GanttBar(gpu, split, task.end_s, f"{label} offload", "offload") for gpu in task.gpus)
    return bars


def draw_gantt(bars: list[GanttBar], path: str | Path, title: str = "", n_rows: int | None = None,
               row_labels: list[str] | None = None) -> None:
    """Draw `bars` as a timeline PNG at `path`: one row per GPU, bars coloured by call name.

    Reallocations (kind 'realloc') are hatched grey, optimizer offload (kind 'offload') cross-
    hatched in its call's colour; other kinds than 'call' are drawn lighter so
    measured and estimated bars of the same call can share a chart. Bars too narrow for their
    text are left unlabelled; the legend names every colour. `row_labels` replaces "GPU <row>".
    """
    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = max(n_rows if n_rows is not None else max((b.row for b in bars), default=-1) + 1, 1)
    end = max((b.end_s for b in bars), default=1.0) or 1.0
    fig = Figure(figsize=(GANTT_WIDTH_IN, min(2.0 + 0.35 * rows, 40)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = _colours_by_call(bars)
    # Seconds one character of the bar text spans: the axes are ~75% of the figure width.
    char_s = end * GANTT_FONT_PT * 0.55 / (GANTT_WIDTH_IN * 72 * 0.75)
    for bar in bars:
        width = max(bar.end_s - bar.start_s, 0.0)
        realloc = bar.kind == "realloc"
        ax.barh(bar.row, width, left=bar.start_s, height=0.8,
                color="0.75" if realloc else colours[_call_name(bar.label)],
                alpha=1.0 if bar.kind in ("call", "realloc") else 0.55,
                hatch="//" if realloc else ("xx" if bar.kind == "offload" else None), edgecolor="black", linewidth=0.4)
        if width > (len(bar.label) + 1) * char_s:
            ax.text(bar.start_s + width / 2, bar.row, bar.label, ha="center", va="center",
                    fontsize=GANTT_FONT_PT, clip_on=True)
    handles = [Patch(facecolor=colour, edgecolor="black", label=name) for name, colour in colours.items()]
    if any(b.kind == "realloc" for b in bars):
        handles.append(Patch(facecolor="0.75", hatch="//", edgecolor="black", label="reallocation"))
    if any(b.kind == "offload" for b in bars):
        handles.append(Patch(facecolor="white", hatch="xx", edgecolor="black", label="optimizer offload (host)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=GANTT_FONT_PT + 1, frameon=False)
    ax.set_ylim(rows - 0.5, -0.5)  # GPU 0 at the top
    labels = row_labels if row_labels is not None and len(row_labels) == rows else [f"GPU {r}" for r in range(rows)]
    ax.set_yticks(range(rows), labels, fontsize=GANTT_FONT_PT)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)


def _colours_by_call(bars: list[GanttBar]) -> dict[str, Any]:
    """A stable colour per call name (first appearance order), cycling a qualitative palette."""
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    names = list(dict.fromkeys(_call_name(b.label) for b in bars if b.kind != "realloc"))
    return {name: palette(i % 10) for i, name in enumerate(names)}


def _call_name(label: str) -> str:
    """'actor_gen #1' -> 'actor_gen': bars of every iteration of a call share a colour."""
    return label.split(" #", 1)[0]


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _json_number(x: float) -> float | None:
    return float(x) if _finite(x) else None


def _gib(x: float) -> str:
    # Tiny CPU models use KiBs: keep two significant digits instead of printing 0.0.
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


def _seconds(x: float) -> str:
    if not _finite(x):
        return "infeasible"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
