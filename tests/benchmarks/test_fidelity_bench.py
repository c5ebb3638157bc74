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
    from planning.cost_terms import OpEfficiency

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
