"""The dependency rule of DESIGN.md: `planning` never imports torch, ray or our other packages."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_planning_imports_no_torch_or_ray() -> None:
    modules = sorted(f"planning.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "planning")]))
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'ray', 'actors', 'cluster', 'app'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert len(modules) >= 5
    assert out.stdout.strip() == "", f"planning pulled in: {out.stdout.strip()}"
