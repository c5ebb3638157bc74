"""`python -m app report RUN_DIR [--out FILE.png]`: a run's curves in one PNG, and a summary.

Reads `RUN_DIR/metrics.jsonl` (what `python -m app train` writes, also while it runs) and draws
reward, response length, KL, losses, per-call times and throughput over iterations
(`app.reporting.curves`) into `--out` (default `RUN_DIR/curves.png`), then prints the summary
lines: the reward and KL of the first and last iterations, mean seconds per call, throughput.
A RUN_DIR that is not a run directory exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.reporting import draw_curves, run_summary

DEFAULT_OUT = "curves.png"


def add_parser(subparsers: Any) -> None:
    """Register the `report` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "report", help="draw a run's curves (reward, length, KL, losses, call times) into a PNG",
        description="Draw RUN_DIR/metrics.jsonl over iterations into one PNG and print a summary.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `python -m app train`")
    parser.add_argument("--out", metavar="FILE.png", help=f"where to write the PNG (default: RUN_DIR/{DEFAULT_OUT})")
    parser.set_defaults(run=run)


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl; FileNotFoundError / ValueError naming what is wrong."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run_dir}: no such directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"RUN_DIR {run_dir}: has no metrics.jsonl; allowed: a run directory of "
                                "`python -m app train` (it writes metrics.jsonl after the first iteration)")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {line_no}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {line_no}: expected a JSON object of metrics, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no iteration recorded yet")
    return rows


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    rows = load_rows(run_dir)
    out = Path(args.out) if args.out else run_dir / DEFAULT_OUT
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: directory {out.parent} does not exist")
    panels = draw_curves(rows, out, title=run_dir.resolve().name)
    for line in run_summary(rows):
        print(line)
    print(f"curves: {out} ({', '.join(p.title for p in panels)})")
    return 0


__all__ = ["DEFAULT_OUT", "add_parser", "load_rows", "run"]
