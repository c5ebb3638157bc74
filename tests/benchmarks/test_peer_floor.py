"""benchmarks/peer_floor.py: the peer bench's step floor at the measured ceilings, against the
figures worked out by hand in docs/benchmarks.md (issue 27, second and seventh steps), and the
peer bench's table printing it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.peer_bench import GPU_WORK, local_gpu_preset, table
from benchmarks.peer_floor import HBM_BYTES_PER_S, PEAK_FLOPS, decode_hbm_roofline_s, matmul_params, step_floor
from benchmarks.peer_trl import SideResult
from planning.hardware import hardware_preset
from planning.models import model_preset

pytestmark = pytest.mark.unit

SPEC = model_preset("llama3.2-1b")


def test_llama_1b_floor_matches_the_hand_worked_figures() -> None:
    P = matmul_params(SPEC)
    assert P == pytest.approx(1.236e9, rel=1e-3)  # the tied head counts, the lookup does not
    whole = step_floor(SPEC, 64, 8, 128, 512, prompt_once=False)
    # 511 decode steps of 512 rows: projections compute-bound (2 x 512 x P at the peak, 1.61 ms)
    # plus 6.44 GB of K/V on average (1.50 ms): 1.59 s.
    per_step = 2 * 512 * P / PEAK_FLOPS + 512 * (128 + 256) * 32768 / HBM_BYTES_PER_S
    assert whole.decode_s == pytest.approx(511 * per_step, rel=1e-3)
    assert whole.decode_s == pytest.approx(1.59, abs=0.01)
    # Training: 6 P per token over 512 x 640 tokens is 3.09 s; causal attention adds ~2%.
    matmul_train = 6 * P * 512 * 640 / PEAK_FLOPS
    assert matmul_train == pytest.approx(3.09, abs=0.01)
    assert 1.0 < whole.training_s / matmul_train < 1.05
    once = step_floor(SPEC, 64, 8, 128, 512, prompt_once=True)
    assert 6 * P * 270_336 / PEAK_FLOPS < once.training_s < whole.training_s  # 64 x 128 + 512 x 512 tokens
    assert once.prefill_s == pytest.approx(whole.prefill_s / 8, rel=1e-6)  # one prompt copy of a group's 8
    assert once.decode_s < whole.decode_s and once.total_s < whole.total_s


def test_a_small_batch_decode_is_bound_by_streaming_the_weights() -> None:
    floor = step_floor(SPEC, 1, 1, 16, 3, prompt_once=False)
    weights_s = 2 * matmul_params(SPEC) / HBM_BYTES_PER_S
    kv_s = sum((16 + i) * 32768 for i in (1, 2)) / HBM_BYTES_PER_S
    assert floor.decode_s == pytest.approx(2 * weights_s + kv_s)


def test_the_table_prints_both_floors_and_our_step_against_them() -> None:
    ours = SideResult("realray GRPO", step_s=[6.5, 6.5], tokens=[262_000, 262_000])
    text = table([ours], GPU_WORK, "Llama-3.2-1B shape", SPEC)
    whole = step_floor(SPEC, 64, 8, 128, 512, prompt_once=False).total_s
    once = step_floor(SPEC, 64, 8, 128, 512, prompt_once=True).total_s
    assert f"every row whole {whole:.2f} s" in text and f"each prompt once {once:.2f} s" in text
    assert f"realray GRPO: step 6.50 s = {6.5 / whole:.2f}x / {6.5 / once:.2f}x the two floors" in text
    assert "floor at" not in table([ours], GPU_WORK, "tiny")  # no spec (CPU): no floor


def test_the_decode_roofline_is_the_issues_1_06_s_and_the_table_prints_both_targets() -> None:
    """Issue 27's decode target has been measured against 1.06 s since its second step: 511 steps
    each streaming 2.47 GB of weights and 6.44 GB of K/V on average at 4.3 TB/s."""
    P = matmul_params(SPEC)
    by_hand = 511 * (2 * P + 512 * (128 + 256) * 32768) / HBM_BYTES_PER_S
    assert decode_hbm_roofline_s(SPEC, 512, 128, 512) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand == pytest.approx(1.06, abs=0.005)
    ours = SideResult("realray GRPO", step_s=[6.5], tokens=[262_000], calls={"actor_gen": 2.3, "actor_train": 4.0},
                      phases={"gen/decode_s": 2.12})
    text = table([ours], GPU_WORK, "Llama-3.2-1B shape", SPEC)
    train_flops = step_floor(SPEC, 64, 8, 128, 512, prompt_once=True).training_s * PEAK_FLOPS
    mfu, share = 100 * train_flops / (4.0 * PEAK_FLOPS), 100 * by_hand / 2.12
    assert f"realray GRPO: training call {mfu:.1f}% MFU" in text and f"decode {share:.1f}% of the HBM roofline" in text
    assert 60 < mfu < 70 and 49 < share < 51
    # Without a decode phase (a failed or CPU run) there is nothing to set against it.
    assert "MFU" not in table([SideResult("realray GRPO", step_s=[6.5], tokens=[1])], GPU_WORK, "x", SPEC)


def test_the_floor_at_the_h100_presets_ceilings() -> None:
    """On an H100 the floor takes its measured ceilings: the K/V reads at 2.97 TB/s, the matmuls at 787 TFLOP/s."""
    h100 = hardware_preset("h100-80g")
    on_h100 = step_floor(SPEC, 64, 8, 128, 512, prompt_once=False, hardware=h100)
    per_step = 2 * 512 * matmul_params(SPEC) / h100.peak_flops + 512 * (128 + 256) * 32768 / h100.hbm_bw
    assert on_h100.decode_s == pytest.approx(511 * per_step, rel=1e-3)
    assert on_h100.decode_s > step_floor(SPEC, 64, 8, 128, 512, prompt_once=False).decode_s
    ours = SideResult("realray GRPO", step_s=[6.5, 6.5], tokens=[262_000, 262_000])
    text = table([ours], GPU_WORK, "Llama-3.2-1B shape", SPEC, h100)
    assert "floor at 787 TFLOP/s bf16 and 2.97 TB/s (h100-80g;" in text
    assert f"every row whole {on_h100.total_s:.2f} s" in text


def test_the_bench_takes_the_preset_of_the_gpu_nvidia_smi_names(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert local_gpu_preset() == "h100-80g"
    fake.write_text("#!/bin/sh\nexit 9\n")  # no GPU it can name: the H200's preset, as before
    assert local_gpu_preset() == "h200-141g"
