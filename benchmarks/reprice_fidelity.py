"""Re-price the calls of a finished fidelity sweep with the current cost model, on CPU.

    python benchmarks/reprice_fidelity.py RESULTS_DIR [--freed-gib 13.81 --freed-train-gib 9.21]

RESULTS_DIR is the folder one run of `benchmarks/fidelity_bench.py` wrote on the GPU host
(fidelity.json and one directory per shape with its config.yaml and plan.json): `<out>/run-NNN`,
or the script's --out itself (e.g. `fidelity/` of run_gpu.sh's results.tgz), which stands for
its newest run. Nothing is written: the runs are only read. Every call is
priced at exactly the placement and execution its run used (`call_estimates`), and its peak is
set against the peak measured in the run (iteration 1, before calibration). Prints one line per
call and a table per run: median / max of |estimate - measured| / measured, before (the estimate
the run itself logged) and now.

--freed-gib / --freed-train-gib: GiB per trained role to subtract from a measured peak, for a
sweep measured before a runtime memory fix (an inference call and another role's training lose
the first, the role's own training the second). With both 0 (the default) the measured peaks are
compared as they are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import build_problem, load_config  # noqa: E402
from app.reporting.timeline import call_estimates  # noqa: E402
from benchmarks.run_dirs import latest_run_dir  # noqa: E402
from planning.dataflow import Graph  # noqa: E402
from planning.layout import Layout, Mesh  # noqa: E402
from planning.plan import CallExecution, ExecutionPlan, Placement  # noqa: E402

GIB = 2**30


def run_plan(plan_json: dict[str, Any], graph: Graph) -> tuple[ExecutionPlan, dict[str, tuple[str, str]]]:
    """The plan a run started with (placements, executions, optimizer offload) and each call's
    (kind, role).
    One-GPU sweeps only: every call on GPU 0 (a call the plan leaves out with the execution the
    simulator gives it)."""
    gpu0 = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))
    placements: dict[str, Placement] = {m.name: gpu0 for m in graph.mfcs}
    executions, kinds = {}, {m.name: (m.kind, m.role) for m in graph.mfcs}
    for call in plan_json["calls"]:
        if call["dp"] * call["tp"] * call["pp"] != 1:
            raise ValueError(f"call {call['name']}: layout {call['layout']}; this script re-prices one-GPU runs")
        name = call["name"]
        executions[name] = (CallExecution(gen_rounds=call["gen_rounds"]) if call["kind"] == "generate"
                            else CallExecution(micro_batch_tokens=call["micro_batch_tokens"]))
    plan = ExecutionPlan.from_dict(placements, executions).with_offload(plan_json.get("optimizer_offload") or {})
    return plan, kinds


def results_dir(path: Path) -> Path:
    """The run folder holding fidelity.json: `path` itself, else its newest run-NNN."""
    if (path / "fidelity.json").is_file():
        return path
    latest = latest_run_dir(path)
    if latest is None or not (latest / "fidelity.json").is_file():
        raise SystemExit(f"{path}: no fidelity.json here nor in a run-NNN folder of benchmarks/fidelity_bench.py")
    return latest


def reprice(results: Path, freed_gib: float, freed_train_gib: float) -> list[tuple[str, list[float], list[float]]]:
    """Per run: its name, the logged relative errors and the re-priced ones."""
    out = []
    for run in json.loads((results / "fidelity.json").read_text()):
        name = run["shape"]["name"]
        run_dir = results / name
        if not (run_dir / "plan.json").is_file():  # the run failed before it planned (its error says why)
            print(f"{name:28s} skipped: no plan ({run.get('error', '')[:100]})")
            continue
        cfg = load_config(run_dir / "config.yaml", ["data.path=toy", f"run.dir={run_dir / 'reprice'}"])
        problem = build_problem(cfg)
        plan, kinds = run_plan(json.loads((run_dir / "plan.json").read_text()), problem.graph)
        estimates = call_estimates(problem, plan)
        trained = {role for kind, role in kinds.values() if kind == "train"}
        logged, now = [], []
        for row in run["calls"]:
            call, measured = row["call"], row["measured_peak_gib"]
            if measured is None:
                continue
            kind, role = kinds[call]
            measured -= sum(freed_train_gib if (kind == "train" and r == role) else freed_gib for r in trained)
            estimate = estimates[call].peak_bytes / GIB
            logged.append(abs(row["est_peak_gib"] - measured) / measured)
            now.append(abs(estimate - measured) / measured)
            print(f"{name:28s} {call:13s} measured {measured:6.1f}  logged estimate {row['est_peak_gib']:6.1f}  "
                  f"now {estimate:6.1f} GiB  error {now[-1]:6.1%}")
        out.append((name, logged, now))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a run-NNN folder of a GPU sweep, or its --out (the newest run)")
    parser.add_argument("--freed-gib", type=float, default=0.0)
    parser.add_argument("--freed-train-gib", type=float, default=0.0)
    args = parser.parse_args()
    results = results_dir(args.results)
    print(f"re-pricing {results}")
    rows = reprice(results, args.freed_gib, args.freed_train_gib)
    print("\n| run | memory error, logged estimate (median / max) | re-priced (median / max) |")
    print("|---|---|---|")
    for name, logged, now in rows:
        if now:
            print(f"| {name} | {statistics.median(logged):.1%} / {max(logged):.1%} "
                  f"| {statistics.median(now):.1%} / {max(now):.1%} |")


if __name__ == "__main__":
    main()
