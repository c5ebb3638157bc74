"""Calls that run no model (`MFC.model_free`: a rule-based reward, the environments' rewards):
priced as host time with no GPU memory, never a weight on any GPU; set by the config exactly
when the reward is a rule or an environment's, and kept out of the loaded models and the
cluster memory check."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.config import build_problem, load_config
from app.config.problem import build_graph, reward_is_model_free
from app.reporting.report import plan_json, plan_report
from planning.algorithm_graphs import grpo_graph
from planning.cost import call_cost, rlhf_problem
from planning.cost_terms import BYTE_TABLE_S_PER_TOKEN, MODEL_FREE_S_PER_TOKEN
from planning.dataflow import MFC, BatchShape
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import Placement
from planning.search import symmetric_baseline
from planning.simulate import simulate

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))
TWO_GPUS = Placement(Mesh(0, 2, 2), Layout(2, 1, 1))


def graph_with_rule_reward(model_free: bool = True):
    graph = grpo_graph(BatchShape(64, 128, 512), group_size=8)
    return replace(graph, mfcs=tuple(replace(m, model_free=model_free) if m.role == "reward" else m for m in graph.mfcs))


def problem(model_free: bool = True, gpus: int = 1):
    cluster = ClusterSpec(1, gpus, hardware_preset("h200-141g"))
    return rlhf_problem(graph_with_rule_reward(model_free), cluster, model_preset("llama3.2-1b"))


def test_model_free_call_is_host_time_per_response_token_and_no_memory() -> None:
    p = problem()
    reward = p.graph.mfc("rew_inf")
    cost = call_cost(p, reward, ONE_GPU)
    assert cost.feasible and cost.mem_bytes == 0.0
    assert cost.time_s == pytest.approx(512 * 512 * MODEL_FREE_S_PER_TOKEN)
    assert call_cost(p, reward, TWO_GPUS).time_s == pytest.approx(cost.time_s / 2)  # each dp owner scores its rows
    # As a reward model forward, the same call took seconds and held its weights.
    modelled = problem(model_free=False)
    as_model = call_cost(modelled, modelled.graph.mfc("rew_inf"), ONE_GPU)
    assert as_model.time_s > 3 * cost.time_s and as_model.breakdown["weights_bytes"] > 0


def test_a_call_priced_by_the_app_uses_its_own_rate() -> None:
    p = problem()
    reward = replace(p.graph.mfc("rew_inf"), host_s_per_token=BYTE_TABLE_S_PER_TOKEN)
    assert call_cost(p, reward, ONE_GPU).time_s == pytest.approx(512 * 512 * BYTE_TABLE_S_PER_TOKEN)
    for bad, why in ((0.0, "must be > 0"), (-1e-7, "must be > 0")):
        with pytest.raises(ValueError, match=f"host_s_per_token={bad}.*{why}"):
            replace(reward, host_s_per_token=bad)
    with pytest.raises(ValueError, match="host_s_per_token=1e-07 is for model-free calls"):
        replace(p.graph.mfc("actor_gen"), host_s_per_token=1e-7)


def test_only_inference_calls_may_be_model_free() -> None:
    with pytest.raises(ValueError, match="model_free is for inference calls, not train"):
        MFC("t", "actor", "train", (), ("x",), BatchShape(4, 4, 4), model_free=True)
    graph = graph_with_rule_reward()
    assert "reward" in graph.roles and "reward" not in graph.model_roles


def test_plan_with_a_model_free_reward_is_faster_and_lighter_and_reports_it() -> None:
    free, modelled = problem(gpus=2), problem(model_free=False, gpus=2)
    plan, seconds = symmetric_baseline(free)
    a, b = simulate(free, plan), simulate(modelled, symmetric_baseline(modelled)[0])
    assert a.feasible and a.iteration_s < b.iteration_s
    assert a.call_mem_bytes["rew_inf"] < b.call_mem_bytes["rew_inf"]
    report = plan_report(free, plan, a, mode="heuristic", est_iteration_s=seconds, baseline_iteration_s=seconds,
                         search_s=0.0, evaluated_plans=1)
    row = next(r for r in report.calls if r.name == "rew_inf")
    assert row.runs_as == "host, no model" and row.est_mem_gib == 0.0
    entry = next(c for c in plan_json(report)["calls"] if c["name"] == "rew_inf")
    assert entry["model_free"] is True


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = ("algorithm: grpo\nmodels: {actor: {preset: llama3.2-1b}}\n"
        "batch: {prompts: 8, group_size: 4, prompt_len: 64, gen_len: 64}\n"
        "cluster: {nodes: 1, gpus_per_node: 1, gpu: h200-141g}\ndata: {path: toy, tokenizer: toy}\n")


def test_config_marks_the_reward_model_free_exactly_for_a_rule(tmp_path: Path) -> None:
    rule = load_config(_write(tmp_path, BASE))  # reward.function defaults to the toy rule
    assert reward_is_model_free(rule)
    assert all(m.model_free == (m.role == "reward") for m in build_graph(rule).mfcs)
    model = load_config(_write(tmp_path, BASE + "reward: {function: null}\n"))
    assert not reward_is_model_free(model) and not any(m.model_free for m in build_graph(model).mfcs)
    dpo = load_config(_write(tmp_path, BASE.replace("grpo", "dpo", 1)))
    assert not reward_is_model_free(dpo)


def test_cluster_memory_check_leaves_a_model_free_reward_out(tmp_path: Path) -> None:
    """A 1B actor's weights, gradients and optimizer state (18.4 GiB) on a 20 GiB GPU: accepted
    with a rule reward (counting a phantom 1B reward model beside it, 20.7 GiB, refused it),
    refused with a real 1B reward model."""
    from app.config import ConfigError

    sized = (BASE.replace("gpu: h200-141g}", "gpu: h200-141g, gpu_memory_gib: 20}")
             + "grpo: {kl_loss_coef: 0}\nplan: {optimizer_offload: {actor: 0}}\n")
    assert build_problem(load_config(_write(tmp_path, sized))).graph.model_roles == ("actor",)
    with_model = sized.replace("models: {actor: {preset: llama3.2-1b}}",
                               "models: {actor: {preset: llama3.2-1b}, reward: {preset: llama3.2-1b}}")
    with pytest.raises(ConfigError, match="too small for the models"):
        build_problem(load_config(_write(tmp_path, with_model + "reward: {function: null}\n")))


def test_manual_micro_batches_for_a_model_free_call_are_refused(tmp_path: Path) -> None:
    from app.config import ConfigError, manual_plan

    manual = ("plan: {mode: manual, manual: {actor_gen: {mesh: n0, layout: dp1tp1pp1}, "
              "rew_inf: {mesh: n0, layout: dp1tp1pp1, micro_batch_tokens: 64}, "
              "ref_inf: {mesh: n0, layout: dp1tp1pp1}, actor_train: {mesh: n0, layout: dp1tp1pp1}}}\n")
    cfg = load_config(_write(tmp_path, BASE + manual))
    with pytest.raises(ConfigError, match=r"plan.manual.rew_inf.micro_batch_tokens=64: .*it runs no model"):
        manual_plan(cfg, build_problem(cfg))
    fine = load_config(_write(tmp_path, BASE + manual.replace(", micro_batch_tokens: 64", "")))
    plan = manual_plan(fine, build_problem(fine))
    assert plan is not None and plan.execution("rew_inf") is None
