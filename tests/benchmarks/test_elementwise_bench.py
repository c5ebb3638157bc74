"""benchmarks/elementwise_bench.py --tiny (tests/benchmarks/kernel_bench_run.py; --cpu without
CUDA): every fused elementwise function runs eager and compiled both ways (every dimension
dynamic, as the engine compiles; only the token dimension), forward and backward, and the
compiled outputs match eager's."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.kernel_bench_run import run_tiny

pytestmark = pytest.mark.unit


def test_tiny_mode_prints_every_case_and_variant() -> None:
    lines = run_tiny("elementwise_bench.py")
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    rows = [line.rsplit(maxsplit=5) for line in lines[header + 1:]]
    cases = ("rms_norm", "add_rms_norm", "swiglu", "rotary q", "rotary k")
    variants = ("eager", "all-dynamic", "token-dynamic")
    assert [tuple(r[0].split()[:-1]) for r in rows] == [tuple(c.split()) for c in cases for _ in variants]
    assert [r[0].split()[-1] for r in rows] == list(variants) * len(cases)
    tolerance = 5e-2 if torch.cuda.is_available() else 1e-5  # bf16 on CUDA; float32 on CPU
    for row in rows:
        fwd_us, both_us, diff = float(row[1]), float(row[3]), float(row[5])
        assert fwd_us > 0 and both_us > 0 and diff < tolerance  # compiled equals eager to rounding
