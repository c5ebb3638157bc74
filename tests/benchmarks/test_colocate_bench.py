"""benchmarks/colocate_bench.py --cpu --tiny: the GPU script's every phase on CPU (training and
generation alone, then both at once in two threads) in a subprocess, ending with the table and the
verdict; and the gate that keeps training from starting before generation's CUDA graph capture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.generation import loop
from actors.generation.decode_step import DecodeStep
from benchmarks.colocate_bench import CaptureGate, GatedDecodeStep, gated_decode_steps

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_tiny_cpu_mode_prints_the_table_and_the_verdict() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/colocate_bench.py", "--cpu", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("phase "))
    assert lines[header].split()[:4] == ["phase", "wall", "s", "train"]
    rows = {line.split("  ")[0].strip(): line.split() for line in lines[header + 1:header + 4]}
    assert set(rows) == {"train alone", "generate alone", "concurrent"}
    concurrent = rows["concurrent"][1:]
    # wall, train, generate, serial sum, speedup measured; no peak memory on CPU.
    assert all(float(value) > 0 for value in concurrent[:5]) and concurrent[5] == "-"
    assert "FAILED" not in done.stdout
    assert lines[-1].startswith("verdict: concurrent ")
    assert "wins by" in lines[-1] or "does not win" in lines[-1]


@pytest.mark.unit
def test_gate_opens_after_the_capture_and_refuses_one_once_training_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DecodeStep, "capture", lambda self: "graph")  # a capture needs CUDA
    step = object.__new__(GatedDecodeStep)
    gate = CaptureGate()
    monkeypatch.setattr(GatedDecodeStep, "gate", gate)
    assert not gate.captured.is_set()
    assert step.capture() == "graph" and gate.captured.is_set()
    gate.training = True
    with pytest.raises(RuntimeError, match="second CUDA graph"):
        step.capture()
    with gated_decode_steps():
        assert loop.DecodeStep is GatedDecodeStep
    assert loop.DecodeStep is DecodeStep
