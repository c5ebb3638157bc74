"""Unit tier for app/algorithms: each call of every algorithm's graph gets an op the worker knows and the
hyperparameters it reads, every worker knob is reachable from YAML, and bad values fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.rl import make_kl_controller
from actors.worker import CALL_OPS
from app.algorithms import (
    AlgorithmSettings,
    GRPOHyperparams,
    PPOHyperparams,
    RolloutSettings,
    call_params,
    settings_from_config,
)
from app.config import ConfigError, build_problem, load_config
from planning.algorithm_graphs import grpo_graph, ppo_graph, remax_graph
from planning.dataflow import BatchShape

BATCH = BatchShape(4, 8, 8)
TINY = Path(__file__).resolve().parents[3] / "examples" / "ppo-tiny.yaml"
ROLLOUT = RolloutSettings(max_new_tokens=8, temperature=0.7, seed=3, eos_token_id=2,
                          tokenizer="app.data.toy_task:CharTokenizer", reward_fn="app.data.toy_task:toy_reward")


@pytest.mark.unit
def test_ppo_calls_get_their_ops_and_hyperparameters() -> None:
    settings = AlgorithmSettings("ppo", ROLLOUT, PPOHyperparams(ppo_minibatches=2, entropy_coef=0.01))
    params = {m.name: call_params(settings, m, kl_coef=0.123) for m in ppo_graph(BATCH).mfcs}
    assert {name: p["op"] for name, p in params.items()} == {
        "actor_gen": "generate", "rew_inf": "rule_reward", "ref_inf": "logprobs", "critic_inf": "values",
        "actor_inf": "logprobs", "actor_train": "ppo_actor", "critic_train": "ppo_critic"}
    assert params["actor_inf"]["out_key"] == "old_logprobs" and params["ref_inf"]["out_key"] == "ref_logprobs"
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


def settings_of(*overrides: str) -> AlgorithmSettings:
    cfg = load_config(TINY, ["run.dir=/tmp/unused", *overrides])
    return settings_from_config(cfg, "app.data.toy_task:CharTokenizer", "app.data.rewards:toy_reward", 2)


@pytest.mark.unit
def test_every_worker_knob_is_reachable_from_yaml() -> None:
    settings = settings_of("ppo.entropy_coef=0.01", "ppo.dual_clip=3.0", "ppo.clip_eps_high=0.3",
                           "ppo.no_eos_penalty=0.5", "ppo.recompute_logprobs=false", "ppo.rollout_is=none")
    train = call_params(settings, build_problem(load_config(TINY)).graph.mfc("actor_train"), kl_coef=0.1)
    assert (train["entropy_coef"], train["dual_clip"], train["clip_eps_high"]) == (0.01, 3.0, 0.3)
    assert train["no_eos_penalty"] == 0.5 and train["recompute_logprobs"] is False and train["rollout_is"] is None
    assert settings_of("run.max_staleness=1").ppo.rollout_is == "token"  # auto: on when stale
    fp8 = settings_of("sampling.fp8=true")  # auto: on when the rollout samples from FP8 weights
    assert fp8.ppo.rollout_is == "token" and fp8.rollout.generate_params()["fp8"] is True
    assert settings_of().rollout.generate_params()["fp8"] is False and settings_of().ppo.rollout_is is None
    assert settings_of("sampling.fp8=true", "ppo.rollout_is=none").ppo.rollout_is is None
    assert settings_of("sampling.fp8=true", "ppo.recompute_logprobs=false").ppo.rollout_is is None
    kv = settings_of("sampling.kv_cache_dtype=fp8")
    assert kv.ppo.rollout_is == "token" and kv.rollout.generate_params()["kv_cache_dtype"] == "fp8"
    assert settings_of().rollout.generate_params()["compact_fraction"] == 0.75
    assert settings_of("sampling.compact_fraction=0").rollout.generate_params()["compact_fraction"] == 0.0
    assert settings_of("ppo.rollout_is=sequence", "ppo.rollout_is_threshold=3").ppo.rollout_is_threshold == 3.0


@pytest.mark.unit
@pytest.mark.parametrize("override, field", [
    ("ppo.dual_clip=1.0", "ppo.dual_clip"), ("ppo.clip_eps_high=0", "ppo.clip_eps_high"),
    ("ppo.entropy_coef=-1", "ppo.entropy_coef"), ("ppo.no_eos_penalty=-0.5", "ppo.no_eos_penalty"),
    ("ppo.recompute_logprobs=maybe", "ppo.recompute_logprobs"), ("ppo.rollout_is=geometric", "ppo.rollout_is"),
    ("ppo.rollout_is_threshold=0.5", "ppo.rollout_is_threshold"),
    ("sampling.kv_cache_dtype=int8", "sampling.kv_cache_dtype"), ("sampling.fp8=maybe", "sampling.fp8"),
    ("sampling.compact_fraction=1", "sampling.compact_fraction"),
    ("sampling.compact_fraction=-0.1", "sampling.compact_fraction"),
])
def test_bad_worker_knobs_fail_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, [override])
    assert caught.value.field == field


@pytest.mark.unit
@pytest.mark.parametrize("algorithm, advantage, policy_loss", [
    ("rloo", "rloo", "ppo"), ("reinforce_pp", "reinforce_pp", "ppo"),
    ("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo"), ("dapo", "grpo", "ppo"), ("gspo", "grpo", "gspo"),
])
def test_outcome_algorithms_get_their_estimator_and_loss(algorithm: str, advantage: str, policy_loss: str) -> None:
    kl_in_reward = algorithm in ("rloo", "reinforce_pp", "reinforce_pp_baseline")
    kl = "ppo.kl_coef=0.05" if kl_in_reward else "grpo.kl_loss_coef=0.01"  # each family's KL term
    overrides = [f"algorithm={algorithm}", "batch.group_size=4", "plan.mode=heuristic", kl]
    cfg = load_config(TINY, overrides)
    graph = build_problem(cfg).graph
    settings = settings_of(*overrides)
    params = {m.name: call_params(settings, m, kl_coef=0.05) for m in graph.mfcs}
    train = params["actor_train"]
    assert params["actor_gen"]["n_samples"] == 4 and train["group_size"] == 4
    assert (train["op"], train["advantage"], train["policy_loss"]) == ("outcome_actor", advantage, policy_loss)
    assert all(p["op"] in CALL_OPS for p in params.values())
    assert train["kl_coef"] == (0.05 if kl_in_reward else 0.0)
    assert train["kl_loss_coef"] == (0.0 if kl_in_reward else 0.01)
    assert "ref_inf" in params and "ref_logprobs" in graph.mfc("actor_train").input_keys
    no_kl = build_problem(load_config(TINY, overrides[:-1] + [kl.replace("0.05", "0").replace("0.01", "0")])).graph
    assert "ref_inf" not in [m.name for m in no_kl.mfcs]  # no KL term, no reference call
    if algorithm == "dapo":
        assert train["clip_eps_high"] == 0.28 and graph.mfc("actor_gen").expected_runs == pytest.approx(1 / 0.7)
    if algorithm == "gspo":
        assert (train["clip_eps"], train["clip_eps_high"]) == (3e-4, 4e-4)


@pytest.mark.unit
def test_remax_with_a_kl_coefficient_has_a_reference_call() -> None:
    with_kl = build_problem(load_config(TINY, ["algorithm=remax", "ppo.kl_coef=0.05", "plan.mode=heuristic"])).graph
    without = build_problem(load_config(TINY, ["algorithm=remax", "ppo.kl_coef=0", "plan.mode=heuristic"])).graph
    assert "ref_inf" in [m.name for m in with_kl.mfcs] and "ref_logprobs" in with_kl.mfc("actor_train").input_keys
    assert "ref_inf" not in [m.name for m in without.mfcs]


@pytest.mark.unit
def test_adaptive_kl_with_config_defaults_rises_when_the_kl_is_above_target() -> None:
    """actor/kl is a per-token mean; the default target must be per token too (veRL: 0.1). With the
    old default of 6.0 (a per-sequence sum) a per-token KL of 0.3 shrank the coefficient."""
    p = load_config(TINY, ["ppo.kl_controller=adaptive", "ppo.kl_coef=0.05"]).ppo
    controller = make_kl_controller(p.kl_controller, p.kl_coef, p.kl_target, p.kl_horizon)
    for _ in range(10):
        controller.update(0.3, 64)
    assert controller.value > 0.05
