"""`python -m app profile`: the measured profile JSON, its loaders, and its effect on planning.

The profile runs for real in quick mode on CPU (seconds); one dist case spawns 2 gloo processes
for the collective benchmarks. The efficiency fit is checked against factors it must recover.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.worker.profile_fit import (
    fit_efficiency,
    fit_tp_comm,
    predicted_seconds,
    predicted_tp_fwd_bwd_s,
    solve_efficiency,
)
from actors.worker.profiler import (
    MIN_EFFICIENCY,
    EngineTiming,
    ProfileSettings,
    cut_model,
    measure_collectives,
    tp_fwd_bwd_seconds,
)
from app.cli import main
from app.cli.profile import default_preset, format_table
from app.config.experiment import load_config
from app.config.problem import build_problem, manual_plan
from planning.cost import call_cost
from planning.efficiency import OpEfficiency
from planning.hardware import HardwareSpec, hardware_preset
from planning.models import model_preset

ROOT = Path(__file__).resolve().parents[3]
TINY_PPO = ROOT / "examples" / "ppo-tiny.yaml"


def quick_settings() -> ProfileSettings:
    return ProfileSettings.choose("cpu", cut_model(model_preset("tiny"), 2), quick=True)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real quick CPU profile (1 rank), shared by the tests that read it."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    assert main(["profile", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    return out


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


def planned_times(capsys: pytest.CaptureFixture[str], *overrides: str) -> dict[str, float]:
    """est_time_s per call of the (manually pinned) tiny PPO plan, via `python -m app plan --json`."""
    capsys.readouterr()
    assert main(["plan", str(TINY_PPO), "--json", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    return {call["name"]: call["est_time_s"] for call in report["calls"]}


# ---- the written profile -------------------------------------------------------------------------


@pytest.mark.unit
def test_quick_profile_writes_sane_positive_values(quick_profile: Path) -> None:
    data = json.loads(quick_profile.read_text())
    for key in ("peak_flops", "hbm_bw"):
        assert math.isfinite(data[key]) and data[key] > 0
    assert "intra_node_bw" not in data and "mem_bytes" not in data  # 1 rank on CPU measures neither
    assert set(data["efficiency"]) == {"gemm", "decode", "optimizer"}  # comm needs 2 ranks
    assert all(0 < v <= 1 for v in data["efficiency"].values())
    assert data["preset"] == "cpu"
    meas = data["measurements"]
    assert meas["machine"]["torch"] == torch.__version__ and meas["machine"]["device_type"] == "cpu"
    assert meas["machine"]["dtype"] == "float32" and meas["quick"] is True
    assert datetime.fromisoformat(meas["date"]).tzinfo is not None
    assert meas["matmul"]["square_flops"] == data["peak_flops"] and meas["matmul"]["llm_flops"] > 0
    assert meas["collectives"] is None
    for row in meas["validation"].values():
        assert row["measured_s"] > 0 and row["preset_s"] > 0 and row["profile_s"] > 0
    # The fitted factors make the cost model reproduce what was measured, unless clamped at 1.
    for key, factor in (("fwd_bwd_s", "gemm"), ("optimizer_s", "optimizer")):
        row = meas["validation"][key]
        if MIN_EFFICIENCY < data["efficiency"][factor] < 1.0:
            assert row["profile_s"] == pytest.approx(row["measured_s"], rel=1e-3)


@pytest.mark.unit
def test_profile_loads_into_hardware_spec_and_efficiency(quick_profile: Path) -> None:
    data = json.loads(quick_profile.read_text())
    preset = hardware_preset("cpu")
    hw = preset.with_profile(quick_profile)
    assert (hw.peak_flops, hw.hbm_bw) == (data["peak_flops"], data["hbm_bw"])
    assert (hw.name, hw.mem_bytes, hw.intra_node_bw) == (preset.name, preset.mem_bytes, preset.intra_node_bw)
    eff = OpEfficiency.from_dict(data["efficiency"])
    assert (eff.gemm, eff.decode, eff.optimizer, eff.comm) == (
        data["efficiency"]["gemm"], data["efficiency"]["decode"], data["efficiency"]["optimizer"], 1.0)


@pytest.mark.unit
def test_table_shows_measured_beside_preset(quick_profile: Path) -> None:
    table = format_table(json.loads(quick_profile.read_text()), hardware_preset("cpu"))
    lines = table.splitlines()
    assert "against preset cpu" in lines[0]
    assert any(line.startswith("peak_flops (TFLOP/s)") for line in lines)
    assert any(line.startswith("efficiency: gemm") for line in lines)
    assert {"fwd_bwd_s", "optimizer_s", "decode_step_s"} <= {line.split()[0] for line in lines}


# ---- the profile in a config ---------------------------------------------------------------------


@pytest.mark.unit
def test_config_with_measured_profile_plans_with_its_numbers(quick_profile: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(quick_profile.read_text())
    problem = build_problem(load_config(TINY_PPO, [f"plan.profile={quick_profile}"]))
    assert problem.cluster.hardware.peak_flops == data["peak_flops"]
    assert problem.efficiency == OpEfficiency.from_dict(data["efficiency"])
    baseline = planned_times(capsys)
    profiled = planned_times(capsys, f"plan.profile={quick_profile}")
    assert baseline.keys() == profiled.keys()
    assert all(t > 0 for t in profiled.values()) and profiled != baseline


@pytest.mark.unit
def test_efficiency_block_scales_the_estimates_exactly(tmp_path: Path) -> None:
    """Measured fields replace the preset's and each factor scales its own term: with HBM made
    free, halving gemm doubles the train compute; with FLOPs made free, decode=0.25 quadruples
    the decode streaming and gemm leaves it alone."""
    cfg = load_config(TINY_PPO)
    calls = {m.name: m for m in build_problem(cfg).graph.mfcs}
    placements = manual_plan(cfg, build_problem(cfg))
    assert placements is not None

    def parts(profile: dict[str, Any], call: str) -> dict[str, float]:
        path = write_json(tmp_path / f"profile-{len(list(tmp_path.iterdir()))}.json", profile)
        problem = build_problem(load_config(TINY_PPO, [f"plan.profile={path}"]))
        return call_cost(problem, calls[call], placements[call]).breakdown

    fast_hbm = {"hbm_bw": 1e18}
    train = parts(fast_hbm, "actor_train")["compute_s"]
    assert parts({**fast_hbm, "efficiency": {"gemm": 0.5}}, "actor_train")["compute_s"] == pytest.approx(2 * train)
    fast_flops = {"peak_flops": 1e18}
    decode = parts(fast_flops, "actor_gen")["decode_s"]
    assert parts({**fast_flops, "efficiency": {"decode": 0.25}}, "actor_gen")["decode_s"] == pytest.approx(4 * decode)
    assert parts({**fast_flops, "efficiency": {"gemm": 0.5}}, "actor_gen")["decode_s"] == pytest.approx(decode)
    assert parts(fast_flops, "actor_gen")["decode_s"] < parts({}, "actor_gen")["decode_s"]  # the field itself counts


@pytest.mark.unit
@pytest.mark.parametrize("content", [{"efficiency": {"gemm": 1.5}}, {"efficiency": {"speed": 0.5}},
                                     {"efficiency": [0.5]}, [1, 2]])
def test_bad_profile_in_config_is_a_config_error(tmp_path: Path, content: Any,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    assert main(["plan", str(TINY_PPO), f"plan.profile={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: plan.profile=")


# ---- fitting ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_solve_efficiency_inverts_a_decreasing_prediction() -> None:
    def predict(e: float) -> float:
        return 2.0 + 3.0 / e

    assert solve_efficiency(8.0, predict) == pytest.approx(0.5, rel=1e-9)
    assert solve_efficiency(4.0, predict) == 1.0  # faster than the model at full efficiency
    assert solve_efficiency(1e9, predict) == MIN_EFFICIENCY
    assert solve_efficiency(7.0, lambda e: 3.0) == 1.0  # the factor changes nothing
    with pytest.raises(ValueError, match="measured_s"):
        solve_efficiency(0.0, predict)


@pytest.mark.unit
def test_fit_recovers_the_factors_that_produced_the_times() -> None:
    settings = quick_settings()
    hw = hardware_preset("cpu")
    truth = OpEfficiency(gemm=0.4, decode=0.3, optimizer=0.6)
    fwd = predicted_seconds(hw, OpEfficiency(gemm=truth.gemm), settings)["fwd_bwd_s"]
    opt = predicted_seconds(hw, OpEfficiency(optimizer=truth.optimizer), settings)["optimizer_s"]
    step = predicted_seconds(hw, OpEfficiency(gemm=truth.gemm, decode=truth.decode), settings)["decode_step_s"]
    extra = settings.decode_steps[1] - settings.decode_steps[0]
    fitted = fit_efficiency(hw, settings, EngineTiming(fwd, opt, 1.0, 1.0 + step * extra))
    for name in ("gemm", "decode", "optimizer"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    slower = predicted_seconds(hw, OpEfficiency(gemm=0.5, decode=0.5, optimizer=0.5), settings)
    faster = predicted_seconds(hw, OpEfficiency(), settings)
    assert all(slower[k] > faster[k] > 0 for k in faster)


def test_tp_comm_fit_recovers_the_factor_of_a_tp_step() -> None:
    settings = quick_settings()
    hw = hardware_preset("h200-141g")
    base = OpEfficiency(gemm=0.6, decode=0.5, optimizer=0.2, comm=0.8)
    measured = predicted_tp_fwd_bwd_s(hw, replace(base, tp_comm=0.3), settings, tp=2)
    assert fit_tp_comm(hw, base, settings, 2, measured) == pytest.approx(0.3, rel=1e-6)
    # The GPU profile's sizes (a 2-layer Llama-3.2-1B, 8 x 1024 tokens): without sequence
    # parallelism a tp=2 step takes more than half the tp=1 one even over free links.
    gpu = ProfileSettings.choose("cuda", cut_model(model_preset("llama3.2-1b"), 2), quick=False)
    one = predicted_seconds(hw, base, gpu)["fwd_bwd_s"]
    free_links = predicted_tp_fwd_bwd_s(hw, replace(base, comm=1.0), gpu, tp=2)
    assert one / 2 < free_links < one
    assert fit_tp_comm(hw, base, gpu, 2, free_links / 2) == 1.0  # faster than any link rate explains


# ---- arguments ----------------------------------------------------------------------------------------


def exit_status(argv: list[str]) -> int:
    """main's return value, or the status of the SystemExit argparse raises on a usage error."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.unit
