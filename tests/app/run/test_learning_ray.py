"""The learning check of every algorithm, and bounded staleness end to end, on the shared local Ray
(2 CPUs, 4 virtual GPUs) with the real workers.

* each examples/<algorithm>-tiny.yaml runs as `python -m app train` would, and the mean reward of
  its last 5 iterations must exceed its first 5 by MARGIN (PPO's own check is in
  test_driver_ray.py). Measured on the 2-core dev machine, shared with other jobs (2026-12-01), 15
  iterations each: see README.md "Algorithms" for the figures; each run ends with an HF export
  of the actor and no critic (none of these algorithms has one);
* grpo-tiny with FP8 rollouts (sampling.fp8, sampling.kv_cache_dtype fp8, emulated on CPU):
  the importance weights it turns on stay near 1 and the reward rises as without;
* examples/ppo-async-tiny.yaml (run.max_staleness 1, generation alone on GPUs 0-1): in
  timeline.jsonl the generation of iteration i + 1 runs while iteration i trains on GPUs 2-3; the
  metrics log staleness 1 and the importance weights used; the reward rises.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import load_config
from app.reporting.timeline import TimelineRecord, read_records, span
from app.reporting.tracking import read_metrics
from app.run.checkpoint import latest_checkpoint
from app.run.driver import Driver
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "remax")
MARGIN = 0.08  # every algorithm measured at least twice this (README.md)


def run_example(name: str, run_dir: Path, *overrides: str) -> list[dict[str, float]]:
    cfg = load_config(EXAMPLES / f"{name}.yaml", [f"run.dir={run_dir}", "tracking.console=false", *overrides])
    Driver(cfg, run_dir).run()
    return read_metrics(run_dir)


def rise(metrics: list[dict[str, float]]) -> tuple[float, float]:
    rewards = [m["rollout/reward_mean"] for m in metrics]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_learns_the_toy_task(ray_session: None, tmp_path: Path, algorithm: str) -> None:  # noqa: F811
    metrics = run_example(f"{algorithm}-tiny", tmp_path, "checkpoint.at_end=true")
    # The run's end exports the trained actor as an HF model; none of these algorithms has a critic.
    final = latest_checkpoint(tmp_path)
    assert final is not None and final.name == f"iter_{len(metrics)}"
    assert (final / "actor" / "config.json").is_file() and not (final / "critic").exists()
    assert all(m["actor/pg_loss"] == m["actor/pg_loss"] for m in metrics)  # no NaN
    first, last = rise(metrics)
    print(f"{algorithm}: first 5 {first:.3f}, last 5 {last:.3f}")
    assert last > first + MARGIN, f"{algorithm}: reward did not climb: first 5 {first:.3f}, last 5 {last:.3f}"
    if algorithm == "dapo":
        assert all(1 <= m["dynamic_sampling/rounds"] <= 3 for m in metrics)
        assert all(0.0 <= m["dynamic_sampling/kept_fraction"] <= 1.0 for m in metrics)
        assert any(m["dynamic_sampling/rounds"] > 1 for m in metrics)  # early groups are often all 0


def train_stage(records: list[TimelineRecord], iteration: int) -> list[TimelineRecord]:
    return [r for r in records if r.kind == "call" and r.iteration == iteration and r.name != "actor_gen"]


def test_grpo_learns_with_fp8_rollouts(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    metrics = run_example("grpo-tiny", tmp_path, "sampling.fp8=true", "sampling.kv_cache_dtype=fp8")
    # rollout_is auto is on: the weights correct the FP8 rollout against the bf16 trainer.
    assert all(0.8 < m["actor/rollout_is_mean"] < 1.2 and m["actor/rollout_is_truncated"] < 0.05 for m in metrics)
    first, last = rise(metrics)
    print(f"grpo with FP8 rollouts: first 5 {first:.3f}, last 5 {last:.3f}")
    assert last > first + MARGIN


def test_async_ppo_generates_the_next_batch_while_training(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    metrics = run_example("ppo-async-tiny", tmp_path)
    records = read_records(tmp_path / "timeline.jsonl")
    gens = {i: [r for r in records if r.name == "actor_gen" and r.iteration == i and r.kind == "call"]
            for i in range(len(metrics))}
    assert all({r.rank for r in gens[i]} == {0, 1} for i in gens)
    assert all({r.rank for r in train_stage(records, i)} == {2, 3} for i in gens)
    # Generation of i + 1 overlaps the training stage of i on the other GPUs (k = 0 would start it
    # after that stage ends: the reallocation that brings the weights waits for it).
    overlaps = []
    for i in range(len(metrics) - 1):
        (g0, g1), (t0, t1) = span(gens[i + 1]), span(train_stage(records, i))
        overlaps.append(min(g1, t1) - max(g0, t0))
    assert sum(o > 0 for o in overlaps) >= len(overlaps) // 2, overlaps
    assert [m["rollout/staleness"] for m in metrics] == [0.0] + [1.0] * (len(metrics) - 1)
    assert [m["rollout/weights_version"] for m in metrics][:4] == [-1.0, -1.0, 0.0, 1.0]
    assert all(0.0 < m["actor/rollout_is_mean"] <= 2.0 and 0.0 <= m["actor/rollout_is_truncated"] <= 1.0
               for m in metrics)
    first, last = rise(metrics)
    print(f"ppo max_staleness 1: first 5 {first:.3f}, last 5 {last:.3f}")
    assert last > first + MARGIN
