"""benchmarks/decode_attention_bench.py --cpu --tiny: the kernel benchmark's script on CPU (Triton's
interpreter), in a subprocess so the interpreter is switched on before triton is imported: every
tiny case runs every split count and auto, matches the reference, and the table comes last. With
CUDA it runs the same tiny cases on the GPU (--tiny; bf16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_tiny_mode_prints_the_table() -> None:
    from benchmarks.decode_attention_bench import SPLITS, TINY_CASES

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cuda = torch.cuda.is_available()
    mode = ["--tiny"] if cuda else ["--cpu", "--tiny"]
    done = subprocess.run([sys.executable, "benchmarks/decode_attention_bench.py", *mode], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    assert lines[header].split()[-8:] == ["splits", "us/call", "GB/s", "of", "peak", "auto", "max", "err"]
    rows = [line.rsplit(maxsplit=6) for line in lines[header + 1:]]
    assert len(rows) == len(TINY_CASES) * len(SPLITS) and lines[-1] == lines[header + len(rows)]
    assert [r[1] for r in rows] == [("auto" if s is None else str(s)) for s in SPLITS] * len(TINY_CASES)
    for case_text, _, us, _, _, auto, err in rows:
        assert case_text.startswith("(") and float(us) > 0 and auto == "1"  # tiny caches: never split
        assert float(err) < (3e-2 if cuda else 1e-5)  # bf16 / float32 against the torch reference
