"""The argument parser and entry point of `python -m app <command> ...`.

Each command lives in its own module exposing `add_parser(subparsers)`, which registers its
arguments and sets `run=<function(args) -> exit status>`. Commands are listed explicitly in
`COMMAND_MODULES` (add `train`, `generate`, `score`, `profile`, `report`, `export` there); command modules
keep heavy imports (torch, ray) inside their run functions so `plan` starts fast.

Bad input (ConfigError, ValueError, a missing file) exits with status 2 and one line on stderr,
`error: <message>`, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import NoReturn

from app.cli import generate, plan, profile, report, score, train
from app.config import ConfigError

# Modules defining one command each (`add_parser`). Explicit, so the CLI is readable in one place.
COMMAND_MODULES: tuple[ModuleType, ...] = (plan, generate, train, score, profile, report)

USAGE_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one `error: ...` line on stderr, status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"error: {self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m app", description="RLHF with per-call parameter reallocation on Ray.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run the command, map bad input to exit status 2 with a one-line message."""
    parser = build_parser()
    # parse_known_args + re-attaching lets overrides follow flags: `plan c.yaml --json a.b=1`.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args.run(args))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the exception text holds
        print(f"error: {message}", file=sys.stderr)
        return USAGE_ERROR


__all__ = ["COMMAND_MODULES", "USAGE_ERROR", "OneLineErrorParser", "build_parser", "main"]
