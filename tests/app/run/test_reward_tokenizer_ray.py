"""A reward model of another tokenizer family end to end (shared local Ray, virtual GPUs): GRPO with
the toy actor (character tokenizer) scored by an HF reward model with its own BPE tokenizer and
chat template. Preflight turns it into the text path, the planner prices the reward call at the
reward model's token counts, the workers decode, render, re-tokenize and cut to
models.reward.max_length, and the run's metrics count the sequences cut. One iteration, about
ten seconds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.run.driver import Driver
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)
from tests.tokenizer_families import build_reward_model

pytestmark = pytest.mark.ray

MAX_LENGTH = 16


def test_grpo_with_a_reward_model_of_another_tokenizer(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    rm = build_reward_model(tmp_path / "rm")
    cfg = load_config(DEFAULT_CONFIG, [
        f"run.dir={tmp_path / 'run'}", "tracking.console=false", "checkpoint.at_end=false", "algorithm=grpo",
        "batch.prompts=4", "batch.group_size=2", "batch.ppo_minibatches=1", "grpo.kl_loss_coef=0",
        "cluster.gpus_per_node=2", "plan.mode=heuristic", "run.iterations=1", "reward.function=null",
        f"models.reward.path={rm}", f"models.reward.max_length={MAX_LENGTH}", "models.critic=null"])
    driver = Driver(cfg, tmp_path / "run")
    assert driver.inputs.settings.rollout.reward_text is not None
    assert driver.problem.graph.mfc("rew_inf").batch.seq_len == MAX_LENGTH  # the template alone nearly fills it
    (row,) = driver.run()
    assert math.isfinite(row["rollout/reward_mean"])
    # Every rendered sequence (template + toy prompt + response) is longer than 16 reward tokens.
    assert row["reward/truncated"] == 8.0 and row["reward/seq_len_mean"] == MAX_LENGTH
