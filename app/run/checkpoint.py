"""Checkpoints of a run under `<run_dir>/checkpoints/iter_N/`, written atomically.

`iter_N` (after N finished iterations) holds one HF directory per trained role (`actor/`,
`critic/`, written by `ModelWorker.export`), `state/` (each trained role's shards of weights,
fp32 master weights and AdamW moments, `actors.worker.state`, plus every worker's random
generator states) and `checkpoint.json` (the driver's state: data position, KL controller,
iteration, W&B run id, where each role was saved; app.run.resume).

Atomic: everything is written into `checkpoints/.tmp-iter_N/` and the directory is renamed to
`iter_N` once complete (a rename within one file system is atomic), so `iter_N` is either whole
or absent. A directory is never rewritten in place: the rename refuses an existing `iter_N`.
A run killed mid-write leaves `.tmp-iter_N`, which is never loaded: `incomplete_checkpoints`
lists it (and any `iter_N` without `checkpoint.json`, e.g. written by an older version) so the
driver can report it; the next write of the same N replaces it. `prune` keeps the newest K.
With an HF tokenizer (data.tokenizer a model directory) its files are copied beside each export
before the marker, so a checkpoint loads and chats in transformers (or vLLM) alone.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER = "checkpoint.json"
STAGING_PREFIX = ".tmp-"
DELETING_PREFIX = ".del-"
STATE_DIR = "state"
RNG_DIR = "rng"
# The files of an HF tokenizer (fast or slow, with its chat template) that travel with an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def checkpoint_dir(run_dir: str | Path, iterations_done: int) -> Path:
    """`<run_dir>/checkpoints/iter_<N>` for a checkpoint after N finished iterations."""
    if iterations_done < 1:
        raise ValueError(f"iterations_done={iterations_done}: a checkpoint follows at least one iteration")
    return Path(run_dir) / "checkpoints" / f"iter_{iterations_done}"


def staging_dir(run_dir: str | Path, iterations_done: int) -> Path:
    """Where checkpoint N is written before the rename: `checkpoints/.tmp-iter_N`."""
    final = checkpoint_dir(run_dir, iterations_done)
    return final.with_name(STAGING_PREFIX + final.name)


def begin(run_dir: str | Path, iterations_done: int) -> Path:
    """An empty staging directory for checkpoint N (a leftover of a killed writer is removed).
    Raises FileExistsError when `iter_N` already exists: checkpoints are never rewritten."""
    final = checkpoint_dir(run_dir, iterations_done)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; a checkpoint is never rewritten in place")
    staging = staging_dir(run_dir, iterations_done)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def is_due(iterations_done: int, every: int, total: int | None, at_end: bool) -> bool:
    """Whether to checkpoint after `iterations_done` iterations (every N, and at the end)."""
    periodic = every > 0 and iterations_done % every == 0
    final = at_end and total is not None and iterations_done == total
    return periodic or final


def commit(staging: Path, iterations_done: int, roles: Sequence[str], record: dict[str, Any],
           tokenizer_dir: str | None = None) -> Path:
    """Copy the tokenizer files of `tokenizer_dir` (when it is a directory) into each role's
    export, write the marker into `staging` (after every worker's write returned) and rename it
    to `iter_N`. Returns the final directory."""
    missing = [role for role in roles if not (staging / role / "config.json").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {staging}: exports of {missing} returned but wrote no config.json "
                           "(is the run directory on a file system every worker shares?)")
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for role in roles:
            copy_tokenizer(Path(tokenizer_dir), staging / role)
    body = {"iterations": iterations_done, "roles": list(roles), "time": time.time(), **record}
    marker = staging / MARKER
    with marker.open("w", encoding="utf-8") as sink:
        sink.write(json.dumps(body, default=str, indent=1))
        sink.flush()
        os.fsync(sink.fileno())
    final = staging.with_name(staging.name.removeprefix(STAGING_PREFIX))
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; a checkpoint is never rewritten in place")
    os.rename(staging, final)
    return final


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """Copy the HF tokenizer files of `source` into `target`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def is_complete(directory: str | Path) -> bool:
    directory = Path(directory)
    return not directory.name.startswith(STAGING_PREFIX) and (directory / MARKER).is_file()


def iterations_of(directory: str | Path) -> int | None:
    """N of `iter_N` (staging or final), None for any other name."""
    name = Path(directory).name.removeprefix(STAGING_PREFIX)
    number = name.removeprefix("iter_")
    return int(number) if name.startswith("iter_") and number.isdigit() else None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, fewest iterations first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and iterations_of(d) is not None and is_complete(d)]
    return sorted(found, key=lambda d: iterations_of(d) or 0)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most iterations, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories that are not complete (never loaded): staging directories of a
    killed writer and `iter_N` directories without a marker."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and iterations_of(d) is not None and not is_complete(d))


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep 0: delete none); returns them."""
    if keep <= 0:
        return []
    old = complete_checkpoints(run_dir)[:-keep]
    for directory in old:
        # Renamed first (atomic), so a kill during the deletion never leaves a marker beside a
        # half-deleted checkpoint; leftovers are removed by the next prune.
        doomed = directory.with_name(DELETING_PREFIX + directory.name)
        os.rename(directory, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in (Path(run_dir) / "checkpoints").glob(DELETING_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return old


__all__ = [
    "DELETING_PREFIX", "MARKER", "RNG_DIR", "STAGING_PREFIX", "STATE_DIR", "TOKENIZER_FILES", "begin",
    "checkpoint_dir", "commit", "complete_checkpoints", "copy_tokenizer", "incomplete_checkpoints", "is_complete",
    "is_due", "iterations_of", "latest_checkpoint", "prune", "staging_dir",
]
