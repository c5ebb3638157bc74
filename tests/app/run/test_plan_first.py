"""The plan comes before Ray: a config without a feasible plan fails in seconds, naming the call,
and a one-plan space is not searched for the whole budget (issue 23)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import build_problem, load_config
from planning.search import search_plan

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]

# GRPO on a 1.5B model with 32k-token sequences on one 80 GB GPU: the cluster holds the weights and
# optimizer states (the config check passes), but one sequence's training activations do not fit.
INFEASIBLE = """\
algorithm: grpo
models:
  actor: {preset: qwen2.5-1.5b}
batch: {prompts: 64, prompt_len: 4096, gen_len: 28000, ppo_minibatches: 1, group_size: 8}
cluster: {nodes: 1, gpus_per_node: 1, gpu: a100-80g, virtual_gpus: true}
plan: {mode: search, seconds: 30, seed: 0}
tracking: {wandb: false}
"""


def test_one_gpu_search_returns_at_once() -> None:
    """A 1x1 cluster has one plan: the search returns in well under a second with a 30 s budget."""
    cfg = load_config(REPO / "examples" / "grpo-tiny.yaml",
                      ["cluster.gpus_per_node=1", "plan.mode=search", "plan.seconds=30"])
    started = time.perf_counter()
    result = search_plan(build_problem(cfg), mode="search", seconds=30.0, seed=0)
    assert time.perf_counter() - started < 1.0
    assert result.evaluated_plans == 1
    assert result.search_s < 1.0


def test_small_space_is_enumerated_not_sampled() -> None:
    """Four GPUs and the tiny GRPO graph: a few hundred plans, all seen, far inside the budget,
    and the answer is the exhaustive optimum."""
    cfg = load_config(REPO / "examples" / "grpo-tiny.yaml", ["cluster.gpus_per_node=4"])
    problem = build_problem(cfg)
    started = time.perf_counter()
    searched = search_plan(problem, mode="search", seconds=30.0, seed=0)
    assert time.perf_counter() - started < 5.0
    exhaustive = search_plan(problem, mode="exhaustive", seconds=30.0, seed=0)
    assert searched.est_iteration_s == pytest.approx(exhaustive.est_iteration_s)


def _ray_session() -> str | None:
    latest = Path("/tmp/ray/session_latest")
    return os.readlink(latest) if latest.is_symlink() else None


def test_infeasible_train_exits_2_before_ray(tmp_path: Path) -> None:
    config = tmp_path / "infeasible.yaml"
    config.write_text(INFEASIBLE)
    session_before = _ray_session()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "app", "train", str(config), f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert "actor_train" in lines[0] or "actor_gen" in lines[0], lines[0]
    assert elapsed < 15.0
    assert _ray_session() == session_before, "a Ray instance was started"
    assert not (tmp_path / "run").exists()
