"""The dependency rules of DESIGN.md and docs/architecture.md, checked on the source.

- `planning` never imports torch, ray or our other packages (checked by importing it);
- `python -m app plan` starts without torch or ray;
- inside `actors/` the layers hold: kernels <- engine <- generation / realloc <- worker, and `rl`
  imports only torch (not torch.distributed); `actors` never imports ray, cluster or app;
- code outside a subpackage imports only the subpackage (`from actors.realloc import ...`), never
  one of its modules;
- no import cycle between modules: imports anywhere in a file count (inside functions and
  `if TYPE_CHECKING:` too), a package `__init__` importing its own submodules does not by itself;
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


def imports_of(path: Path) -> list[str]:
    """Dotted modules `path` imports (`from a.b import c` gives a.b and, if it is a module, a.b.c)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
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


def ancestors(module: str) -> list[str]:
    """actors.worker.train -> [actors, actors.worker]."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def import_edges(me: str, is_package: bool, source: str, modules: set[str]) -> dict[str, int]:
    """Which of `modules` the module `me` (source text `source`) imports, each with the line of
    its first import statement.

    Every `import` / `from ... import` anywhere in the file counts (function bodies and
    `if TYPE_CHECKING:` blocks too: a cycle behind a lazy import is still a cycle). Relative
    imports are resolved. `import a.b.c` and `from a.b.c import x` import a.b.c; `from a.b import c`
    imports a.b (its namespace is read) and a.b.c when c is a submodule. Importing a.b.c also runs
    the `__init__` of a and a.b: those count too, except the packages `me` itself sits in, which
    Python has always started importing before `me` runs. So a package `__init__` that re-exports
    its submodules makes no cycle, unless a submodule names its own package in an import.
    """
    package = me if is_package else me.rpartition(".")[0]
    mine = set(ancestors(me))
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        for name in [*ancestors(target), target]:
            if name in modules and name != me and (name == target or name not in mine):
                found.setdefault(name, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x`, `from ..a import b`
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            add(base, node.lineno)
            for alias in node.names:
                add(f"{base}.{alias.name}", node.lineno)  # counts only where it names a module
    return found


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `edges` (node -> successors), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def import_cycles() -> dict[tuple[str, ...], str]:
    """Every import cycle between our modules (a strongly connected component of more than one
    module) -> the imports inside it, each with its file and line."""
    paths = {module_name(p): p for p in source_files()}
    found = {m: import_edges(m, p.name == "__init__.py", p.read_text(), set(paths)) for m, p in paths.items()}
    cycles = {}
    for component in strongly_connected({m: set(targets) for m, targets in found.items()}):
        if len(component) > 1:
            cycles[tuple(component)] = "; ".join(
                f"{m} -> {t} ({paths[m].relative_to(ROOT)}:{found[m][t]})"
                for m in component for t in sorted(found[m]) if t in component)
    return cycles


@pytest.mark.unit
def test_import_edges_resolve_packages_submodules_and_relative_imports() -> None:
    modules = {"app", "app.cli", "app.cli.commands", "app.cli.plan", "app.config", "app.config.checks"}
    source = ("from app.cli import plan\n"
              "import app.cli.plan as plan2\n"
              "from . import plan as plan3\n"
              "def f():\n"
              "    from app.config.checks import x\n")
    # `from app.cli import plan` names app.cli, the package commands sits in (its __init__
    # imports commands: a cycle); app.config's __init__ runs for app.config.checks; `app` is an
    # ancestor of commands, imported before it.
    assert import_edges("app.cli.commands", False, source, modules) == {
        "app.cli": 1, "app.cli.plan": 1, "app.config": 5, "app.config.checks": 5}
    assert import_edges("app.cli.commands", False, "import app.cli.plan as plan\n", modules) == {"app.cli.plan": 1}
    # A package __init__ that imports its submodules; `from . import x` in an __init__ is its own package.
    assert import_edges("app.cli", True, "from . import commands\nfrom app.cli.plan import y\n", modules) == {
        "app.cli.commands": 1, "app.cli.plan": 2}
    assert import_edges("app.cli.plan", False, "from ..config import checks\n", modules) == {
        "app.config": 1, "app.config.checks": 1}
    assert strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["c"], ["a", "b"]]


@pytest.mark.unit
def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, "\n".join(f"import cycle between {', '.join(c)}: {imports}" for c, imports in cycles.items())


@pytest.mark.unit
def test_test_folders_mirror_packages() -> None:
    folders = [d for d in (ROOT / "tests").rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert folders, "tests/ has no package folders"
    for folder in folders:
        rel = folder.relative_to(ROOT / "tests")
        assert (ROOT / rel / "__init__.py").exists(), f"tests/{rel} names no package {'.'.join(rel.parts)}"
        assert (folder / "__init__.py").exists(), f"tests/{rel} needs an __init__.py"
