"""benchmarks/elementwise_bench.py --tiny (tests/benchmarks/kernel_bench_run.py; --cpu without
CUDA): a fused elementwise function with a backward (swiglu) and the forward-only merge run eager
and compiled both ways (every dimension dynamic; only the token dimension, as the engine
compiles), the compiled outputs match eager's, and a third token count runs without
recompiling. Two cases, not all six: each compiles on CPU in ~6 s, and the engine's compiled
functions are checked against eager in tests/actors/engine/test_fusion.py."""

from __future__ import annotations

import math

import subprocess
import sys

import pytest
import torch

from tests.benchmarks.kernel_bench_run import ROOT, run_tiny

pytestmark = pytest.mark.unit


def test_tiny_mode_prints_every_chosen_case_and_variant() -> None:
    lines = run_tiny("elementwise_bench.py", "--cases", "swiglu,merge")
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    rows = [line.rsplit(maxsplit=6) for line in lines[header + 1:]]
    cases = ("swiglu", "merge")
    variants = ("eager", "all-dynamic", "token-dynamic")
    assert [tuple(r[0].split()[:-1]) for r in rows] == [tuple(c.split()) for c in cases for _ in variants]
    assert [r[0].split()[-1] for r in rows] == list(variants) * len(cases)
    tolerance = 5e-2 if torch.cuda.is_available() else 1e-5  # bf16 on CUDA; float32 on CPU
    for row in rows:
        fwd_us, both_us, diff = float(row[1]), float(row[3]), float(row[6])
        forward_only = row[0].startswith("merge")  # the merge is not differentiated
        assert fwd_us > 0 and (math.isnan(both_us) if forward_only else both_us > 0)
        assert diff < tolerance  # compiled equals eager to rounding


def test_an_unknown_case_exits_2_naming_it_and_the_known_ones() -> None:
    done = subprocess.run([sys.executable, "benchmarks/elementwise_bench.py", "--cpu", "--tiny", "--cases",
                           "swiglu,gelu"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "--cases: gelu unknown" in done.stderr and "rotary_q" in done.stderr
