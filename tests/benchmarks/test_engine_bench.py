"""benchmarks/engine_bench.py: the GRPO batch of any shape, its argument, and a CPU run of another
preset's shape (a functional check of the script)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engine_bench import PEER_SHAPE, make_grpo_batch, parse_grpo_shape

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_grpo_batch_of_a_shape_shares_each_prompt_across_its_group() -> None:
    batch = make_grpo_batch(100, True, (3, 2, 5, 4))
    assert batch.lengths == (9,) * 6 and batch.prefix_lengths == (5,) * 6
    rows = batch.tokens.view(6, 9)
    assert bool((rows[0, :5] == rows[1, :5]).all()) and not bool((rows[1, :5] == rows[2, :5]).all())
    assert make_grpo_batch(100, False, (3, 2, 5, 4)).prefix_lengths is None
    assert len(make_grpo_batch(100, True).lengths) == PEER_SHAPE[0] * PEER_SHAPE[1]


@pytest.mark.parametrize("text", ["1,2,3", "1,2,3,0", "a,2,3,4", "1,2,3,4,5", ""])
def test_a_bad_shape_names_the_flag_and_the_form(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="PROMPTS,GROUP,PROMPT_LEN,GEN_LEN"):
        parse_grpo_shape(text)
    assert parse_grpo_shape("64,8,256,512") == (64, 8, 256, 512)


def test_cpu_run_of_a_grpo_shape_prints_the_table() -> None:
    run = subprocess.run([sys.executable, "benchmarks/engine_bench.py", "--cpu", "--tiny", "--tp", "1",
                          "--grpo-shape", "2,4,8,8", "--n-micro", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "engine benchmark (tiny, cpu fp32, elementwise eager, GRPO batch 2x4x8x8 in 2 micro-batches)" in run.stdout
    unknown = subprocess.run([sys.executable, "benchmarks/engine_bench.py", "--cpu", "--model", "nope"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert unknown.returncode == 2 and "--model='nope': preset 'nope': unknown" in unknown.stderr
