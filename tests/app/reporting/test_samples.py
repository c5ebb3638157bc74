"""Decoded rollouts paired with their rewards by row (samples.jsonl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.reporting.samples import append_samples, read_samples, rollout_samples

pytestmark = pytest.mark.unit


def test_samples_are_paired_with_rewards_by_row(tmp_path: Path) -> None:
    # Generation under dp2 (rows 0-3 and 4-7, two samples reported each); the reward under dp1.
    metas = {
        "actor_gen": [{"owner": True, "row_start": 4, "samples": [{"prompt": "p2", "response": "r4"},
                                                                  {"prompt": "p2", "response": "r5"}]},
                      {"owner": True, "row_start": 0, "samples": [{"prompt": "p0", "response": "r0"},
                                                                  {"prompt": "p0", "response": "r1"}]},
                      {"owner": False, "row_start": 0, "samples": [{"prompt": "x", "response": "x"}]}],
        "rew_inf": [{"owner": True, "row_start": 0, "rewards": [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]}],
        "actor_train": [{"actor/pg_loss": 0.1}],
    }
    kinds = {"actor_gen": "generate", "rew_inf": "inference", "actor_train": "train"}
    samples = rollout_samples(metas, kinds)
    assert [(s["row"], s["response"], s["reward"]) for s in samples] == [
        (0, "r0", 1.0), (1, "r1", 0.0), (4, "r4", 0.0), (5, "r5", 1.0)]
    path = tmp_path / "samples.jsonl"
    append_samples(path, 3, samples)
    append_samples(path, 4, [])
    read = read_samples(path)
    assert len(read) == 4 and read[0] == {"iteration": 3, "call": "actor_gen", "row": 0, "prompt": "p0",
                                          "response": "r0", "reward": 1.0}
    # A reward model that reports no rows leaves the reward unknown, not zero.
    assert rollout_samples({"actor_gen": metas["actor_gen"][:1]}, kinds)[0]["reward"] is None
    assert read_samples(tmp_path / "none.jsonl") == []
