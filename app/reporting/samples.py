"""A few decoded rollouts per iteration in `<run_dir>/samples.jsonl`, to read what the model writes.

Generation calls with a tokenizer (a rule-based reward) report, per data-owning rank, the prompt
and decoded response of their first rows (`samples` in their metadata, rows from `row_start`);
the reward call reports each owner's `rewards` from its `row_start`. `rollout_samples` pairs
them by row, and `append_samples` writes one line per sample:

    {"iteration": 3, "row": 16, "prompt": "...", "response": "...", "reward": 1.0}

(`reward` is null when no call scored that row, e.g. with a reward model of a different layout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _rewards_by_row(call_metas: Mapping[str, Sequence[dict[str, Any]]], kinds: Mapping[str, str]) -> dict[int, float]:
    rewards: dict[int, float] = {}
    for name, metas in call_metas.items():
        if kinds.get(name) != "inference":
            continue
        for meta in metas:
            if meta.get("owner", True) and "rewards" in meta and "row_start" in meta:
                start = int(meta["row_start"])
                rewards.update({start + i: float(r) for i, r in enumerate(meta["rewards"])})
    return rewards


def rollout_samples(call_metas: Mapping[str, Sequence[dict[str, Any]]],
                    kinds: Mapping[str, str]) -> list[dict[str, Any]]:
    """The generation calls' decoded samples of one iteration with their rewards, by row.

    call_metas: call name -> metadata dicts of its ranks; kinds: call name -> generate | inference | train.
    """
    rewards = _rewards_by_row(call_metas, kinds)
    out = []
    for name, metas in call_metas.items():
        if kinds.get(name) != "generate":
            continue
        for meta in metas:
            if not meta.get("owner", True):
                continue
            start = int(meta.get("row_start", 0))
            for offset, sample in enumerate(meta.get("samples", [])):
                row = start + offset
                out.append({"call": name, "row": row, "prompt": sample.get("prompt"),
                            "response": sample.get("response"), "reward": rewards.get(row)})
    return sorted(out, key=lambda s: (s["call"], s["row"]))


def append_samples(path: Path, iteration: int, samples: Sequence[Mapping[str, Any]]) -> None:
    """Append one JSON line per sample, flushed (a crashed run keeps what finished)."""
    if not samples:
        return
    with path.open("a", encoding="utf-8") as sink:
        for sample in samples:
            sink.write(json.dumps({"iteration": iteration, **sample}, ensure_ascii=False) + "\n")


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every line of a samples.jsonl file (an empty list when there is none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["append_samples", "read_samples", "rollout_samples"]
