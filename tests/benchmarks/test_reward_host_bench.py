"""benchmarks/reward_host_bench.py at a small shape: both reward calls and both ways of decoding
the responses run and the table comes last, with the cost model's estimate beside the rule
reward; bad arguments are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "benchmarks/reward_host_bench.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_small_shape_reports_both_calls() -> None:
    done = bench("--prompts", "2", "--group", "2", "--prompt-len", "8", "--gen-len", "16", "--vocab", "1024",
                 "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-5].split()[:2] == ["call", "median"]
    rule, retokenize, backend, table = (line.split() for line in lines[-4:])
    assert rule[0] == "rule_reward" and float(rule[1]) > 0 and float(rule[4]) > 0  # the plan's estimate
    assert retokenize[0] == "RewardText.rows" and float(retokenize[1]) > 0 and retokenize[4] == "-"
    assert backend[:2] == ["decode:", "backend"] and float(backend[2]) > 0
    assert table[:3] == ["decode:", "byte", "table"] and float(table[3]) > 0


def test_bad_arguments_are_refused() -> None:
    done = bench("--group", "0")
    assert done.returncode == 2 and "--group=0" in done.stderr
    done = bench("--vocab", "100")
    assert done.returncode == 2 and "--vocab=100" in done.stderr
