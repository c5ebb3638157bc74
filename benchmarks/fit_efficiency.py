"""Fit a hardware preset's efficiency factors to the first plans of measured runs, on CPU.

    python benchmarks/fit_efficiency.py RESULTS_DIR [RESULTS_DIR ...] [--factors gemm,decode,elementwise]

Each RESULTS_DIR is what one run of `benchmarks/fidelity_bench.py` wrote on a GPU host (a
run-NNN folder, or its --out for the newest run): fidelity.json and one directory per shape with
its config.yaml and plan.json. Every call is priced at exactly the placement and execution its
run used, and set against the seconds measured in iteration 1 (the plan before calibration;
iteration 0 warms up). The factors (`planning.efficiency.OpEfficiency`) are fitted to all calls
of all runs at once, least squares on log time like `planning.calibrate`, and the script prints,
per run, the median / max of |estimate / measured - 1| with:

- logged: the estimate the run itself logged (the cost model and preset of that day);
- preset: the current cost model with the GPU's preset efficiencies (what a first plan says now);
- fitted: the current cost model with the factors fitted here;
- held out: each run priced with factors fitted to the OTHER runs only (the fit's honest error;
  the preset's with a single run).

The fitted factors are printed last, as `planning.efficiency.PRESET_EFFICIENCY` takes them.
Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import build_problem, load_config  # noqa: E402
from app.reporting.timeline import call_estimates  # noqa: E402
from benchmarks.reprice_fidelity import results_dir, run_plan  # noqa: E402
from planning.calibrate import fit_factors  # noqa: E402
from planning.cost import PlanningProblem  # noqa: E402
from planning.efficiency import OpEfficiency  # noqa: E402
from planning.plan import ExecutionPlan  # noqa: E402

DEFAULT_FACTORS = ("gemm", "decode", "elementwise")


@dataclass(frozen=True)
class MeasuredRun:
    """One shape's run: its problem (as its config builds it now), the plan it ran and the
    seconds each call took in iteration 1, and the estimates the run logged for them."""

    name: str
    problem: PlanningProblem
    plan: ExecutionPlan
    measured_s: dict[str, float]
    logged_s: dict[str, float]


def load_runs(dirs: list[Path]) -> list[MeasuredRun]:
    """Every run of the given sweeps that has a plan and at least one measured call."""
    runs = []
    for folder in dirs:
        results = results_dir(folder)
        for run in json.loads((results / "fidelity.json").read_text()):
            name = run["shape"]["name"]
            run_dir = results / name
            measured = {r["call"]: r["measured_s"] for r in run["calls"] if r.get("measured_s")}
            if not measured or not (run_dir / "plan.json").is_file():
                print(f"skipped {name}: no plan or no measured call ({run.get('error', '')[:120]})")
                continue
            cfg = load_config(run_dir / "config.yaml", ["data.path=toy", f"run.dir={run_dir / 'fit'}"])
            problem = build_problem(cfg)
            plan, _ = run_plan(json.loads((run_dir / "plan.json").read_text()), problem.graph)
            logged = {r["call"]: r["est_s"] for r in run["calls"] if r.get("measured_s") and r.get("est_s")}
            runs.append(MeasuredRun(name, problem, plan, measured, logged))
    return runs


def run_errors(run: MeasuredRun, efficiency: OpEfficiency | None) -> dict[str, float]:
    """Signed estimate / measured - 1 per call, priced with `efficiency` (None: the problem's own,
    i.e. the preset's)."""
    problem = run.problem if efficiency is None else replace(run.problem, efficiency=efficiency)
    estimates = call_estimates(problem, run.plan)
    return {call: estimates[call].seconds / seconds - 1.0 for call, seconds in run.measured_s.items()}


def fit(runs: list[MeasuredRun], start: OpEfficiency, factors: tuple[str, ...], sweeps: int = 3) -> OpEfficiency:
    """The factors minimising the sum over every call of log(estimate / measured)^2, one factor at
    a time by golden-section search (the others, and factors not named, stay)."""
    def misfit(efficiency: OpEfficiency) -> float:
        return sum(math.log1p(e) ** 2 for run in runs for e in run_errors(run, efficiency).values())

    return fit_factors(misfit, start, factors, sweeps, iterations=30)


def summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    return f"{statistics.median(absolute):5.1%} / {max(absolute):5.1%}" if absolute else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="run-NNN folders of GPU sweeps, or their --out")
    parser.add_argument("--factors", default=",".join(DEFAULT_FACTORS),
                        help=f"comma-separated OpEfficiency fields to fit (default: {','.join(DEFAULT_FACTORS)})")
    parser.add_argument("--no-hold-out", action="store_true", help="skip the leave-one-run-out fits (faster)")
    args = parser.parse_args()
    known = {f.name for f in fields(OpEfficiency)}
    factors = tuple(f for f in args.factors.split(",") if f)
    if not factors or set(factors) - known:
        parser.error(f"--factors={args.factors!r}: name fields of OpEfficiency ({', '.join(sorted(known))})")
    runs = load_runs(args.results)
    if not runs:
        raise SystemExit("no measured runs in " + ", ".join(map(str, args.results)))
    start = runs[0].problem.efficiency
    fitted = fit(runs, start, factors)
    print("\n| run | call | measured s | logged | preset | fitted |" + ("" if args.no_hold_out else " held out |"))
    print("|---|---|---|---|---|---|" + ("" if args.no_hold_out else "---|"))
    table: dict[str, list[list[float]]] = {}
    for run in runs:
        others = [r for r in runs if r is not run]
        held = None if args.no_hold_out else fit(others, start, factors) if others else start
        columns = [{c: run.logged_s[c] / s - 1.0 for c, s in run.measured_s.items() if c in run.logged_s},
                   run_errors(run, None), run_errors(run, fitted)] + ([] if held is None else [run_errors(run, held)])
        table[run.name] = [list(col.values()) for col in columns]
        for call, seconds in run.measured_s.items():
            cells = " | ".join(f"{col[call]:+.1%}" if call in col else "-" for col in columns)
            print(f"| {run.name} | {call} | {seconds:.3g} | {cells} |")
    print("\nmedian / max of |estimate / measured - 1| per run")
    print(f"{'run':<34} {'logged':>15} {'preset':>15} {'fitted':>15}" + ("" if args.no_hold_out else f" {'held out':>15}"))
    every: list[list[float]] = [[] for _ in range(4)]
    for name, columns in table.items():
        for i, col in enumerate(columns):
            every[i].extend(col)
        print(f"{name:<34} " + " ".join(f"{summary(col):>15}" for col in columns))
    print(f"{'all calls':<34} " + " ".join(f"{summary(col):>15}" for col in every if col))
    print("\nfitted: " + json.dumps({name: round(getattr(fitted, name), 3) for name in factors}))


if __name__ == "__main__":
    main()
