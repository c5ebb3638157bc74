"""Where a benchmark run writes: a fresh numbered directory per run under the script's --out.

The one rule of the scripts in benchmarks/ that write files (peer_bench, fidelity_bench,
plan_vs_symmetric): each run writes only inside `<out>/run-NNN/`, NNN one more than the highest
run number already under <out> (run-001 first), a directory the run creates itself. So a second
run with the same arguments never meets the first one's training directory (`run.dir ...
already holds a run`) nor mixes its results into the first one's files, and every earlier run
stays as it was. `<out>/latest` is a symbolic link to the newest run (where the file system can
make one), so the results a user reads are always at `<out>/latest/<file>` as well as at the
run-NNN path the script prints first and last. Inputs that are the same for every run and
costly to build (peer_bench's model) may sit beside the runs in <out>, outside any run-NNN.

    python3 benchmarks/peer_bench.py --tiny --out /tmp/peer     # /tmp/peer/run-001/peer_bench.txt
    python3 benchmarks/peer_bench.py --tiny --out /tmp/peer     # /tmp/peer/run-002/peer_bench.txt
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RUN_NAME = re.compile(r"run-(\d+)")
LATEST = "latest"


def run_number(path: Path) -> int | None:
    """N of a directory named run-N (any number of digits), else None."""
    match = RUN_NAME.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() and not path.is_symlink() else None


def run_dirs(out: Path) -> list[Path]:
    """The run directories under `out`, oldest (lowest number) first."""
    if not out.is_dir():
        return []
    numbered = [(n, p) for p in out.iterdir() if (n := run_number(p)) is not None]
    return [p for _, p in sorted(numbered)]


def latest_run_dir(out: Path) -> Path | None:
    """The newest run directory under `out` (the highest number), or None when there is none."""
    runs = run_dirs(out)
    return runs[-1] if runs else None


def fresh_run_dir(out: Path) -> Path:
    """Create and return `out`/run-NNN for a new run (NNN: one more than the highest there, so a
    run that happens at the same time takes the next number), and point `out`/latest at it."""
    out.mkdir(parents=True, exist_ok=True)
    number = max((run_number(p) or 0 for p in run_dirs(out)), default=0) + 1
    while True:
        path = out / f"run-{number:03d}"
        try:
            path.mkdir()
            break
        except FileExistsError:
            number += 1
    _point_latest(out, path)
    return path


def _point_latest(out: Path, path: Path) -> None:
    """Replace the link `out`/latest by one to `path` (relative, so the folder can move). Left as
    it is where links cannot be made, or where `latest` is something else than a link."""
    link = out / LATEST
    if link.exists() and not link.is_symlink():
        return
    staging = out / f".{LATEST}-{os.getpid()}"
    try:
        staging.unlink(missing_ok=True)
        staging.symlink_to(path.name, target_is_directory=True)
        os.replace(staging, link)
    except OSError:
        staging.unlink(missing_ok=True)


__all__ = ["LATEST", "fresh_run_dir", "latest_run_dir", "run_dirs", "run_number"]
