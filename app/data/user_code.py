"""Importing the code a config names: 'module:attr' or 'path/to/file.py:attr' (reward functions,
environments).

A module is imported by name; a .py file is loaded under a name derived from its absolute path
(and registered in sys.modules, so dataclasses and pickling can find it, and a second load in the
same process reuses it). Every failure is the caller's error type with a message that starts with
`what` (e.g. "reward 'x.py:f'" or "rollout.env='x.py:Env'") and says what went wrong.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def looks_like_file(target: str) -> bool:
    """Whether the part before ':' names a file rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def import_user_module(target: str, what: str, error: type[ValueError], namespace: str) -> ModuleType:
    """The module `target` (a module name or a .py path) imported; `namespace` prefixes the module
    name a file is loaded under (e.g. "reward", "env"). Raises `error` naming `what`."""
    if not looks_like_file(target):
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise error(f"{what}: module {target!r} cannot be imported ({exc}); use an importable module or a "
                        "path to a .py file") from None
        except Exception as exc:
            raise error(f"{what}: importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise error(f"{what}: file {str(path)!r} does not exist")
    module_name = f"_realray_{namespace}_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:  # loaded before in this process (e.g. unpickled again)
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise error(f"{what}: {str(path)!r} is not a loadable Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise error(f"{what}: executing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


__all__ = ["import_user_module", "looks_like_file"]
