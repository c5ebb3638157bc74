"""Does the run do what the plan says? Estimated against measured time and peak memory per call.

    python benchmarks/fidelity_bench.py --out DIR          # one H200: the sweep + the issue's "Why" run
    python benchmarks/fidelity_bench.py --tiny --out DIR   # CPU, tiny models, virtual GPU: a quick check
    python benchmarks/fidelity_bench.py --sizes --iterations 2 --out DIR   # 0.5B/1.5B/3B actors, before calibration
    python benchmarks/fidelity_bench.py --sizes --steady 4 --out DIR   # first plans against 4 measured iterations
    python benchmarks/fidelity_bench.py --gpu h100-80g ...  # priced with another preset (on that GPU)

PPO and GRPO with Llama-3.2-1B-shaped models (random weights; the actor, its reference, a reward
model, and PPO's critic) on one GPU, over a sweep of batch shapes (64-512 sequences, 128-1024
prompt tokens, 256-2048 new tokens, 1 and 16 minibatches). Each shape is a real training run
(`app.run.Driver`): the plan is searched with a 10% memory margin, every call runs with the plan's
micro-batching / generation rounds, records its wall time and peak allocated memory, and after
`RECALIBRATE_AFTER` iterations the cost model is fitted to the run's own measurements
(`plan.recalibrate_after`). Prompts are random digit strings of exactly prompt_len tokens; the
random models rarely sample EOS, so responses are ~gen_len long, as the plan assumes.

Per call it reports the estimate before calibration against the measured time and peak of the
first iteration after warm-up (iteration 1), the calibrated estimate against the same iteration
(fitted) and against the next one (held out), whether any call ran out of memory although the
plan called it feasible, and how long Python's garbage collector and torch.compile held the call
in iteration 1 (`gc s`, `comp s`: the longest on one rank; actors.worker.host_pauses). With
`--steady N` the first plan is kept for the whole run (no calibration) and each call's estimate
is compared with its median over iterations 1..N, the table showing the fastest and slowest of
them (`min s`, `max s`): a small model's calls wait on the host, and one iteration of them varies
up to 2.5x between runs (docs/benchmarks.md, issue 27, tenth step). First,
the issue's "Why" shape (GRPO, 1B actor + 1B reward model, 64 prompts x 8 samples, 128-token
prompts, 512 new tokens, ppo_minibatches=1, no allocator setting by the user) runs
WHY_ITERATIONS iterations.

Every run of this script writes into a fresh directory `<out>/run-NNN/` (benchmarks/run_dirs.py;
`<out>/latest` links to the newest), so the same command can run again: fidelity.json (every
call of every shape) and one directory per shape (the run.dir of its training run: config.yaml,
prompts.jsonl, plan.json, timeline.jsonl, ...). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Run as a script from a checkout: make the repository's packages importable.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml

from app.config import ConfigError, ExperimentConfig, load_config
from app.reporting.timeline import TimelineRecord, read_records
from benchmarks.run_dirs import fresh_run_dir
from planning.hardware import HARDWARE_PRESETS

RECALIBRATE_AFTER = 2  # iterations 0 (warm-up) and 1 measured, the decision when iteration 2 is in
ITERATIONS = 3
WHY_ITERATIONS = 5
GIB = 2**30
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "MemoryError")


@dataclass(frozen=True)
class Shape:
    """One run: algorithm and batch (sequences = prompts x group)."""

    name: str
    algorithm: str
    prompts: int
    group: int
    prompt_len: int
    gen_len: int
    minibatches: int
    iterations: int = ITERATIONS
    actor: str = "llama3.2-1b"  # the actor's (and reference's) preset
    critic: str = "llama3.2-1b"  # the reward model's and PPO's critic's (a vocabulary like the actor's)

    @property
    def sequences(self) -> int:
        return self.prompts * self.group


SHAPES = (
    Shape("ppo-64x1024+256-mb1", "ppo", 64, 1, 1024, 256, 1),
    Shape("ppo-256x128+512-mb16", "ppo", 256, 1, 128, 512, 16),
    Shape("ppo-64x512+1024-mb16", "ppo", 64, 1, 512, 1024, 16),
    Shape("grpo-8x8x256+2048-mb1", "grpo", 8, 8, 256, 2048, 1),
    Shape("grpo-64x8x128+256-mb16", "grpo", 64, 8, 128, 256, 16),
    Shape("grpo-16x8x1024+256-mb1", "grpo", 16, 8, 1024, 256, 1),
)
WHY = Shape("why-grpo-64x8x128+512-mb1", "grpo", 64, 8, 128, 512, 1, WHY_ITERATIONS)
# Issue 25: an 8B actor that fits one H200 only with part of its optimizer state in host memory
# (the plan chooses how much); selected with --only, not part of the default sweep.
OFFLOAD = Shape("offload-grpo-8b-32x8x128+512", "grpo", 32, 8, 128, 512, 1, 5, actor="llama3-8b")
# Issue 27: other model sizes, to set and check the preset's efficiencies beyond the 1B sweep
# (`--sizes`; the Qwen actors' reward model and critic are Qwen too: the same vocabulary).
SIZES = (
    Shape("size-0.5b-grpo-64x8x256+512-mb4", "grpo", 64, 8, 256, 512, 4, actor="qwen2.5-0.5b", critic="qwen2.5-0.5b"),
    Shape("size-1.5b-ppo-128x512+512-mb8", "ppo", 128, 1, 512, 512, 8, actor="qwen2.5-1.5b", critic="qwen2.5-0.5b"),
    Shape("size-3b-grpo-32x8x128+1024-mb1", "grpo", 32, 8, 128, 1024, 1, actor="llama3.2-3b"),
)
TINY_SHAPES = (Shape("tiny-ppo", "ppo", 8, 1, 16, 8, 2),)
TINY_WHY = Shape("tiny-why-grpo", "grpo", 2, 4, 16, 8, 1)


def write_prompts(path: Path, n: int, prompt_len: int, seed: int = 0) -> None:
    """n prompts of random digits, prompt_len tokens each with the toy tokenizer's bos."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as sink:
        for _ in range(n):
            sink.write(json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(prompt_len - 1))}) + "\n")


