"""benchmarks/train_attention_bench.py --tiny (--cpu without CUDA): the cascade over the compact
stream (every prompt once) gives each row's attention as the rows alone would, and the table
comes last with a row per way that ran (on CUDA also FlashAttention and cuDNN on the whole rows)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.kernel_bench_run import run_tiny

pytestmark = pytest.mark.unit


def test_tiny_mode_matches_the_rows_alone_and_prints_the_table() -> None:
    lines = run_tiny("train_attention_bench.py")
    header = next(i for i, line in enumerate(lines) if line.startswith("| way"))
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2:]]
    assert rows[0][0] == "cascade"
    tolerance = 3e-2 if torch.cuda.is_available() else 1e-5  # bf16 on CUDA, float32 on CPU
    for row in rows:
        assert float(row[1]) < tolerance, row
