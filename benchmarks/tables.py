"""Markdown tables for the benchmarks' printed results (pasted into docs/benchmarks.md as they are)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A header line, its separator and one line per row of already formatted cells; a row of
    another width than the headers raises (a misaligned table would read as wrong numbers)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: a row of {len(row)} cells under {len(headers)} headers: {list(row)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


__all__ = ["markdown_table"]
