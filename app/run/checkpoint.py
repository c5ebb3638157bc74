"""Checkpoints of a run: HF exports of the trained models under `<run_dir>/checkpoints/iter_N/`.

`iter_N` holds one HF directory per trained role (`actor/`, `critic/`) written by the workers of
that role's train placement (`ModelWorker.export`), after N finished iterations. The driver
writes `checkpoint.json` into `iter_N` only once every export has finished, so a directory with
that file is complete; a run that dies mid-export leaves an `iter_N` without it, which
`latest_checkpoint` skips. With an HF tokenizer (data.tokenizer a model directory) its files are
copied beside each export first, so a checkpoint loads and chats in transformers (or vLLM) alone.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER = "checkpoint.json"
# The files of an HF tokenizer (fast or slow, with its chat template) that travel with an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


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


def mark_complete(directory: Path, iterations_done: int, roles: Sequence[str], export_metas: dict[str, Any],
                  tokenizer_dir: str | None = None) -> None:
    """Write the marker that makes `directory` a complete checkpoint (after every export returned),
    after copying the tokenizer files of `tokenizer_dir` (when it is a directory) into each role's export."""
    missing = [role for role in roles if not (directory / role / "config.json").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {directory}: exports of {missing} returned but wrote no config.json "
                           "(is the run directory on a file system every worker shares?)")
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for role in roles:
            copy_tokenizer(Path(tokenizer_dir), directory / role)
    record = {"iterations": iterations_done, "roles": list(roles), "time": time.time(), "exports": export_metas}
    (directory / MARKER).write_text(json.dumps(record, default=str, indent=1))


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """Copy the HF tokenizer files of `source` into `target`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most iterations, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = [d for d in root.glob("iter_*") if d.name.removeprefix("iter_").isdigit() and is_complete(d)]
    return max(complete, key=lambda d: int(d.name.removeprefix("iter_")), default=None)


__all__ = [
    "MARKER", "TOKENIZER_FILES", "checkpoint_dir", "copy_tokenizer", "is_complete", "is_due", "latest_checkpoint",
    "mark_complete",
]
