"""`ConfigError`: a config value that is not allowed, naming the dotted field, the value and what is
allowed. The bottom of app.config: every other module of it raises this, none is imported here.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value that is not allowed. `field` is the dotted path, e.g. `batch.gen_len`."""

    def __init__(self, field: str, value: Any, allowed: str, problem: str = "not allowed") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={_show(value)}: {problem}; allowed: {allowed}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["ConfigError"]
