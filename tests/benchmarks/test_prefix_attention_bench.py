"""benchmarks/prefix_attention_bench.py --cpu --tiny (tests/benchmarks/kernel_bench_run.py): each
way of reading the shared prompt (own copy, shared row, cascade) runs (on CUDA tuned at the first
length and at every length), matches the reference, and the table and the best line come last."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.benchmarks.kernel_bench_run import run_tiny  # noqa: E402

pytestmark = pytest.mark.unit


def test_cpu_tiny_mode_prints_the_table() -> None:
    cuda = torch.cuda.is_available()
    lines = run_tiny("prefix_attention_bench.py")
    header = next(i for i, line in enumerate(lines) if line.startswith("way"))
    rows = [line.split() for line in lines[header + 1:-1]]
    configs = ("tuned@first", "tuned@L") if cuda else ("tuned@first",)  # nothing to tune on CPU
    assert [(r[0], r[1]) for r in rows] == [(way, config) for way in ("own", "shared", "cascade") for config in configs]
    for row in rows:
        assert float(row[2]) > 0 and float(row[-1]) < (3e-2 if cuda else 1e-5)  # against the torch reference
    assert lines[-1].startswith("best: own ") and "cascade" in lines[-1]
