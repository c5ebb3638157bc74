"""benchmarks/fidelity_bench.py --tiny: the GPU fidelity sweep's script on CPU (tiny models, one
virtual GPU), in a subprocess with its own local Ray: every run completes its iterations, each
call has an estimate and a measured time before and after calibration, and the table comes last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from app.reporting.timeline import call_estimates

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_mode_runs_and_reports(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "benchmarks/fidelity_bench.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run-001"  # each run of the script writes a run-NNN of its own under --out
    results = json.loads((run / "fidelity.json").read_text())
    assert [r["shape"]["name"] for r in results] == ["tiny-why-grpo", "tiny-ppo"]
    for result in results:
        assert result["iterations"] == 3 and not result["error"] and not result["oom"]
        assert {row["call"] for row in result["calls"]} >= {"actor_gen", "ref_inf", "actor_train"}
        for row in result["calls"]:
            assert row["est_s"] > 0 and row["measured_s"] > 0 and row["est_after_s"] > 0 and row["held_out_s"] > 0
            assert row["est_peak_gib"] > 0 and row["measured_peak_gib"] is None  # CPU: no memory statistics
        assert result["errors"]["time_before"]["median"] is not None
    table = done.stdout.strip().splitlines()
    assert table[-4].startswith("run") and table[-2].startswith("tiny-why-grpo") and table[-1].startswith("tiny-ppo")
    # Re-pricing the runs with the cost model that planned them gives back the logged estimates.
    for result in results:
        for row in result["calls"]:
            row["measured_peak_gib"] = row["est_peak_gib"]
    (run / "fidelity.json").write_text(json.dumps(results))
    # Given the --out folder, it re-prices the newest run.
    repriced = subprocess.run([sys.executable, "benchmarks/reprice_fidelity.py", str(tmp_path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    assert repriced.returncode == 0, repriced.stderr[-3000:]
    rows = [line for line in repriced.stdout.splitlines() if line.startswith("| tiny-")]
    assert [r.split(" | ")[2] for r in rows] == ["0.0% / 0.0% |"] * 2, repriced.stdout
    check_efficiency_fit(run)


def check_efficiency_fit(run: Path) -> None:
    """benchmarks/fit_efficiency.py on the sweep with measured times replaced by the cost model's
    own at known factors: the fit prices every call within 5% of them (tiny models leave the
    factors themselves only partly identifiable: fixed per-kernel costs dominate their calls)."""
    from benchmarks.fit_efficiency import fit, load_runs, run_errors
    from planning.efficiency import OpEfficiency

    truth = OpEfficiency(gemm=0.6, decode=0.4, elementwise=0.8)
    results = json.loads((run / "fidelity.json").read_text())
    for result, measured in zip(results, load_runs([run]), strict=True):
        estimates = call_estimates(replace(measured.problem, efficiency=truth), measured.plan)
        for row in result["calls"]:
            row["measured_s"] = estimates[row["call"]].seconds
    (run / "fidelity.json").write_text(json.dumps(results))
    runs = load_runs([run])
    start = runs[0].problem.efficiency
    assert start == OpEfficiency()  # the cpu preset has no fitted factors
    before = [abs(e) for r in runs for e in run_errors(r, start).values()]
    fitted = fit(runs, start, ("gemm", "decode", "elementwise"))
    after = [abs(e) for r in runs for e in run_errors(r, fitted).values()]
    assert max(before) > 0.3 and max(after) < 0.05, (before, after, fitted)


def test_steady_compares_the_first_plan_with_the_median_of_its_iterations(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--steady N: each call's estimate against its median over iterations 1..N (not one
    iteration: a host-bound call varies between iterations), with the fastest and slowest shown."""
    from app.reporting.timeline import TimelineRecord, append_records
    from benchmarks.fidelity_bench import compare, print_calls

    calls = [{"name": "ref_inf", "micro_batch_tokens": 1024, "micro_batches": 4, "gen_rounds": None}]
    (tmp_path / "plan.json").write_text(json.dumps({"calls": calls}))
    seconds = {0: 9.0, 1: 1.0, 2: 3.0, 3: 1.2}  # iteration 0 warms up (compiles) and is left out
    at = 100.0
    records = []
    for iteration, spent in seconds.items():
        records += [TimelineRecord(iteration, "ref_inf", "call", rank, at, at + spent * (0.5 + 0.5 * rank), est_s=1.5,
                                   est_peak_bytes=2**30) for rank in (0, 1)]
        at += 10.0
    append_records(tmp_path / "timeline.jsonl", records)
    result = compare(tmp_path, range(1, 4))
    row = result["calls"][0]
    # A call's seconds: its first rank's start to its last rank's end (rank 1 ends last here).
    assert (row["measured_s"], row["measured_min_s"], row["measured_max_s"]) == pytest.approx((1.2, 1.0, 3.0))
    assert result["measured_iterations"] == [1, 2, 3]
    assert result["errors"]["time_before"]["median"] == pytest.approx(1.5 / 1.2 - 1)
    single = compare(tmp_path)  # the default: iteration 1 alone
    assert single["calls"][0]["measured_s"] == single["calls"][0]["measured_max_s"] == pytest.approx(1.0)
    result.update({"shape": {"name": "toy"}, "iterations": 4, "wall_s": 1.0, "error": "", "steady": 3})
    print_calls(result)
    printed = capsys.readouterr().out
    assert "median of iterations 1-3" in printed
    assert printed.splitlines()[-1].split()[:8] == ["ref_inf", "4", "x", "1024", "tok", "1.5", "1.2", "1"]


def test_steady_and_iterations_exclude_each_other() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/fidelity_bench.py", "--steady", "2", "--iterations", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--steady=2" in done.stderr, done.stderr[-2000:]


def test_gpu_names_the_preset_a_shape_is_planned_with(tmp_path: Path) -> None:
    """--gpu h100-80g (priced with the H100's preset on an H100) reaches each shape's config."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity_bench import SHAPES, shape_config

    cfg = shape_config(SHAPES[0], tiny=False, run_dir=tmp_path, recalibrate=False, gpu="h100-80g")
    assert cfg.cluster.gpu == "h100-80g" and cfg.cluster.virtual_gpus is False
    assert shape_config(SHAPES[0], tiny=False, run_dir=tmp_path).cluster.gpu == "h200-141g"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/fidelity_bench.py", "--gpu", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--gpu: invalid choice: 'cpu'" in done.stderr
