"""Multi-turn rollouts (rollout.env set) from the config to `python -m app plan`: the planning
problem's shapes, the table and JSON with turns and environment seconds, the pp = 1 rule for a
manual plan, and the re-planner feeding the measured environment step time to the calibration."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from app.config import ConfigError, build_problem, load_config
from app.reporting.report import CallRow
from app.reporting.timeline import TimelineRecord
from app.run.replan import Replanner, rollout_means
from planning.calibrate import calibrate
from planning.dataflow import MultiTurn
from planning.layout import Layout, Mesh
from planning.plan import ExecutionPlan, Placement
from tests.app.cli.test_plan import EXAMPLES, plan_cli

pytestmark = pytest.mark.unit

GRPO_TINY = EXAMPLES / "grpo-tiny.yaml"
# The environment module may not exist: planning never imports it.
ENV = ["rollout.env=app.envs.builtin:HiddenDigitGame", "rollout.max_turns=2"]


def test_the_problem_carries_turns_and_the_response_budget() -> None:
    cfg = load_config(GRPO_TINY, ENV)
    problem = build_problem(cfg)
    # The builder never imports the environment: one naming a module that does not exist plans alike.
    missing = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"env": "no_such_package.envs:Game"})})
    assert build_problem(missing) == problem
    assert "no_such_package" not in sys.modules
    budget = cfg.rollout.response_budget(cfg.batch.gen_len)
    assert budget == 2 * (8 + 64)
    gen = problem.graph.mfc("actor_gen")
    assert gen.multi_turn == MultiTurn(turns=2, obs_tokens=64, env_step_s=0.01, response_tokens=budget)
    assert gen.batch.gen_len == 8 and gen.batch.prompt_len == 16
    for m in problem.graph.mfcs:
        if m.kind != "generate":
            assert m.multi_turn is None and m.batch.gen_len == budget and m.batch.prompt_len == 16
    # Single-turn: the problem of before, no multi-turn anywhere.
    single = build_problem(load_config(GRPO_TINY, []))
    assert all(m.multi_turn is None and m.batch.gen_len == 8 for m in single.graph.mfcs)
    capped = build_problem(load_config(GRPO_TINY, [*ENV, "rollout.max_response_tokens=40", "rollout.env_step_s=0.5"]))
    assert capped.graph.mfc("actor_train").batch.gen_len == 40
    assert capped.graph.mfc("actor_gen").multi_turn.env_step_s == 0.5  # type: ignore[union-attr]


def test_the_response_budget_must_fit_the_model_positions() -> None:
    # tiny: 512 positions; 16 + 8 * (8 + 64) = 592 does not fit, though 16 + 8 does.
    with pytest.raises(ConfigError) as info:
        build_problem(load_config(GRPO_TINY, [*ENV, "rollout.max_turns=8"]))
    assert str(info.value).startswith("batch.gen_len=8") and "rollout.max_response_tokens" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_problem(load_config(GRPO_TINY, [*ENV, "rollout.max_response_tokens=600"]))
    assert str(info.value).startswith("rollout.max_response_tokens=600")
    build_problem(load_config(GRPO_TINY, [*ENV, "rollout.max_turns=8", "rollout.max_response_tokens=400"]))


def test_plan_prints_turns_and_environment_seconds(tmp_path: Path) -> None:
    png = tmp_path / "gantt.png"
    done = plan_cli(GRPO_TINY, *ENV, "rollout.env_step_s=0.04", "--gantt", png)
    assert done.returncode == 0, done.stderr
    gen_line = next(line for line in done.stdout.splitlines() if line.startswith("actor_gen"))
    assert "2 turns, env 80.0 ms" in gen_line  # 2 turns x 0.04 s, one round
    assert "infeasible" not in done.stdout
    assert png.stat().st_size > 0
    done = plan_cli(GRPO_TINY, *ENV, "rollout.env_step_s=0.04", "--json")
    assert done.returncode == 0, done.stderr
    calls = {c["name"]: c for c in json.loads(done.stdout)["calls"]}
    assert calls["actor_gen"]["turns"] == 2 and calls["actor_gen"]["env_step_s"] == 0.04
    assert calls["actor_gen"]["env_wait_s"] == pytest.approx(0.08)
    assert all(calls[name]["turns"] is None and calls[name]["env_wait_s"] is None
               for name in ("rew_inf", "ref_inf", "actor_train"))
    single = json.loads(plan_cli(GRPO_TINY, "--json").stdout)
    assert single["calls"][0]["turns"] is None
    assert calls["actor_gen"]["est_time_s"] > single["calls"][0]["est_time_s"]


def test_manual_plan_with_pipelined_multi_turn_generation_is_refused() -> None:
    manual = ["plan.mode=manual", "plan.manual.actor_gen={mesh: n0, layout: dp1pp2}",
              *(f"plan.manual.{name}={{mesh: n0, layout: dp2}}" for name in ("rew_inf", "ref_inf", "actor_train"))]
    done = plan_cli(GRPO_TINY, *ENV, *manual)
    assert done.returncode == 2
    assert "plan.manual=" in done.stderr and "infeasible plan" in done.stderr
    assert "actor_gen: multi-turn generation runs at pp=1" in done.stderr
    assert plan_cli(GRPO_TINY, *manual).returncode == 0  # single-turn generation may pipeline


def test_runs_as_note() -> None:
    row = CallRow("actor_gen", "actor", "generate", "n0", 2, 1, 1, 1.0, 1.0, True, gen_rounds=1, turns=4,
                  env_step_s=0.02, env_wait_s=0.08)
    assert row.runs_as == "1 round, 4 turns, env 80.0 ms"
    assert CallRow("g", "actor", "generate", "n0", 1, 1, 1, 1.0, 1.0, True, gen_rounds=2, turns=2.5,
                   env_wait_s=2.5).runs_as == "2 rounds, 2.50 turns, env 2.50 s"
    assert CallRow("g", "actor", "generate", "n0", 1, 1, 1, 1.0, 1.0, True, gen_rounds=2).runs_as == "2 rounds"


def test_replanner_feeds_measured_environment_steps_to_the_calibration() -> None:
    cfg = load_config(GRPO_TINY, [*ENV, "plan.recalibrate_after=2"])
    problem = build_problem(cfg)
    everywhere = Placement(Mesh(0, 2, 2), Layout(dp=2))
    plan = ExecutionPlan(tuple((m.name, everywhere) for m in problem.graph.mfcs))
    replanner = Replanner(cfg, problem, plan, 1.0)
    for it, (env_s, turns) in enumerate(((9.0, 2.0), (0.2, 1.5), (0.4, 1.5))):
        records = [TimelineRecord(it, m.name, "call", rank, 10.0 * it, 10.0 * it + 1.0)
                   for m in problem.graph.mfcs for rank in (0, 1)]
        metas = {"actor_gen": [{"owner": True, "n": 32, "env_step_s_mean": env_s, "turns_mean": turns},
                               {"owner": True, "n": 32, "env_step_s_mean": env_s, "turns_mean": turns + 0.5}],
                 "rew_inf": [{"owner": True}]}
        replanner.observe(it, records, metas)
    measured = replanner.measured()
    assert measured["actor_gen"].env_step_s == pytest.approx(0.3)  # median after the warm-up iteration
    assert measured["actor_gen"].turns == pytest.approx(1.75)
    assert measured["rew_inf"].env_step_s is None and measured["rew_inf"].turns is None
    # What the re-plan's calibration makes of them (Replanner._start_search, without the search).
    fitted = calibrate(problem, plan, measured, max_turns=cfg.rollout.max_turns).multi_turn["actor_gen"]
    assert fitted.env_step_s == pytest.approx(0.3) and fitted.turns == pytest.approx(1.75)
    # The generation worker's env/* metrics serve where the planner's names are absent.
    assert rollout_means([{"owner": True, "n": 2, "env/step_s_mean": 0.5, "env/turns_mean": 3.0}]) == {
        "env_step_s": 0.5, "turns": 3.0}
    # Metadata without the keys (single-turn, an older worker) measures nothing; non-owners repeat.
    assert rollout_means([{"owner": True, "n": 4}]) == {}
    assert rollout_means([{"owner": True, "n": 1, "turns_mean": 2.0}, {"owner": False, "turns_mean": 9.0},
                          {"owner": True, "n": 3, "turns_mean": 4.0, "env_step_s_mean": math.nan}]) == {"turns": 3.5}
