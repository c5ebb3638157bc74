"""Unit tier for app/algorithms: each call of the PPO, GRPO and ReMax graphs gets an op the worker
knows and the hyperparameters it reads; bad hyperparameters fail naming the field."""

from __future__ import annotations

import pytest

from actors.worker.model_worker import CALL_OPS
from app.algorithms import (
    AlgorithmSettings,
    GRPOHyperparams,
    PPOHyperparams,
    RolloutSettings,
    call_params,
    settings_from_config,
)
from planning.dataflow import BatchShape, grpo_graph, ppo_graph, remax_graph

BATCH = BatchShape(4, 8, 8)
ROLLOUT = RolloutSettings(max_new_tokens=8, temperature=0.7, seed=3, eos_token_id=2,
                          tokenizer="app.data.toy_task:CharTokenizer", reward_fn="app.data.toy_task:toy_reward")


@pytest.mark.unit
def test_ppo_calls_get_their_ops_and_hyperparameters() -> None:
    settings = AlgorithmSettings("ppo", ROLLOUT, PPOHyperparams(ppo_minibatches=2, entropy_coef=0.01))
    params = {m.name: call_params(settings, m, kl_coef=0.123) for m in ppo_graph(BATCH).mfcs}
    assert {name: p["op"] for name, p in params.items()} == {
        "actor_gen": "generate", "rew_inf": "rule_reward", "ref_inf": "logprobs", "critic_inf": "values",
        "actor_train": "ppo_actor", "critic_train": "ppo_critic"}
    assert all(p["op"] in CALL_OPS for p in params.values())
    assert params["actor_gen"]["temperature"] == 0.7 and params["actor_gen"]["max_new_tokens"] == 8
    assert params["ref_inf"]["temperature"] == 0.7  # logprobs under the sampling distribution
    assert params["actor_train"]["kl_coef"] == params["critic_train"]["kl_coef"] == 0.123
    assert params["actor_train"]["entropy_coef"] == 0.01 and params["critic_train"]["value_clip"] == 0.2
    # Both train calls compute the same advantages: every shared knob agrees.
    shared = set(params["actor_train"]) & set(params["critic_train"]) - {"op"}
    assert all(params["actor_train"][k] == params["critic_train"][k] for k in shared)


@pytest.mark.unit
def test_reward_model_and_greedy_sampling() -> None:
    rollout = RolloutSettings(max_new_tokens=4, temperature=0.0, reward_fn=None)
    settings = AlgorithmSettings("ppo", rollout, PPOHyperparams())
    graph = ppo_graph(BATCH)
    assert call_params(settings, graph.mfc("rew_inf"), 0.0)["op"] == "model_reward"
    assert call_params(settings, graph.mfc("actor_train"), 0.0)["temperature"] == 1.0  # greedy has no temperature


@pytest.mark.unit
def test_grpo_samples_groups_and_uses_a_kl_loss() -> None:
    settings = AlgorithmSettings("grpo", ROLLOUT, PPOHyperparams(), GRPOHyperparams(group_size=4, kl_loss_coef=0.01))
    graph = grpo_graph(BATCH, group_size=4)
    params = {m.name: call_params(settings, m, kl_coef=0.5) for m in graph.mfcs}
    assert params["actor_gen"]["n_samples"] == 4
    train = params["actor_train"]
    assert train["op"] == "grpo_actor" and train["group_size"] == 4 and train["kl_loss_coef"] == 0.01
    assert train["kl_coef"] == 0.0  # no KL penalty in the reward
    with pytest.raises(ValueError, match="batch.group_size=1"):
        GRPOHyperparams(group_size=1)


@pytest.mark.unit
def test_remax_greedy_branch_is_prefixed() -> None:
    settings = AlgorithmSettings("remax", ROLLOUT, PPOHyperparams())
    params = {m.name: call_params(settings, m, kl_coef=0.0) for m in remax_graph(BATCH).mfcs}
    assert params["greedy_gen"]["greedy"] and params["greedy_gen"]["out_prefix"] == "greedy_"
    assert not params["sample_gen"]["greedy"] and "out_prefix" not in params["sample_gen"]
    assert params["greedy_rew_inf"]["in_prefix"] == "greedy_" and params["greedy_rew_inf"]["out_key"] == "greedy_rewards"
    assert params["actor_train"]["op"] == "remax_actor" and params["actor_train"]["whiten"] is False


@pytest.mark.unit
def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="ppo.kl_estimator='kl'"):
        PPOHyperparams(kl_estimator="kl")
    with pytest.raises(ValueError, match="sampling.top_p=0.0"):
        RolloutSettings(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="reward.function='toy_reward'"):
        RolloutSettings(max_new_tokens=4, reward_fn="toy_reward")
    with pytest.raises(ValueError, match="algorithm='dpo'"):
        AlgorithmSettings("dpo", ROLLOUT, PPOHyperparams())


@pytest.mark.unit
def test_settings_from_the_tiny_example_config() -> None:
    from app.config.experiment import load_config

    cfg = load_config("examples/ppo-tiny.yaml")
    settings = settings_from_config(cfg, "app.data.toy_task:CharTokenizer", "app.data.rewards:toy_reward", eos_token_id=2)
    assert settings.rollout.max_new_tokens == cfg.batch.gen_len
    assert settings.ppo.ppo_minibatches == cfg.batch.ppo_minibatches and settings.ppo.kl_coef == cfg.ppo.kl_coef
