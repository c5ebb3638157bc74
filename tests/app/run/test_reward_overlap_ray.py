"""Rule rewards run on the worker's model-free threads: on one GPU, a slow reward function's call
overlaps the reference model's inference submitted after it, instead of holding it back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.run.driver import Driver
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

REWARD_S = 1.5  # seconds one reward call sleeps in total
ROWS = 8 * 4  # prompts x group size


def slow_length_reward(prompt: str, response: str, answer: str | None) -> float:
    """The response's length, slowly (as a verifier calling out would be)."""
    time.sleep(REWARD_S / ROWS)
    return float(len(response))


def test_a_slow_rule_reward_overlaps_the_next_call_on_its_gpu(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = load_config(DEFAULT_CONFIG, [
        f"run.dir={tmp_path}", "tracking.console=false", "checkpoint.at_end=false", "algorithm=grpo",
        "batch.prompts=8", "batch.group_size=4", "batch.ppo_minibatches=1", "grpo.kl_loss_coef=0.01",
        "cluster.gpus_per_node=1", "plan.mode=heuristic", "run.iterations=1",
        f"reward.function={__name__}:slow_length_reward"])
    driver = Driver(cfg, tmp_path)
    rows = driver.run()
    calls = {r.name: r for r in driver.records if r.kind == "call"}
    reward, ref = calls["rew_inf"], calls["ref_inf"]
    assert reward.end - reward.start >= REWARD_S * 0.9
    # Submitted after the reward call to the same worker, the ref call ran during it (without
    # the model-free threads it would start only after the reward's end).
    assert ref.start < reward.end - REWARD_S / 2, (reward, ref)
    assert rows[0]["rollout/reward_mean"] > 0 and "actor/kl" in rows[0]
