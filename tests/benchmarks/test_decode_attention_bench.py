"""benchmarks/decode_attention_bench.py --cpu --tiny: the kernel benchmark's script on CPU (Triton's
interpreter), in a subprocess so the interpreter is switched on before triton is imported: every
tiny case runs every split count and auto, matches the reference, and the table comes last; with
an e4m3 cache too; --sweep times each launch config and the tuned kernel. With CUDA it runs the
same tiny cases on the GPU (--tiny; bf16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.benchmarks.kernel_bench_run import run_tiny  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_cpu_tiny_mode_prints_the_table(cache: str) -> None:
    from benchmarks.decode_attention_bench import SPLITS, TINY_CASES

    cuda = torch.cuda.is_available()
    lines = run_tiny("decode_attention_bench.py", "--cache-dtype", cache)
    assert ("e4m3 cache" if cache == "fp8" else "bf16 cache" if cuda else "float32 cache") in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    assert lines[header].split()[-8:] == ["splits", "us/call", "GB/s", "of", "peak", "auto", "max", "err"]
    rows = [line.rsplit(maxsplit=6) for line in lines[header + 1:]]
    assert len(rows) == len(TINY_CASES) * len(SPLITS) and lines[-1] == lines[header + len(rows)]
    assert [r[1] for r in rows] == [("auto" if s is None else str(s)) for s in SPLITS] * len(TINY_CASES)
    for case_text, _, us, _, _, auto, err in rows:
        assert case_text.startswith("(") and float(us) > 0 and auto == "1"  # tiny caches: never split
        assert float(err) < (3e-2 if cuda else 1e-5)  # bf16 / float32 against the torch reference


def test_sweep_times_each_launch_config() -> None:
    from benchmarks.decode_attention_bench import TINY_CASES, TINY_SWEEP_CONFIGS

    lines = run_tiny("decode_attention_bench.py", "--sweep", "--cache-dtype", "fp8")
    header = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert "e4m3 cache" in lines[header - 1]
    body = lines[header + 1:-1]
    assert [line.split()[0] for line in body] == [f"{n}/{w}/{st}" for n, w, st in TINY_SWEEP_CONFIGS] + ["tuned"]
    for line in body:  # one "us (of peak)" cell per tiny case
        assert len(line.split()) == 1 + 2 * len(TINY_CASES) and float(line.split()[1]) > 0
    assert lines[-1].startswith("max err over all configs:") and float(lines[-1].split()[-1]) < 3e-2
