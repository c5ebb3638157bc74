"""benchmarks/elementwise_bench.py --cpu --tiny: every fused elementwise function runs eager and
compiled both ways (every dimension dynamic; only the token dimension), forward and backward,
and the compiled outputs match eager's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_cpu_tiny_mode_prints_every_case_and_variant() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/elementwise_bench.py", "--cpu", "--tiny"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    rows = [line.rsplit(maxsplit=5) for line in lines[header + 1:]]
    cases = ("rms_norm", "add_rms_norm", "swiglu", "rotary q", "rotary k")
    variants = ("eager", "all-dynamic", "token-dynamic")
    assert [tuple(r[0].split()[:-1]) for r in rows] == [tuple(c.split()) for c in cases for _ in variants]
    assert [r[0].split()[-1] for r in rows] == list(variants) * len(cases)
    for row in rows:
        fwd_us, both_us, diff = float(row[1]), float(row[3]), float(row[5])
        assert fwd_us > 0 and both_us > 0 and diff < 1e-5  # float32: compiled equals eager to rounding
