"""Checkpoints of a run: HF exports of the trained models under `<run_dir>/checkpoints/iter_N/`.

`iter_N` holds one HF directory per trained role (`actor/`, `critic/`) written by the workers of
that role's train placement (`ModelWorker.export`), after N finished iterations. The driver
writes `checkpoint.json` into `iter_N` only once every export has finished, so a directory with
that file is complete; a run that dies mid-export leaves an `iter_N` without it, which
`latest_checkpoint` skips.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER = "checkpoint.json"


def checkpoint_dir(run_dir: str | Path, iterations_done: int) -> Path:
    """`<run_dir>/checkpoints/iter_<N>` for a checkpoint after N finished iterations."""
    if iterations_done < 1:
        raise ValueError(f"iterations_done={iterations_done}: a checkpoint follows at least one iteration")
    return Path(run_dir) / "checkpoints" / f"iter_{iterations_done}"


def is_due(iterations_done: int, every: int, total: int | None, at_end: bool) -> bool:
    """Whether to checkpoint after `iterations_done` iterations (every N, and at the end)."""
    periodic = every > 0 and iterations_done % every == 0
    final = at_end and total is not None and iterations_done == total
    return periodic or final


def mark_complete(directory: Path, iterations_done: int, roles: Sequence[str], export_metas: dict[str, Any]) -> None:
    """Write the marker that makes `directory` a complete checkpoint (after every export returned)."""
    missing = [role for role in roles if not (directory / role / "config.json").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {directory}: exports of {missing} returned but wrote no config.json "
                           "(is the run directory on a file system every worker shares?)")
    record = {"iterations": iterations_done, "roles": list(roles), "time": time.time(), "exports": export_metas}
    (directory / MARKER).write_text(json.dumps(record, default=str, indent=1))


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most iterations, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = [d for d in root.glob("iter_*") if d.name.removeprefix("iter_").isdigit() and is_complete(d)]
    return max(complete, key=lambda d: int(d.name.removeprefix("iter_")), default=None)


__all__ = ["MARKER", "checkpoint_dir", "is_complete", "is_due", "latest_checkpoint", "mark_complete"]
