"""Command-line entry: `python -m app <command> ...` (the commands: app.cli)."""

from __future__ import annotations

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
