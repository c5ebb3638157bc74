"""The dependency rules of DESIGN.md and docs/architecture.md, checked on the source.

- `planning` never imports torch, ray or our other packages (checked by importing it);
- `python -m app plan` starts without torch or ray;
- inside `actors/` the layers hold: kernels <- engine <- generation / realloc <- worker, and `rl`
  imports only torch (not torch.distributed); `actors` never imports ray, cluster or app;
- code outside a subpackage imports only the subpackage (`from actors.realloc import ...`), never
  one of its modules;
- no import cycle between modules (imports at module level; imports inside functions are lazy);
- every test folder mirrors a real package.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "app", "cluster", "planning")
OURS = PACKAGES

# actors subpackage -> the actors subpackages it may import (besides itself).
ACTORS_LAYERS: dict[str, set[str]] = {
    "actors.kernels": set(),
    "actors.rl": set(),
    "actors.engine": {"actors.kernels", "actors.rl"},
    "actors.generation": {"actors.kernels", "actors.engine"},
    "actors.realloc": {"actors.kernels", "actors.engine"},
    "actors.worker": {"actors.kernels", "actors.rl", "actors.engine", "actors.generation", "actors.realloc"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def imports_of(path: Path, top_level_only: bool = False) -> list[str]:
    """Dotted modules `path` imports (`from a.b import c` gives a.b and, if it is a module, a.b.c)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks are not imports at run time
        nodes = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import module` imports the module; `from pkg import name` the package.
            base = ROOT / node.module.replace(".", "/")
            submodules = [f"{node.module}.{a.name}" for a in node.names if (base / f"{a.name}.py").exists()]
            found += submodules if len(submodules) == len(node.names) else [node.module, *submodules]
    return found


def subpackage(module: str) -> str:
    """actors.engine.model -> actors.engine; app.cli.plan -> app.cli; planning.cost -> planning."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[0] / parts[1] / "__init__.py").exists():
        return ".".join(parts[:2])
    return parts[0]


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


@pytest.mark.unit
def test_plan_command_starts_without_torch_or_ray() -> None:
    code = ("import sys, app.cli, app.config, app.reporting, app.data\n"
            "print(','.join(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'ray'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"`python -m app plan` pulled in: {out.stdout.strip()[:200]}"


@pytest.mark.unit
def test_actors_layers() -> None:
    bad: list[str] = []
    for path in source_files():
        mod = module_name(path)
        if not mod.startswith("actors."):
            continue
        own = subpackage(mod)
        allowed = ACTORS_LAYERS[own] | {own}
        for imp in imports_of(path):
            root = imp.split(".")[0]
            if root in ("ray", "cluster", "app"):
                bad.append(f"{mod} imports {imp} (actors never imports ray, cluster or app)")
            elif root == "actors" and imp != "actors" and subpackage(imp) not in allowed:
                bad.append(f"{mod} imports {imp} (layer {own} may import {sorted(ACTORS_LAYERS[own])})")
            elif own == "actors.rl" and (root not in ("torch", "actors", "__future__") and root not in
                                         sys.stdlib_module_names or imp.startswith("torch.distributed")):
                bad.append(f"{mod} imports {imp} (actors.rl imports only torch)")
    assert not bad, "\n".join(bad)


@pytest.mark.unit
def test_other_packages_import_only_the_subpackage() -> None:
    bad: list[str] = []
    for path in source_files():
        mod = module_name(path)
        own = subpackage(mod)
        for imp in imports_of(path):
            target = subpackage(imp)
            if imp.split(".")[0] in OURS and target != own and target.count(".") == 1 and imp != target:
                bad.append(f"{mod} imports {imp}: import from the package {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.unit
def test_no_import_cycles() -> None:
    modules = {module_name(p): p for p in source_files()}
    edges = {m: {i for i in imports_of(p, top_level_only=True) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(modules):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


@pytest.mark.unit
def test_test_folders_mirror_packages() -> None:
    folders = [d for d in (ROOT / "tests").rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert folders, "tests/ has no package folders"
    for folder in folders:
        rel = folder.relative_to(ROOT / "tests")
        assert (ROOT / rel / "__init__.py").exists(), f"tests/{rel} names no package {'.'.join(rel.parts)}"
        assert (folder / "__init__.py").exists(), f"tests/{rel} needs an __init__.py"
