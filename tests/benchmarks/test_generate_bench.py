"""benchmarks/generate_bench.py: the decode roofline at the model's dtype (the issue's) and at the
bytes an FP8 mode reads, and the CPU run printing both ratios."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.generate_bench import build_random_model, mode_config, roofline_tokens_per_s
from planning.layout import Layout
from planning.models import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
# Every dim a multiple of 16, so the FP8 copies cover every MLP and the head.
SPEC = ModelSpec(name="bench-tiny", family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=16)


@pytest.mark.unit
def test_fp8_modes_have_a_roofline_at_their_own_bytes() -> None:
    model = build_random_model(SPEC, Layout(), None, torch.device("cpu"), torch.bfloat16)
    args = argparse.Namespace(prompts=8, prompt_len=16, new_tokens=16, bandwidth=1e12)
    h, f, v, layers = SPEC.hidden_size, SPEC.intermediate_size, SPEC.vocab_size, SPEC.n_layers
    weights = sum(p.numel() for p in model.parameters()) * 2
    kv = 8 * (16 + 8) * layers * 2 * SPEC.n_kv_heads * SPEC.head_dim  # values read per step
    bf16 = roofline_tokens_per_s(model, SPEC, args)
    assert bf16 == pytest.approx(8 / ((weights + 2 * kv) / 1e12))
    assert roofline_tokens_per_s(model, SPEC, args, mode_config("graph", 16)) == pytest.approx(bf16)
    # FP8 copies of the MLPs and the (untied) head: one byte a weight plus a float32 scale a row.
    copied = layers * 3 * h * f + v * h
    scales = 4 * (layers * (2 * f + h) + v)
    fp8 = roofline_tokens_per_s(model, SPEC, args, mode_config("graph+fp8", 16))
    assert fp8 == pytest.approx(8 / ((weights - copied + scales + 2 * kv) / 1e12))
    both = roofline_tokens_per_s(model, SPEC, args, mode_config("graph+fp8+fp8kv", 16))
    assert both == pytest.approx(8 / ((weights - copied + scales + kv) / 1e12))
    assert bf16 < fp8 < both


@pytest.mark.unit
def test_cpu_tiny_run_prints_both_ratios() -> None:
    out = subprocess.run([sys.executable, "benchmarks/generate_bench.py", "--cpu", "--tiny"], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("mode"))
    assert header.split()[-2:] == ["ratio", "own"]
    rows = [line.split() for line in lines if line.startswith(("eager+sdpa", "eager+matmul"))]
    assert len(rows) == 2 and all(row[-1] == row[-2] for row in rows)  # bf16 modes: the same roofline
