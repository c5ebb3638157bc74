"""`python -m app plan` with optimizer offload: an 8B GRPO on one H200 plans with the least
offload and shows it; plan.optimizer_offload pins it or names what is wrong with it. The reward
is a rule, which loads no model (4/8 offload; 5/8 while the planner counted a phantom 8B reward
model's weights beside the actor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.cli.plan import plan_experiment
from app.config import ConfigError, build_problem, load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
GRPO_8B = {
    "algorithm": "grpo",
    "models": {"actor": {"preset": "llama3-8b"}},
    "batch": {"prompts": 32, "prompt_len": 128, "gen_len": 512, "group_size": 8},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h200-141g"},
    "plan": {"mode": "search", "seconds": 5},
    "data": {"path": "toy", "tokenizer": "toy"},
    "reward": {"function": "app.data.rewards:toy_reward"},
}


@pytest.fixture()
def config(tmp_path: Path) -> Path:
    path = tmp_path / "grpo-8b.yaml"
    path.write_text(yaml.safe_dump(GRPO_8B))
    return path


def test_8b_grpo_plans_with_offload_and_prints_it(config: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "app", "plan", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert "host optimizer GiB" in done.stdout and "infeasible" not in done.stdout
    assert "optimizer offload: actor 4/8 of the optimizer state in pinned host memory" in done.stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "app", "plan", str(config), "--json"], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=240, check=False).stdout)
    assert data["optimizer_offload"] == {"actor": 0.5} and data["models"][0]["offload_s"] > 0


def test_pinned_offload_and_its_errors(config: Path) -> None:
    pinned = plan_experiment(load_config(config, ["plan.optimizer_offload={actor: 0.75}"]))
    assert pinned.result.plan.optimizer_offload == (("actor", 0.75),)
    with pytest.raises(ConfigError, match=r"plan.optimizer_offload.critic=0.5: not a trained role; allowed: a role "
                                          r"grpo trains: actor"):
        build_problem(load_config(config, ["plan.optimizer_offload={critic: 0.5}"]))
    with pytest.raises(ConfigError, match=r"plan.optimizer_offload.actor=1.5: not allowed; allowed: less than or "):
        load_config(config, ["plan.optimizer_offload={actor: 1.5}"])
    # Offload switched off: the cluster is too small, before any search.
    with pytest.raises(ConfigError, match=r"cluster='1x1 h200-141g': too small for the models.*135 GiB"):
        build_problem(load_config(config, ["plan.optimizer_offload={actor: 0}"]))
    # Too little offload fixed: no feasible plan, named.
    with pytest.raises(ConfigError, match=r"no feasible plan.*actor_train needs an estimated"):
        plan_experiment(load_config(config, ["plan.optimizer_offload={actor: 0.25}"]))


def test_manual_plan_gets_the_least_offload(config: Path) -> None:
    overrides = ["plan.mode=manual"] + [f"plan.manual.{c}={{mesh: n0, layout: dp1tp1pp1}}"
                                        for c in ("actor_gen", "rew_inf", "ref_inf", "actor_train")]
    outcome = plan_experiment(load_config(config, overrides))
    assert outcome.result.plan.optimizer_offload == (("actor", 0.5),)
    assert outcome.report.models[0].optimizer_host_gib > 0


def test_profile_host_link_is_cuda_only_and_reads_host_ram() -> None:
    from app.cli.host_link import host_ram_bytes, measure_host_link

    assert measure_host_link("cpu", quick=True, warmup=1, reps=1) is None  # host and "device" are one RAM
    assert 2**30 < host_ram_bytes() < 2**50
