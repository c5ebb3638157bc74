"""scripts/seed_sweep.py: its seed ranges and end means, and one short sweep in its own process
(its own local Ray instance, as a user runs it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "seed_sweep.py"


def sweep_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seed_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_seed_ranges_and_end_means() -> None:
    sweep = sweep_module()
    assert sweep.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert sweep.parse_seeds("5") == [5]
    for bad in ("a", "3-1", "1-x"):
        with pytest.raises(ValueError, match="--seeds"):
            sweep.parse_seeds(bad)
    first, last = sweep.rise([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0])
    assert first == pytest.approx(0.2) and last == pytest.approx(0.48)
    with pytest.raises(ValueError, match="4 iterations"):
        sweep.rise([0.1] * 4)


@pytest.mark.ray
def test_sweep_runs_each_seed_and_names_the_worst(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(ROOT / "examples" / "grpo-tiny.yaml"), "--seeds", "0,1", "run.iterations=5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("seed ", "grpo-tiny.yaml"))]
    assert [line.split(":")[0] for line in lines] == ["seed 0", "seed 1", "grpo-tiny.yaml"]
    assert "worst rise" in lines[-1] and "over 2 seeds" in lines[-1]


@pytest.mark.unit
def test_bad_arguments_exit_2_naming_them(tmp_path: Path) -> None:
    for args, expected in (([str(tmp_path / "none.yaml")], "no such file"),
                           ([str(ROOT / "examples" / "grpo-tiny.yaml"), "--seeds", "2-1"], "runs backwards"),
                           ([str(ROOT / "examples" / "grpo-tiny.yaml"), "run.iterationz=3"], "iterationz")):
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 2 and expected in done.stderr
