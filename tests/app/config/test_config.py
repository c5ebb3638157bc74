"""Experiment config: YAML + overrides, schema errors naming the field, problem and manual plans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config.experiment import ConfigError, ExperimentConfig, apply_override, load_config, validate_config
from app.config.problem import build_problem, manual_plan, unread_keys
from planning.layout import Layout, Mesh
from planning.models import MODEL_PRESETS
from planning.plan import CallExecution

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY_CALLS = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")


def tiny_raw(**sections: Any) -> dict[str, Any]:
    """A valid tiny PPO config dict, with sections replaced by `sections`."""
    raw: dict[str, Any] = {
        "algorithm": "ppo",
        "models": {"actor": {"preset": "tiny"}, "critic": {"preset": "tiny-critic"}},
        "batch": {"prompts": 8, "prompt_len": 16, "gen_len": 16, "ppo_minibatches": 2},
        "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu": "cpu", "virtual_gpus": True},
        "plan": {"mode": "search", "seconds": 1},
    }
    raw.update(sections)
    return raw


def manual_section(layout: str = "dp2tp2pp1", mesh: str = "n0", **changed: dict[str, str]) -> dict[str, Any]:
    placements = {name: {"mesh": mesh, "layout": layout} for name in TINY_CALLS}
    placements.update(changed)
    return {"mode": "manual", "seconds": 1, "manual": placements}


def expect_error(raw: dict[str, Any], field: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cfg = validate_config(raw)
        manual_plan(cfg, build_problem(cfg))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    return info.value


def test_every_example_loads_and_builds_a_problem() -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    expected = {"ppo-7b-34b", "ppo-70b-7b", "ppo-8gpu", "grpo-qwen", "dpo-7b", "remax-7b", "ppo-tiny"}
    assert {p.stem for p in paths} >= expected
    for path in paths:
        # An example of a downloaded model (its shapes come from its config.json) is built with the
        # preset of the same shapes: Qwen2.5-0.5B-Instruct is qwen2.5-0.5b.
        overrides = (["models.actor.path=null", "models.actor.preset=qwen2.5-0.5b"]
                     if path.stem.endswith("qwen2.5-0.5b-gsm8k") else [])
        cfg = load_config(path, overrides)
        problem = build_problem(cfg)
        assert problem.graph.algorithm == cfg.algorithm
        assert set(problem.models) == set(problem.graph.roles)


def test_paper_example_shapes() -> None:
    cfg = load_config(EXAMPLES / "ppo-7b-34b.yaml")
    problem = build_problem(cfg)
    assert (problem.cluster.nodes, problem.cluster.gpus_per_node, problem.cluster.hardware.name) == (4, 8, "h100-80g")
    assert problem.models["actor"].spec.name == "llama-7b" and not problem.models["actor"].critic
    assert problem.models["critic"].spec.name == "llama-34b" and problem.models["critic"].critic
    # ref defaults to the actor, reward to the critic.
    assert problem.models["ref"].spec.name == "llama-7b" and not problem.models["ref"].critic
    assert problem.models["reward"].spec.name == "llama-34b" and problem.models["reward"].critic
    gen = problem.graph.mfc("actor_gen")
    assert (gen.batch.n_seqs, gen.batch.prompt_len, gen.batch.gen_len) == (512, 128, 384)
    assert problem.graph.mfc("actor_train").n_minibatches == 4


def test_grpo_groups_and_reward_defaults_to_actor_without_critic() -> None:
    raw = tiny_raw(algorithm="grpo", models={"actor": {"preset": "tiny"}},
                   batch={"prompts": 4, "prompt_len": 8, "gen_len": 8, "ppo_minibatches": 2, "group_size": 4})
    problem = build_problem(validate_config(raw))
    assert problem.graph.mfc("actor_gen").batch.n_seqs == 16
    assert problem.models["reward"].spec.name == "tiny" and problem.models["reward"].critic
    assert "critic" not in problem.models


def test_grpo_kl_is_its_own_loss_coefficient_not_ppo_kl_coef() -> None:
    from app.algorithms import settings_from_config

    grpo_batch = {"prompts": 4, "prompt_len": 8, "gen_len": 8, "ppo_minibatches": 2, "group_size": 4}
    raw = tiny_raw(algorithm="grpo", models={"actor": {"preset": "tiny"}}, batch=grpo_batch)
    settings = settings_from_config(validate_config(raw), None, None, None)
    assert settings.grpo is not None and settings.grpo.kl_loss_coef == 0.001  # veRL's default
    assert settings.grpo.kl_loss_estimator == "low_var_kl" and settings.grpo.scale_by_std
    raw["grpo"] = {"kl_loss_coef": 0.02, "kl_loss_estimator": "k1", "scale_by_std": False}
    settings = settings_from_config(validate_config(raw), None, None, None)
    assert (settings.grpo.kl_loss_coef, settings.grpo.kl_loss_estimator, settings.grpo.scale_by_std) == (0.02, "k1", False)
    error = expect_error({**raw, "ppo": {"kl_coef": 0.05}}, "ppo.kl_coef")
    assert "grpo.kl_loss_coef" in str(error)
    expect_error({**raw, "grpo": {"kl_loss_coef": -1.0}}, "grpo.kl_loss_coef")
    validate_config({**raw, "ppo": {"kl_coef": 0.0}})  # no reward penalty: consistent with GRPO


def test_overrides_parse_yaml_scalars_and_nest(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_raw()))
    cfg = load_config(path, ["batch.prompts=16", "cluster.virtual_gpus=false", "plan.seconds=0.5",
                             "run.name=my run", "models.ref={preset: tiny}", "algorithm=dpo", "run.dir=2024"])
    assert cfg.batch.prompts == 16 and cfg.cluster.virtual_gpus is False and cfg.plan.seconds == 0.5
    assert cfg.run.name == "my run" and cfg.models.ref is not None and cfg.models.ref.preset == "tiny"
    assert cfg.algorithm == "dpo" and cfg.run.dir == "2024"  # a YAML int into a string field


@pytest.mark.parametrize("override, field", [("batch.prompts", "override"), ("=3", "override"),
                                             ("batch.prompts.x=1", "batch.prompts")])
def test_bad_override(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_override(tiny_raw(), override)
    assert info.value.field == field


@pytest.mark.parametrize("change, field, allowed_part", [
    ({"algorithm": "sft"}, "algorithm", "'grpo'"),
    ({"models": {"actor": {"preset": "llama-8b"}}}, "models.actor.preset", "llama-7b"),
    ({"models": {"actor": {"preset": "tiny", "path": "/x"}}}, "models.actor", "exactly one"),
    ({"models": {"actor": {"preset": "tiny", "size": 3}}}, "models.actor.size", "preset, path"),
    ({"batch": {"gen_len": -4}}, "batch.gen_len", "greater than or equal to 1"),
    ({"batch": {"prompts": "many"}}, "batch.prompts", "integer"),
    ({"batch": {"prompts": 8, "ppo_minibatches": 3}}, "batch.ppo_minibatches", "divisor"),
    ({"cluster": {"gpu": "v100"}}, "cluster.gpu", "h100-80g"),
    ({"cluster": {"nodes": 0}}, "cluster.nodes", "greater than or equal to 1"),
    ({"plan": {"mode": "greedy"}}, "plan.mode", "'exhaustive'"),
    ({"plan": {"seconds": 0}}, "plan.seconds", "greater than 0"),
    ({"plan": {"mode": "manual"}}, "plan.manual", "every call"),
    ({"plan": {"profile": "/nonexistent/profile.json"}}, "plan.profile", "profile JSON"),
    ({"plan": {"memory_margin": 1.0}}, "plan.memory_margin", "less than 1"),
    ({"plan": {"recalibrate_after": 0}}, "plan.recalibrate_after", "greater than or equal to 1"),
    ({"plan": {"switch_gain": -0.1}}, "plan.switch_gain", "greater than or equal to 0"),
    ({"trainer": {"wandb": True}}, "trainer", "algorithm, models, batch, cluster, plan, run, data"),
    ({"cluster": {"gpu": "a100-80g", "gpus_per_node": 4}, "sampling": {"fp8": True}}, "sampling.fp8",
     "h100-80g, h200-141g"),
])
def test_schema_errors_name_field_value_and_allowed(change: dict[str, Any], field: str, allowed_part: str) -> None:
    error = expect_error(tiny_raw(**change), field)
    assert allowed_part in error.allowed
    assert "allowed:" in str(error)


def test_fp8_decode_is_refused_only_on_gpus_without_fp8_matmuls() -> None:
    """An A100 would run sampling.fp8 through the float32 emulation: refused naming the GPU. H100 /
    H200 take it, and so do the CPU's virtual GPUs (the tests' emulation); an FP8 cache needs no
    FP8 matmuls."""
    error = expect_error(tiny_raw(cluster={"gpu": "a100-80g", "gpus_per_node": 4}, sampling={"fp8": True}),
                         "sampling.fp8")
    assert "cluster.gpu='a100-80g' has no FP8 matmuls" in str(error)
    for cluster in ({"gpu": "h100-80g", "gpus_per_node": 4}, {"gpu": "a100-80g", "gpus_per_node": 4,
                                                             "virtual_gpus": True}, {"gpu": "cpu", "gpus_per_node": 4}):
        assert validate_config(tiny_raw(cluster=cluster, sampling={"fp8": True})).sampling.fp8
    assert validate_config(tiny_raw(cluster={"gpu": "a100-80g", "gpus_per_node": 4},
                                    sampling={"kv_cache_dtype": "fp8"})).sampling.kv_cache_dtype == "fp8"


def test_missing_models_section_is_named() -> None:
    raw = tiny_raw()
    del raw["models"]
    assert "required" in str(expect_error(raw, "models"))


def test_unknown_field_is_reported_before_what_it_leaves_missing() -> None:
    plan = manual_section()
    plan["manual"]["actor_gen"] = {"mesh": "n0", "layuot": "dp4"}
    error = expect_error(tiny_raw(plan=plan), "plan.manual.actor_gen.layuot")
    assert "mesh, layout" in error.allowed


def test_cluster_too_small_for_weights_and_optimizer() -> None:
    no_offload = {"mode": "search", "seconds": 1, "optimizer_offload": {"actor": 0, "critic": 0}}
    raw = tiny_raw(models={"actor": {"preset": "llama-70b"}, "critic": {"preset": "llama-7b"}},
                   cluster={"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80g"}, plan=no_offload)
    error = expect_error(raw, "cluster")
    assert "1x8 h100-80g" in str(error) and "GiB" in error.allowed
    # Host memory counts when the planner may offload optimizer state: 8 GPUs alone are too few.
    raw = tiny_raw(models={"actor": {"preset": "llama-70b"}, "critic": {"preset": "llama-7b"}},
                   cluster={"nodes": 1, "gpus_per_node": 2, "gpu": "h100-80g"})
    error = expect_error(raw, "cluster")
    assert "of optimizer state in host memory" in error.allowed


def test_sequence_longer_than_model_positions() -> None:
    long_batch = {"prompts": 8, "prompt_len": 400, "gen_len": 200, "ppo_minibatches": 2}
    expect_error(tiny_raw(batch=long_batch), "batch.gen_len")


def test_model_from_hf_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["tiny"].to_hf_config()))
    models = {"actor": {"path": str(tmp_path)}, "critic": {"preset": "tiny-critic"}}
    problem = build_problem(validate_config(tiny_raw(models=models)))
    assert problem.models["actor"].spec.hidden_size == MODEL_PRESETS["tiny"].hidden_size
    expect_error(tiny_raw(models={"actor": {"path": str(tmp_path / "missing")}}), "models.actor.path")


def test_profile_overrides_hardware(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"peak_flops": 1.5e10, "hbm_bw": 5e9}))
    problem = build_problem(validate_config(tiny_raw(plan={"profile": str(profile)})))
    assert problem.cluster.hardware.peak_flops == 1.5e10 and problem.cluster.hardware.hbm_bw == 5e9


def test_grpo_without_kl_loss_plans_no_reference_model() -> None:
    grpo_batch = {"prompts": 4, "prompt_len": 8, "gen_len": 8, "ppo_minibatches": 1, "group_size": 4}
    raw = tiny_raw(algorithm="grpo", models={"actor": {"preset": "tiny"}}, batch=grpo_batch)
    with_kl = build_problem(validate_config(raw))
    assert [m.name for m in with_kl.graph.mfcs] == ["actor_gen", "rew_inf", "ref_inf", "actor_train"]
    cfg = validate_config({**raw, "grpo": {"kl_loss_coef": 0.0}})
    problem = build_problem(cfg)
    assert [m.name for m in problem.graph.mfcs] == ["actor_gen", "rew_inf", "actor_train"]
    assert "ref" not in problem.models and "ref_logprobs" not in problem.graph.mfc("actor_train").input_keys
    # A manual plan written for the full graph still loads: the dropped call's entry is ignored.
    calls = ("actor_gen", "rew_inf", "ref_inf", "actor_train")
    manual = {"mode": "manual", "seconds": 1, "manual": {n: {"mesh": "n0", "layout": "dp4"} for n in calls}}
    cfg = validate_config({**raw, "grpo": {"kl_loss_coef": 0.0}, "plan": manual})
    plan = manual_plan(cfg, build_problem(cfg))
    assert plan is not None and [name for name, _ in plan.placements] == list(calls[:2] + calls[3:])


def test_reference_kept_where_a_loss_or_the_kl_controller_reads_it() -> None:
    remax = {"algorithm": "remax", "models": {"actor": {"preset": "tiny"}}}
    assert unread_keys(validate_config(tiny_raw(**remax, ppo={"kl_coef": 0.0}))) == ("ref_logprobs",)
    assert unread_keys(validate_config(tiny_raw(**remax, ppo={"kl_coef": 0.1}))) == ()
    ppo = validate_config(tiny_raw(ppo={"kl_coef": 0.0}))  # PPO's actor/kl feeds the controller
    assert unread_keys(ppo) == () and "ref_inf" in [m.name for m in build_problem(ppo).graph.mfcs]


def test_manual_plan_in_graph_order() -> None:
    cfg = validate_config(tiny_raw(plan=manual_section(actor_train={"mesh": "n0:g0-1", "layout": "tp2"})))
    plan = manual_plan(cfg, build_problem(cfg))
    assert plan is not None
    # actor_inf, left out, runs where the actor trains (planning.dataflow.Graph.placement_default).
    assert [name for name, _ in plan.placements] == [*TINY_CALLS[:4], "actor_inf", *TINY_CALLS[4:]]
    assert plan["actor_gen"].layout == Layout(2, 2, 1) and plan["actor_gen"].mesh == Mesh(0, 4, 4)
    assert plan["actor_train"].layout == Layout(1, 2, 1) and plan["actor_train"].mesh == Mesh(0, 2, 4)
    assert plan["actor_inf"] == plan["actor_train"]
    assert manual_plan(validate_config(tiny_raw()), build_problem(validate_config(tiny_raw()))) is None


@pytest.mark.parametrize("changed, field, text", [
    ({"actor_gen": {"mesh": "n0", "layout": "dp4tp3"}}, "plan.manual.actor_gen.layout", "tp=3"),
    ({"actor_gen": {"mesh": "n0", "layout": "tp2x"}}, "plan.manual.actor_gen.layout", "dp2tp2pp1"),
    ({"actor_gen": {"mesh": "n1", "layout": "dp4"}}, "plan.manual.actor_gen.mesh", "outside the cluster"),
    ({"actor_gen": {"mesh": "n0:g1-2", "layout": "dp2"}}, "plan.manual.actor_gen.mesh", "legal mesh"),
    ({"actor_gen": {"mesh": "n0:g0-1", "layout": "dp4"}}, "plan.manual.actor_gen.layout", "2 GPUs"),
    ({"critic_train": {"mesh": "n0", "layout": "dp1pp4tp1"}}, "plan.manual.critic_train.layout", "n_layers=2"),
    ({"warmup": {"mesh": "n0", "layout": "dp4"}}, "plan.manual.warmup", "actor_gen"),
    ({"actor_gen": {"mesh": "n0", "layout": "dp4", "micro_batch_tokens": 64}},
     "plan.manual.actor_gen.micro_batch_tokens", "gen_rounds"),
    ({"ref_inf": {"mesh": "n0", "layout": "dp4", "gen_rounds": 2}}, "plan.manual.ref_inf.gen_rounds",
     "micro_batch_tokens"),
    ({"ref_inf": {"mesh": "n0", "layout": "dp4", "micro_batch_tokens": 0}}, "plan.manual.ref_inf.micro_batch_tokens",
     "greater than or equal to 1"),
])
def test_manual_plan_errors(changed: dict[str, dict[str, str]], field: str, text: str) -> None:
    error = expect_error(tiny_raw(plan=manual_section(**changed)), field)
    assert text in str(error)


def test_manual_plan_may_say_how_calls_run() -> None:
    section = manual_section(actor_gen={"mesh": "n0", "layout": "dp4", "gen_rounds": 2},
                             actor_train={"mesh": "n0", "layout": "dp4", "micro_batch_tokens": 512})
    cfg = validate_config(tiny_raw(plan=section))
    plan = manual_plan(cfg, build_problem(cfg))
    assert plan is not None
    assert plan.execution("actor_gen") == CallExecution(gen_rounds=2)
    assert plan.execution("actor_train") == CallExecution(micro_batch_tokens=512)
    assert plan.execution("ref_inf") is None  # the cost model picks it


def test_manual_plan_must_cover_every_call() -> None:
    plan = manual_section()
    del plan["manual"]["critic_train"]
    assert "critic_train" in expect_error(tiny_raw(plan=plan), "plan.manual").allowed


def test_config_is_frozen_and_error_is_value_error() -> None:
    cfg = validate_config(tiny_raw())
    assert isinstance(cfg, ExperimentConfig)
    with pytest.raises(ValueError):
        cfg.batch.prompts = 3  # type: ignore[misc]
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("text, problem", [("a: [1,\n", "line 2"), ("- 1\n- 2\n", "holds a list")])
def test_unreadable_yaml_names_the_file(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "config" and problem in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("changes, field, text", [
    ({"run": {"max_staleness": 1}, "algorithm": "dpo"}, "run.max_staleness", "generates nothing"),
    ({"run": {"max_staleness": 1}, "ppo": {"recompute_logprobs": False}}, "run.max_staleness", "recompute_logprobs"),
    ({"run": {"max_staleness": 1}, "algorithm": "dapo"}, "run.max_staleness", "dynamic_sampling"),
    ({"run": {"max_staleness": -1}}, "run.max_staleness", "greater than or equal to 0"),
    ({"algorithm": "rloo", "batch": {"prompts": 8, "group_size": 1, "ppo_minibatches": 2}}, "batch.group_size",
     ">= 2"),
    ({"algorithm": "dapo", "ppo": {"kl_coef": 0.1}}, "ppo.kl_coef", "loss term"),
    ({"algorithm": "dapo", "dapo": {"overlong_buffer": 20}}, "dapo.overlong_buffer", "gen_len=16"),
    ({"ppo": {"rollout_is": "token", "recompute_logprobs": False}}, "ppo.rollout_is", "recompute_logprobs"),
    ({"algorithm": "vapo"}, "algorithm", "'reinforce_pp_baseline'"),
])
def test_algorithm_and_staleness_checks_name_the_field(changes: dict[str, Any], field: str, text: str) -> None:
    raw = tiny_raw()
    for section, value in changes.items():
        raw[section] = {**raw.get(section, {}), **value} if isinstance(value, dict) else value
    assert text in str(expect_error(raw, field))


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo"])
def test_new_algorithms_build_their_graph_and_run_ahead(algorithm: str) -> None:
    cfg = validate_config({**tiny_raw(), "algorithm": algorithm, "run": {"max_staleness": 2},
                           "dapo": {"dynamic_sampling": False}})
    graph = build_problem(cfg).graph
    assert graph.algorithm == algorithm and graph.max_staleness == 2
    assert graph.mfc("actor_gen").batch.n_seqs == 8 * 8  # batch.group_size 8 samples per prompt


def test_an_entropy_bonus_is_planned_where_a_loss_has_it() -> None:
    """ppo.entropy_coef > 0 marks actor training (its float32 entropy buffers are priced); the
    critic's value loss and DPO's loss have no entropy term."""
    tiny = EXAMPLES / "ppo-tiny.yaml"
    assert not any(m.with_entropy for m in build_problem(load_config(tiny)).graph.mfcs)
    bonus = build_problem(load_config(tiny, ["ppo.entropy_coef=0.01"]))
    assert [m.name for m in bonus.graph.mfcs if m.with_entropy] == ["actor_train"]
    dpo = build_problem(load_config(EXAMPLES / "dpo-tiny.yaml", ["ppo.entropy_coef=0.01"]))
    assert not any(m.with_entropy for m in dpo.graph.mfcs)
