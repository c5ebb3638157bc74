"""Runs a kernel benchmark script in its tiny mode for the tests beside it: in a subprocess, so
that Triton's interpreter (--cpu) is switched on before triton is imported; on CUDA the same
tiny shapes run on the GPU (bf16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_tiny(script: str, *extra: str) -> list[str]:
    """stdout lines of `python benchmarks/<script> --tiny [extra...]` (plus --cpu without CUDA);
    fails the test with the end of stderr when the script fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    mode = ["--tiny"] if torch.cuda.is_available() else ["--cpu", "--tiny"]
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *mode, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()
