"""The CI helpers (.ci/): the README's commands as CI reads them, and the main job's check."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def ci_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ci_{name}", ROOT / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_holds_the_two_commands_ci_runs() -> None:
    commands = ci_module("readme_commands").readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert commands == ["bash scripts/install.sh && python3 -m app train", "bash scripts/test.sh"]


def test_main_job_check() -> None:
    check = ci_module("check_main_job").check
    good = "iter 40/40 ...\n40 iterations; reward mean: first 5 0.007, last 5 0.450\noutputs: runs/x\n"
    assert check(good) is None
    assert "no closing line" in check("Traceback (most recent call last):\nModuleNotFoundError: triton\n")
    assert "ran 12 iterations" in check("12 iterations; reward mean: first 5 0.007, last 5 0.450\n")
    assert "expected a rise" in check("40 iterations; reward mean: first 5 0.007, last 5 0.010\n")
