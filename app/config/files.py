"""Reading the files a user hands us: UTF-8 text that names the line of a bad byte, strict YAML.

`read_utf8(path)` decodes a file as UTF-8; a byte that is not UTF-8 raises ValueError naming
the file, the line, the column and the byte (Python's own message names neither file nor line).
`load_yaml(text)` is `yaml.safe_load` that refuses a key given twice in one mapping (plain YAML
keeps the last one silently), naming both lines. No torch, no ray: `python -m app plan` uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_utf8(path: str | Path) -> str:
    """The file's text; ValueError `<path> line L: not UTF-8 text (byte 0x.. at column C)`."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}); "
                         "save the file as UTF-8") from None


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader whose mappings refuse duplicate keys."""


def _mapping_without_duplicates(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges, it is not a key
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(text: str) -> Any:
    """Parse YAML like yaml.safe_load, refusing duplicate keys (yaml.YAMLError with a mark)."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no arbitrary objects


__all__ = ["StrictLoader", "load_yaml", "read_utf8"]