def shape_config(shape: Shape, tiny: bool, run_dir: Path, recalibrate: bool = True,
                 gpu: str = "h200-141g") -> ExperimentConfig:
    """The experiment of one shape (a plan searched for one GPU of hardware preset `gpu`,
    recalibrated after 2 iterations unless not `recalibrate`), written to <run_dir>/config.yaml so
    that `python -m app train` can repeat it."""
    data = run_dir / "prompts.jsonl"
    write_prompts(data, shape.prompts * 2, shape.prompt_len)
    model, critic = ("tiny", "tiny-critic") if tiny else (shape.actor, shape.critic)
    models: dict[str, Any] = {"actor": {"preset": model}, "reward": {"preset": critic}}
    if shape.algorithm == "ppo":
        models["critic"] = {"preset": critic}
    cluster = ({"nodes": 1, "gpus_per_node": 1, "gpu": "cpu", "virtual_gpus": True, "dashboard": False} if tiny
               else {"nodes": 1, "gpus_per_node": 1, "gpu": gpu, "dashboard": False})
    raw = {
        "algorithm": shape.algorithm, "models": models,
        "batch": {"prompts": shape.prompts, "prompt_len": shape.prompt_len, "gen_len": shape.gen_len,
                  "ppo_minibatches": shape.minibatches, "group_size": shape.group},
        "cluster": cluster,
        "plan": {"mode": "search", "seconds": 1 if tiny else 3, "memory_margin": 0.1,
                 "recalibrate_after": RECALIBRATE_AFTER if recalibrate else None},
        "data": {"path": str(data), "tokenizer": "toy", "max_prompt_len": shape.prompt_len},
        "reward": {"function": None},
        "tracking": {"wandb": False, "console": False},
        "checkpoint": {"every": 0, "at_end": False},
        "run": {"name": shape.name, "dir": str(run_dir), "iterations": shape.iterations},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(run_dir / "config.yaml")


def run_shape(shape: Shape, tiny: bool, out: Path, steady: int = 0, gpu: str = "h200-141g") -> dict[str, Any]:
    """Train one shape in a new directory out/<shape name>, planned with hardware preset `gpu`;
    returns what ran (iterations, OOM, error) and the per-call comparison. steady > 0: the first
    plan kept for 1 + steady iterations, measured over iterations 1..steady (module docstring)."""
    from app.run import Driver, DriverError

    run_dir = out / shape.name
    run_dir.mkdir(parents=True)  # out is this run's own directory: a second run never reuses a run.dir
    if steady:
        shape = replace(shape, iterations=1 + steady)
    cfg = shape_config(shape, tiny, run_dir, recalibrate=not steady, gpu=gpu)
    start = time.perf_counter()
    error, iterations = "", 0
    try:
        driver = Driver(cfg, run_dir)
        iterations = len(driver.run())
    except (DriverError, ConfigError, RuntimeError) as exc:  # RuntimeError: a worker failed during set-up
        error = " ".join(str(exc).split())[:400]
    result: dict[str, Any] = {"shape": asdict(shape), "wall_s": time.perf_counter() - start, "iterations": iterations,
                              "error": error, "oom": any(m in error for m in OOM_MARKERS),
                              "planned": (run_dir / "plan.json").is_file()}
    result["steady"] = steady
    result.update(compare(run_dir, range(1, 1 + steady) if steady else range(1, 2)))
    return result


def _call_seconds(records: list[TimelineRecord], name: str, iteration: int) -> float | None:
    mine = [r for r in records if r.kind == "call" and r.name == name and r.iteration == iteration]
    return max(r.end for r in mine) - min(r.start for r in mine) if mine else None


def _paused(records: list[TimelineRecord], name: str, iteration: int, field: str) -> float | None:
    """The longest time one rank spent in garbage collection (field gc_s) or compiling
    (compile_s) during the call; None where not recorded."""
    paused = [getattr(r, field) for r in records if r.kind == "call" and r.name == name and r.iteration == iteration]
    measured = [p for p in paused if p is not None]
    return max(measured) if measured else None


def _measured(records: list[TimelineRecord], name: str, iterations: range) -> dict[str, float | None]:
    """The call's median seconds over `iterations` (those it ran), and the fastest and slowest."""
    seconds = [s for s in (_call_seconds(records, name, i) for i in iterations) if s is not None]
    if not seconds:
        return {"measured_s": None, "measured_min_s": None, "measured_max_s": None}
    return {"measured_s": statistics.median(seconds), "measured_min_s": min(seconds), "measured_max_s": max(seconds)}


def compare(run_dir: Path, measured: range = range(1, 2)) -> dict[str, Any]:
    """Per call: estimated vs measured seconds (the median over the iterations `measured`) and
    peak GiB, before and after calibration (where the run calibrated)."""
    records = read_records(run_dir / "timeline.jsonl")
    history_file = run_dir / "plan_history.jsonl"
    history = json.loads(history_file.read_text().splitlines()[0]) if history_file.is_file() else None
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").is_file() else {}
    rows = []
    for call in plan.get("calls", []):
        name = call["name"]
        mine = [r for r in records if r.kind == "call" and r.name == name and r.iteration < RECALIBRATE_AFTER]
        if not mine:
            continue
        peaks = [r.peak_allocated_bytes for r in mine if r.peak_allocated_bytes is not None]
        after = (history or {}).get("calls", {}).get(name, {})
        rows.append({
            "call": name, "runs_as": {k: call.get(k) for k in ("micro_batch_tokens", "micro_batches", "gen_rounds")},
            "est_s": mine[0].est_s, **_measured(records, name, measured), "gc_s": _paused(records, name, 1, "gc_s"),
            "compile_s": _paused(records, name, 1, "compile_s"),
            "est_after_s": after.get("est_after_s"), "held_out_s": _call_seconds(records, name, RECALIBRATE_AFTER),
            "est_peak_gib": mine[0].est_peak_bytes / GIB if mine[0].est_peak_bytes else None,
            "measured_peak_gib": max(peaks) / GIB if peaks else None,
            "est_peak_after_gib": after.get("est_peak_after_gib"),
        })
    errors = {
        "time_before": _errors(rows, "est_s", "measured_s"),
        "time_after_fit": _errors(rows, "est_after_s", "measured_s"),
        "time_after_held_out": _errors(rows, "est_after_s", "held_out_s"),
        "mem_before": _errors(rows, "est_peak_gib", "measured_peak_gib"),
        "mem_after": _errors(rows, "est_peak_after_gib", "measured_peak_gib"),
    }
    switched = [entry for entry in plan.get("history", []) if entry.get("switched")]
    return {"measured_iterations": list(measured), "calls": rows, "errors": errors,
            "switched_at": plan.get("since_iteration") if switched else None,
            "efficiency": (history or {}).get("efficiency"), "memory_scale": (history or {}).get("memory_scale"),
            "step": step_comparison(run_dir, records, history), "optimizer_offload": plan.get("optimizer_offload")}


def step_comparison(run_dir: Path, records: list[TimelineRecord], history: dict[str, Any] | None) -> dict[str, Any]:
    """The iteration after calibration: measured seconds (median over the iterations from
    RECALIBRATE_AFTER on, first call start to last call end) against the calibrated estimate, and
    the seconds the optimizer's host part took per iteration (actor/offload_s x optimizer steps)."""
    spans: dict[int, list[float]] = {}
    for r in records:
        if r.kind == "call" and r.iteration >= RECALIBRATE_AFTER:
            span = spans.setdefault(r.iteration, [math.inf, -math.inf])
            span[0], span[1] = min(span[0], r.start), max(span[1], r.end)
    measured = statistics.median(end - start for start, end in spans.values()) if spans else None
    offload = []
    metrics_file = run_dir / "metrics.jsonl"
    for line in metrics_file.read_text().splitlines() if metrics_file.is_file() else []:
        entry = json.loads(line)
        if entry.get("iteration", -1) >= RECALIBRATE_AFTER and "actor/offload_s" in entry:
            offload.append(entry["actor/offload_s"] * entry.get("actor/optimizer_steps", 1.0))
    estimate = (history or {}).get("current_est_iteration_s")
    return {"measured_s": measured, "est_after_s": estimate,
            "error": abs(estimate / measured - 1.0) if estimate and measured else None,
            "offload_s": statistics.median(offload) if offload else None}


def _errors(rows: list[dict[str, Any]], estimate: str, measured: str) -> dict[str, float | None]:
    """Median and max of |estimate / measured - 1| over the calls that have both."""
    values = [abs(r[estimate] / r[measured] - 1.0) for r in rows if r.get(estimate) and r.get(measured)]
    return {"median": statistics.median(values), "max": max(values)} if values else {"median": None, "max": None}


def _pct(error: dict[str, float | None]) -> str:
    if error["median"] is None:
        return "n/a"
    return f"{100 * error['median']:.0f}/{100 * error['max']:.0f}%"


def print_calls(result: dict[str, Any]) -> None:
    print(f"\n{result['shape']['name']}: {result['iterations']} iterations, {result['wall_s']:.0f} s"
          + (f", error: {result['error'][:160]}" if result["error"] else ""))
    step = result.get("step") or {}
    if step.get("measured_s"):
        share = f", optimizer offload {step['offload_s']:.2f} s of it" if step.get("offload_s") else ""
        est = f"{step['est_after_s']:.2f}" if step.get("est_after_s") else "-"
        when = "at the first plan, iterations 2 on" if result.get("steady") else "after calibration"
        print(f"  step {when}: measured {step['measured_s']:.2f} s, estimated {est} s{share}; "
              f"optimizer offload in the plan: {result.get('optimizer_offload')}")
    measured = result.get("measured_iterations") or [1]
    if result.get("steady"):
        print(f"  meas s: the median of iterations {measured[0]}-{measured[-1]} (min s, max s: the fastest and "
              "slowest), all at the first plan")
    print(f"  {'call':<13} {'runs as':<22} {'est s':>7} {'meas s':>7} {'min s':>7} {'max s':>7} {'cal s':>7} "
          f"{'held s':>7} {'est GiB':>8} {'meas GiB':>8} {'cal GiB':>8} {'gc s':>6} {'comp s':>6}")
    for row in result["calls"]:
        how = row["runs_as"]
        runs = (f"{how['gen_rounds']} round(s)" if how["gen_rounds"]
                else f"{how['micro_batches']} x {how['micro_batch_tokens']} tok")
        cells = [row.get(k) for k in ("est_s", "measured_s", "measured_min_s", "measured_max_s", "est_after_s",
                                      "held_out_s", "est_peak_gib", "measured_peak_gib", "est_peak_after_gib")]
        text = ["-" if v is None else f"{v:.3g}" for v in cells]
        pauses = ["-" if row.get(k) is None else f"{row[k]:.3f}" for k in ("gc_s", "compile_s")]
        print(f"  {row['call']:<13} {runs:<22} " + " ".join(f"{t:>7}" for t in text[:6]) + " "
              + " ".join(f"{t:>8}" for t in text[6:]) + " " + " ".join(f"{t:>6}" for t in pauses))


def summary_table(results: list[dict[str, Any]]) -> str:
    """One line per run; errors are median/max |estimate / measured - 1| over its calls."""
    head = (f"{'run':<27} {'iters':>5} {'OOM':>4} {'time before':>11} {'after fit':>9} {'held out':>9} "
            f"{'mem before':>10} {'mem after':>9} {'s/iter':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        e = r["errors"]
        per_iter = r["wall_s"] / r["iterations"] if r["iterations"] else math.nan
        oom = "yes" if r["oom"] else "no"
        lines.append(f"{r['shape']['name']:<27} {r['iterations']:>2}/{r['shape']['iterations']:<2} {oom:>4} "
                     f"{_pct(e['time_before']):>11} {_pct(e['time_after_fit']):>9} {_pct(e['time_after_held_out']):>9} "
                     f"{_pct(e['mem_before']):>10} {_pct(e['mem_after']):>9} {per_iter:>7.1f}")
    return "\n".join(lines)


def start_ray(tiny: bool) -> None:
    """A local Ray of its own for the whole sweep (virtual GPU on CPU), without the dashboard."""
    import ray

    # The workers import this checkout first, then whatever this process found on its own path
    # (on the GPU host: the wheels unpacked into /tmp/site).
    search_path = [str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False,
                              "runtime_env": {"env_vars": {"PYTHONPATH": os.pathsep.join(search_path)}}}
    if tiny:
        kwargs.update(num_cpus=2, num_gpus=1)
    ray.init(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny models, one virtual GPU: checks the script")
    parser.add_argument("--out", default="fidelity-out",
                        help="results folder; each run of the script writes OUT/run-NNN/ (fidelity.json, the runs)")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--sizes", action="store_true",
                        help="the other model sizes (SIZES: 0.5B, 1.5B and 3B actors, then the 8B offload run) "
                             "instead of the 1B sweep")
    parser.add_argument("--iterations", type=int, default=0,
                        help="iterations of every run (default: each shape's own); 2 measures the plan "
                             "before calibration only (iteration 0 warms up, iteration 1 is compared)")
    parser.add_argument("--steady", type=int, default=0,
                        help="keep the first plan (no calibration) for 1 + STEADY iterations and compare each "
                             "call's estimate with its median over iterations 1..STEADY")
    parser.add_argument("--gpu", default="h200-141g", choices=[n for n in HARDWARE_PRESETS if n != "cpu"],
                        help="the hardware preset the plans are priced with (default h200-141g; ignored with --tiny)")
    args = parser.parse_args()
    if args.iterations < 0 or args.iterations == 1:
        parser.error(f"--iterations={args.iterations}: 0 (each shape's own) or >= 2 (iteration 1 is the one measured)")
    if args.steady < 0 or (args.steady and args.iterations):
        parser.error(f"--steady={args.steady}: >= 1 measured iterations after the warm-up, and not with --iterations "
                     "(the run then has 1 + STEADY)")
    out = fresh_run_dir(Path(args.out).resolve())
    print(f"run directory: {out}", flush=True)
    # The run first: if the device's time limit cuts the sweep short, it is not the one lost.
    shapes = [TINY_WHY if args.tiny else WHY, *(TINY_SHAPES if args.tiny else SHAPES)]
    if args.sizes:  # the 8B run last: a device time limit cuts it rather than the others
        shapes = list(TINY_SHAPES if args.tiny else (*SIZES, OFFLOAD))
    if args.only:
        known = {s.name: s for s in [*shapes, *SIZES, OFFLOAD]}
        shapes = [known[name] for name in args.only.split(",") if name in known]
    if args.iterations:
        shapes = [replace(s, iterations=args.iterations) for s in shapes]
    start_ray(args.tiny)
    results = []
    for shape in shapes:
        results.append(run_shape(shape, args.tiny, out, args.steady, args.gpu))
        print_calls(results[-1])
        (out / "fidelity.json").write_text(json.dumps(results, indent=1))
    measured = f"the median of iterations 1-{args.steady}" if args.steady else "iteration 1"
    print(f"\nerrors: median/max over calls of |estimate / measured - 1| (measured: {measured}); before = the "
          "searched plan's estimate, after = calibrated on iteration 1 (fit) and checked on iteration 2 (held out)")
    print(f"results: {out / 'fidelity.json'}")
    print(summary_table(results))


if __name__ == "__main__":
    main()
