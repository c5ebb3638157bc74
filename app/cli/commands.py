"""The argument parser and entry point of `python -m app <command> ...`.

Each command lives in its own module exposing `add_parser(subparsers)`, which registers its
arguments and sets `run=<function(args) -> exit status>`. Commands are listed explicitly in
`COMMAND_MODULES` (add `train`, `generate`, `score`, `profile`, `report`, `export` there); command modules
keep heavy imports (torch, ray) inside their run functions so `plan` starts fast.

Bad input (ConfigError, ValueError, a missing file) exits with status 2 and one line on stderr,
`error: <message>`, never a traceback; a run that fails on its workers (a DriverError, a Ray
error) exits with status 1 and one such line naming the worker's original exception.
"""

from __future__ import annotations

import argparse
import re
import sys
from types import ModuleType
from typing import NoReturn

# The command modules by their own names, not through the package: app/cli/__init__.py imports
# this module, so `from app.cli import ...` here would read a package still being initialised.
import app.cli.generate as generate
import app.cli.plan as plan
import app.cli.profile as profile
import app.cli.report as report
import app.cli.score as score
import app.cli.train as train
from app.config import ConfigError

# Modules defining one command each (`add_parser`). Explicit, so the CLI is readable in one place.
COMMAND_MODULES: tuple[ModuleType, ...] = (plan, generate, train, score, profile, report)

USAGE_ERROR = 2
RUN_FAILED = 1
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_MESSAGE = 2000


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
    try:  # a usage error prints its one line and exits 2 (SystemExit): returned, for in-process callers
        # parse_known_args + re-attaching lets overrides follow flags: `plan c.yaml --json a.b=1`.
        args, extra = parser.parse_known_args(argv)
        if extra:
            if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    try:
        return int(args.run(args))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as exc:
        if not is_run_failure(exc):
            raise
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return RUN_FAILED


def error_line(exc: BaseException) -> str:
    """One line for the user: a worker's original exception rather than Ray's wrapper (whose
    text is a traceback with colour codes), whitespace collapsed, ANSI codes removed."""
    cause = getattr(exc, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(exc)
    return " ".join(ANSI.sub("", text).split())[:MAX_MESSAGE]


def is_run_failure(exc: BaseException) -> bool:
    """A run that failed on its workers (app.run.recovery.DriverError) or a Ray error; looked up
    lazily: `plan` never imports ray or the run package."""
    recovery = sys.modules.get("app.run.recovery")
    if recovery is not None and isinstance(exc, recovery.DriverError):
        return True
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(exc, exceptions.RayError)


__all__ = ["COMMAND_MODULES", "RUN_FAILED", "USAGE_ERROR", "OneLineErrorParser", "build_parser", "error_line",
           "is_run_failure", "main"]
