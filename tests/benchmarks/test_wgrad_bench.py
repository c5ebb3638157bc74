"""benchmarks/wgrad_bench.py --tiny (tests/benchmarks/kernel_bench_run.py; --cpu without CUDA):
every weight of a block and the head is timed both ways, and the two fp32 sums agree."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.kernel_bench_run import run_tiny

pytestmark = pytest.mark.unit


def test_tiny_mode_times_every_weight_both_ways_and_the_sums_agree() -> None:
    lines = run_tiny("wgrad_bench.py")
    header = next(i for i, line in enumerate(lines) if "out x in" in line)
    rows = [line.split() for line in lines[header + 1:-1]]
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    assert [r[0] for r in rows] == names
    tolerance = 1e-2 if torch.cuda.is_available() else 1e-6  # bf16 products on CUDA; float32 on CPU
    for row in rows:
        hook_us, gemm_us, diff = float(row[4]), float(row[6]), float(row[8])
        assert hook_us > 0 and gemm_us > 0 and diff < tolerance
    assert lines[-1].startswith("4 blocks per micro-batch: hook ")
