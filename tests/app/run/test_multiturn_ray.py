"""Multi-turn GRPO end to end on the shared local Ray (virtual GPUs, real workers): the built-in
hidden-digit game, whose reward cannot be earned without reading the observation, is learned;
the trajectories the train call saw are the sampled ids plus the observation ids, masked; an
environment that raises, hangs or returns garbage ends only its trajectory, counted (with
bounded staleness on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import load_config
from app.reporting.tracking import read_metrics
from app.run.driver import Driver
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FAULTY_ENV = '''
import time


class Faulty:
    """Row behaviour by the sample's index within its group: 0 plays fair, 1 raises, 2 hangs,
    3 returns a number as observation."""

    def reset(self, sample):
        self.kind = sample["sample_index"] % 4
        return "?"

    def step(self, action):
        if self.kind == 1:
            raise RuntimeError("tool crashed")
        if self.kind == 2:
            time.sleep(3.0)
        if self.kind == 3:
            return 42, 0.0, False, {}
        return "7", 1.0, False, {}
'''


def test_grpo_learns_the_hidden_digit_game(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = load_config(EXAMPLES / "grpo-tool-tiny.yaml", [f"run.dir={tmp_path}", "tracking.console=false"])
    Driver(cfg, tmp_path).run()
    metrics = read_metrics(tmp_path)
    rewards = [m["rollout/reward_mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"hidden digit game: first 5 {first:.3f}, last 5 {last:.3f}")
    # 0.28 is the most a policy that ignores the observations can score (app/envs/builtin.py).
    assert last > max(first + 0.2, 0.33), f"reward did not climb: first 5 {first:.3f}, last 5 {last:.3f}"
    assert all(m["env/turns_mean"] == pytest.approx(4.0) for m in metrics)
    assert all(m["rollout/response_length_mean"] == pytest.approx(4.0) for m in metrics)  # sampled ids only
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in metrics)


def test_faulty_environments_end_only_their_trajectories(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    env_file = tmp_path / "faulty_env.py"
    env_file.write_text(FAULTY_ENV)
    run_dir = tmp_path / "run"
    cfg = load_config(EXAMPLES / "grpo-tool-tiny.yaml", [
        f"run.dir={run_dir}", "tracking.console=false", "run.iterations=2", f"rollout.env={env_file}:Faulty",
        "rollout.env_kwargs={}",
        "rollout.env_timeout_s=0.5", "rollout.max_turns=3", "rollout.env_workers=32", "run.max_staleness=1"])
    Driver(cfg, run_dir).run()
    metrics = read_metrics(run_dir)
    assert len(metrics) == 2
    n_rows = cfg.batch.prompts * cfg.batch.group_size
    for m in metrics:
        assert m["env/errors"] == pytest.approx(2 * n_rows / 4)  # raised, and a non-string observation
        assert m["env/timeouts"] == pytest.approx(n_rows / 4)
    # With max_staleness 1 the second batch was generated from the weights before the first update.
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0]


def test_multi_turn_generation_under_tensor_parallelism(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    """actor_gen at tp2 (environments on tp rank 0, prompts and answers shared with rank 1)."""
    manual = ("{actor_gen: {mesh: 'n0:g0-1', layout: dp1tp2pp1}, actor_train: {mesh: 'n0:g0-1', layout: dp2tp1pp1},"
              " ref_inf: {mesh: 'n0:g0-1', layout: dp2tp1pp1}, rew_inf: {mesh: 'n0:g0-1', layout: dp2tp1pp1}}")
    overrides = [f"run.dir={tmp_path}", "tracking.console=false", "run.iterations=2", "plan.mode=manual",
                 f"plan.manual={manual}"]
    cfg = load_config(EXAMPLES / "grpo-tool-tiny.yaml", overrides)
    Driver(cfg, tmp_path).run()
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 2
    assert all(m["env/turns_mean"] == pytest.approx(4.0) and m["env/errors"] == 0 for m in metrics)
    assert all(m["rollout/response_length_mean"] == pytest.approx(4.0) for m in metrics)