@pytest.mark.parametrize("args, named", [
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "99"], "--ranks"),
    (["--ranks", "two"], "--ranks"),
    (["--gpu", "b200"], "--gpu"),
    (["--model", "gpt2"], "--model"),
    (["--layers", "0"], "--layers"),
    (["--layers", "5"], "--layers"),
    (["--out", "/nonexistent-dir/profile.json"], "--out"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_exit_2_with_one_line(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    device = [] if args[0] == "--device" else ["--device", "cpu"]
    assert exit_status(["profile", "--quick", *device, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and named in err


@pytest.mark.unit
def test_cuda_without_a_gpu_and_unknown_gpu_names_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        assert main(["profile", "--device", "cuda"]) == 2
        assert "--device cuda" in capsys.readouterr().err
    assert default_preset("NVIDIA H200") == "h200-141g" and default_preset("NVIDIA A100-SXM4-80GB") == "a100-80g"
    with pytest.raises(ValueError, match="--gpu"):
        default_preset("Radeon 7900")


# ---- collectives (2 gloo processes) ----------------------------------------------------------------


@pytest.mark.dist
def test_two_rank_profile_measures_links(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "profile2.json"
    assert main(["profile", "--quick", "--device", "cpu", "--ranks", "2", "--out", str(out)]) == 0
    assert "intra_node_bw (GB/s)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["intra_node_bw"] > 0 and data["collective_latency_s"] > 0
    assert 0 < data["efficiency"]["comm"] <= 1
    coll = data["measurements"]["collectives"]
    assert coll["ranks"] == 2 and coll["backend"] == "gloo" and coll["nbytes"] == quick_settings().comm_bytes
    assert coll["allreduce_s"] > 0 and coll["broadcast_s"] > 0 and coll["small_allreduce_s"] > 0
    assert coll["tp_fwd_bwd_s"] > 0  # tp_comm is fitted on the engine's tp=2 step
    check = data["measurements"]["validation"]["tp2_fwd_bwd_s"]
    assert check["measured_s"] == coll["tp_fwd_bwd_s"]
    if 0.0011 < data["efficiency"]["tp_comm"] < 1.0:  # not clamped: the fit reproduces the measurement
        assert check["profile_s"] == pytest.approx(check["measured_s"], rel=1e-3)
    hw = HardwareSpec.with_profile(hardware_preset("cpu"), out)
    assert (hw.intra_node_bw, hw.collective_latency_s) == (data["intra_node_bw"], data["collective_latency_s"])
    with pytest.raises(ValueError, match="ranks=1"):
        measure_collectives(quick_settings(), 1)
    # A rank count that cannot split the model's heads: no tp step (and no tp_comm), no error.
    assert quick_settings().model.n_heads % 3
    assert math.isnan(tp_fwd_bwd_seconds(quick_settings(), torch.device("cpu"), 3))


@pytest.mark.gpu
def test_quick_gpu_profile(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--quick", "--device", "cuda", "--ranks", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["peak_flops"] > 1e12 and data["hbm_bw"] > 1e11 and data["mem_bytes"] > 2**30
    assert data["measurements"]["machine"]["dtype"] == "bfloat16"
