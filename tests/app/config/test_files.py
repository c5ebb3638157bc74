"""Unit tests of reading user files: a non-UTF-8 byte names the file, line and column; YAML
refuses a key given twice (anywhere, flow style too) but keeps merge keys working."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.config import load_yaml, read_utf8

pytestmark = pytest.mark.unit


def test_read_utf8_names_the_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes("ok\nalso ok é\n".encode() + b"ab\xffcd\n")
    with pytest.raises(ValueError, match=r"x.jsonl line 3: not UTF-8 text \(byte 0xff at column 3\)"):
        read_utf8(path)
    path.write_bytes("é\n".encode())
    assert read_utf8(path) == "é\n"


def test_load_yaml_refuses_duplicate_keys() -> None:
    assert load_yaml("base: &b {x: 1}\nrun:\n  <<: *b\n  y: 2\n") == {"base": {"x": 1}, "run": {"x": 1, "y": 2}}
    for text, line in (("a: 1\nb: 2\na: 3\n", 3), ("s: {k: 1, k: 2}\n", 1), ("s:\n  k: 1\n  k: 2\n", 3)):
        with pytest.raises(yaml.YAMLError) as caught:
            load_yaml(text)
        assert "duplicate key" in caught.value.problem and caught.value.problem_mark.line + 1 == line
