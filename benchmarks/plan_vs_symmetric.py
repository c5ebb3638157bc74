"""The searched plan against the symmetric plan (and asynchronous against on-policy), measured.

For each case it runs `python -m app train` N iterations with `plan.mode=search` and N with
`plan.mode=heuristic` (the symmetric baseline: every call on all GPUs with one shared layout, as
DeepSpeed-Chat and OpenRLHF run), optionally each again with `run.max_staleness=k`, all in this one
process tree, and prints per case and variant: the planner's estimated and the measured seconds
per iteration (steady state: the first iteration, which compiles and warms up, is left out), the
estimated and measured speedup of the searched plan over the symmetric one and their ratio, the
share of reallocation in the iteration, the bytes it moved, and the peak memory per GPU.

    python benchmarks/plan_vs_symmetric.py --cases 2gpu-ppo-1b --iterations 4      # GPU host
    python benchmarks/plan_vs_symmetric.py --tiny                                   # CPU, seconds

Cases are named `<gpus>gpu-<algorithm>-<models>`; those needing more GPUs than this host has are
skipped with a note (`--cases all` lists them).

Every run of this script writes into a fresh directory `<out>/plan_vs_symmetric/run-NNN/`
(benchmarks/run_dirs.py; `latest` beside it links to the newest), so the same command can run
again: results.json (the table's figures) and one training run.dir per variant,
`<case>-k<staleness>-<plan mode>/` (plan.json, metrics.jsonl, ...), all kept.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from benchmarks.run_dirs import fresh_run_dir  # noqa: E402

H200 = ("cluster.gpu=h200-141g", "plan.profile=examples/profiles/h200x2.json")


@dataclass(frozen=True)
class Case:
    """One experiment: a config and the overrides that size it to `gpus` GPUs of one node."""

    config: str
    gpus: int
    overrides: tuple[str, ...] = field(default_factory=tuple)


CASES: dict[str, Case] = {
    "8gpu-ppo-7b-7b": Case("examples/ppo-8gpu.yaml", 8, H200),
    "8gpu-ppo-7b-13b": Case("examples/ppo-8gpu.yaml", 8, (*H200, "models.critic.preset=llama-13b")),
    "8gpu-grpo-8b-g8": Case("examples/ppo-8gpu.yaml", 8, (*H200, "algorithm=grpo", "models.actor.preset=llama3-8b",
                                                           "models.critic=null", "batch.group_size=8",
                                                           "batch.prompts=64")),
    "4gpu-ppo-1.5b-1b": Case("examples/ppo-8gpu.yaml", 4, (*H200, "cluster.gpus_per_node=4",
                                                            "models.actor.preset=qwen2.5-1.5b",
                                                            "models.critic.preset=llama3.2-1b")),
    "2gpu-ppo-1b-1b": Case("examples/ppo-1b-h200x2.yaml", 2, ()),
    "tiny": Case("examples/ppo-tiny.yaml", 0, ("plan.seconds=2",)),
}
MODES = ("search", "heuristic")


def run_variant(case: Case, mode: str, staleness: int, iterations: int, run_dir: Path, seconds: float | None,
                limit_s: float) -> dict[str, Any]:
    """Train one variant in a subprocess; returns its plan.json, metrics rows and exit status."""
    overrides = [*case.overrides, f"plan.mode={mode}", f"run.iterations={iterations}", f"run.dir={run_dir}",
                 "tracking.wandb=false", "checkpoint.at_end=false"]
    if case.gpus:
        overrides.append("cluster.dashboard=false")
    if seconds is not None:
        overrides.append(f"plan.seconds={seconds}")
    if staleness:
        overrides.append(f"run.max_staleness={staleness}")
    cmd = [sys.executable, "-m", "app", "train", case.config, *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s, check=False)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": time.perf_counter() - start, "cmd": " ".join(cmd[1:])}
    if proc.returncode != 0:
        out["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return out
    out["plan"] = json.loads((run_dir / "plan.json").read_text())
    out["rows"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return out


def steady(rows: list[dict[str, Any]], key: str) -> float:
    """Mean of `key` over the iterations after the first (all of them when there is only one)."""
    values = [r[key] for r in rows[1:] or rows if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else math.nan


def summarise(result: dict[str, Any]) -> dict[str, float]:
    """Estimated and measured iteration time, reallocation share and bytes, peak memory."""
    if result["rc"] != 0:
        return {}
    rows = result["rows"]
    iteration = steady(rows, "timing_s/iteration")
    realloc = steady(rows, "timing_s/realloc")
    moved = steady(rows, "realloc/received_gb")
    peaks = [steady(rows, k) for k in rows[-1] if k.startswith("memory/") and k.endswith("_peak_gib")] if rows else []
    return {
        "est_s": float(result["plan"].get("est_iteration_s") or math.nan),
        "meas_s": iteration,
        "realloc_pct": 100.0 * realloc / iteration if iteration else math.nan,
        "realloc_gb": moved,
        "peak_gib": max((p for p in peaks if not math.isnan(p)), default=math.nan),
    }


def table(results: dict[tuple[str, int], dict[str, dict[str, Any]]]) -> str:
    """One row per (case, staleness, mode); the searched row carries the speedups."""
    head = ("case", "k", "plan", "est s/it", "meas s/it", "est x", "meas x", "meas/est", "realloc %", "realloc GB",
            "peak GiB")
    lines = [head]
    for (case, k), by_mode in results.items():
        stats = {mode: summarise(r) for mode, r in by_mode.items()}
        sym = stats.get("heuristic", {})
        for mode, s in stats.items():
            if not s:
                lines.append((case, str(k), mode, "failed: " + by_mode[mode].get("error", "?"), *[""] * 7))
                continue
            est_x = sym.get("est_s", math.nan) / s["est_s"] if mode == "search" and sym else math.nan
            meas_x = sym.get("meas_s", math.nan) / s["meas_s"] if mode == "search" and sym else math.nan
            lines.append((case, str(k), mode, f"{s['est_s']:.3f}", f"{s['meas_s']:.3f}", _x(est_x), _x(meas_x),
                          _x(meas_x / est_x), f"{s['realloc_pct']:.1f}", f"{s['realloc_gb']:.2f}",
                          f"{s['peak_gib']:.1f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="fit", help="comma-separated case names, 'fit' (those this host holds) "
                        f"or 'all'; known: {', '.join(CASES)}")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--staleness", default="0", help="comma-separated run.max_staleness values, e.g. 0,1")
    parser.add_argument("--seconds", type=float, default=None, help="plan.seconds for the search")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds one training run may take")
    parser.add_argument("--out", default=None, help="results folder; each run of the script writes "
                        "OUT/plan_vs_symmetric/run-NNN/ (default $OUT, else out)")
    parser.add_argument("--tiny", action="store_true", help="the CPU mode: the tiny case, 2 iterations")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations {args.iterations}: must be >= 1")
    gpus = visible_gpus()
    if args.tiny:
        names, args.iterations = ["tiny"], min(args.iterations, 2)
    elif args.cases in ("fit", "all"):
        names = [n for n, c in CASES.items() if n != "tiny" and (args.cases == "all" or 0 < c.gpus <= gpus)]
    else:
        names = args.cases.split(",")
        unknown = [n for n in names if n not in CASES]
        if unknown:
            parser.error(f"--cases {','.join(unknown)}: unknown; allowed: {', '.join(CASES)}")
    out = fresh_run_dir((Path(args.out or os.environ.get("OUT") or "out") / "plan_vs_symmetric").resolve())
    print(f"run directory: {out}", flush=True)
    results: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for name in names:
        case = CASES[name]
        if case.gpus > gpus:
            print(f"skip {name}: needs {case.gpus} GPUs, this host has {gpus}")
            continue
        for k in (int(v) for v in args.staleness.split(",")):
            results[(name, k)] = {}
            for mode in MODES:
                run_dir = out / f"{name}-k{k}-{mode}"
                print(f"== {name} staleness {k} plan {mode} -> {run_dir}", flush=True)
                results[(name, k)][mode] = run_variant(case, mode, k, args.iterations, run_dir, args.seconds,
                                                       args.limit)
    (out / "results.json").write_text(json.dumps({f"{n}/k{k}": {m: summarise(r) | {"rc": r["rc"]}
                                                                for m, r in v.items()}
                                                  for (n, k), v in results.items()}, indent=1, default=str))
    print(f"results: {out / 'results.json'}")
    print(table(results))
    return 0 if all(r["rc"] == 0 for v in results.values() for r in v.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
