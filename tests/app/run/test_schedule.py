"""Unit tests of the driver's pure parts: the ops of an iteration, data routing, metrics from
timelines, the run directory and the PPO call parameters (checkpoints: test_checkpoint.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.cli.train import DEFAULT_CONFIG, resolve_run_dir, summary
from app.config.experiment import load_config
from app.config.problem import build_problem, manual_plan
from app.reporting.timeline import (
    TimelineRecord,
    realloc_metrics,
    rollout_metrics,
    throughput,
    timing_metrics,
)
from app.run.schedule import (
    CallOp,
    ReallocOp,
    ReleaseOp,
    data_owners,
    dp_rows,
    home_placements,
    iteration_ops,
    realloc_member_sets,
    shards_needed,
)
from planning.layout import Layout, Mesh
from planning.plan import Placement

pytestmark = pytest.mark.unit


def tiny_plan():
    cfg = load_config(DEFAULT_CONFIG)
    problem = build_problem(cfg)
    return cfg, problem, manual_plan(cfg, problem)


def placement(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, 4), Layout.parse(layout))


def test_iteration_ops_reallocate_before_generation_and_release_after() -> None:
    _, problem, plan = tiny_plan()
    roles = ("actor", "critic", "ref")  # the rule-based reward holds no model
    location = home_placements(problem.graph, plan, roles)
    assert location["actor"] == plan["actor_train"] and location["ref"] == plan["ref_inf"]
    ops, after = iteration_ops(problem.graph, plan, roles, location)
    kinds = [(type(op).__name__, getattr(op, "role", None) or op.mfc.name) for op in ops]
    assert kinds[0] == ("ReallocOp", "actor")  # train tp2 -> gen dp2 on GPUs 0-1
    assert kinds[1] == ("CallOp", "actor_gen")
    assert kinds[2] == ("ReleaseOp", "actor")  # the generation copy is not used again before training
    assert [op.mfc.name for op in ops if isinstance(op, CallOp)] == [m.name for m in problem.graph.mfcs]
    realloc = ops[0]
    assert isinstance(realloc, ReallocOp) and realloc.src == plan["actor_train"] and realloc.dst == plan["actor_gen"]
    assert realloc.ranks == (0, 1)
    assert after == location  # a steady state: the next iteration repeats the same ops
    assert iteration_ops(problem.graph, plan, roles, after)[0] == ops


def test_frozen_role_moves_with_its_calls_and_needs_no_release() -> None:
    _, problem, plan = tiny_plan()
    moved = dict(plan.as_dict())
    moved["ref_inf"] = placement(2, 2, "dp2")  # the ref's only call: it is loaded there
    from planning.plan import ExecutionPlan

    plan2 = ExecutionPlan.from_dict(moved)
    location = home_placements(problem.graph, plan2, ("actor", "critic", "ref"))
    ops, _ = iteration_ops(problem.graph, plan2, ("actor", "critic", "ref"), location)
    assert not any(isinstance(op, (ReallocOp, ReleaseOp)) and op.role == "ref" for op in ops)
    sets = realloc_member_sets(problem.graph, plan2, ("actor", "critic", "ref"))
    assert [(s.mesh.start, d.mesh.start, role) for s, d, role in sets] == [(0, 0, "actor")]


def test_data_owners_are_tp0_of_the_last_stage_with_contiguous_rows() -> None:
    owners = data_owners(placement(0, 4, "dp2tp1pp2"), 10)
    assert [(o.dp_rank, o.rank, o.row_lo, o.row_hi) for o in owners] == [(0, 2, 0, 5), (1, 3, 5, 10)]
    owners = data_owners(placement(0, 4, "dp1tp2pp2"), 7)
    assert [(o.rank, o.row_lo, o.row_hi) for o in owners] == [(2, 0, 7)]
    assert dp_rows(10, 3, 2) == (6, 10)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_rows(10, 2, 2)


def test_shards_needed_all_rows_or_the_overlapping_ones() -> None:
    producer = placement(0, 4, "dp4")
    consumer = placement(0, 2, "dp2")
    every = shards_needed(consumer, 1, producer, 16, all_rows=True)
    assert [o.rank for o in every] == [0, 1, 2, 3]
    mine = shards_needed(consumer, 1, producer, 16, all_rows=False)  # rows 8..15 (+1 margin)
    assert [o.rank for o in mine] == [1, 2, 3]
    with pytest.raises(ValueError, match="not in the consumer mesh"):
        shards_needed(consumer, 3, producer, 16, all_rows=True)


def test_timing_metrics_span_ranks_and_count_overlap() -> None:
    records = [
        TimelineRecord(1, "actor_gen", "call", 0, 10.0, 12.0), TimelineRecord(1, "actor_gen", "call", 1, 10.5, 12.5),
        TimelineRecord(1, "actor_gen", "realloc", 0, 9.0, 10.0), TimelineRecord(1, "critic_inf", "call", 2, 12.0, 13.0),
    ]
    metrics = timing_metrics(records, previous_end=8.0)
    assert metrics["timing_s/actor_gen"] == pytest.approx(2.5)
    assert metrics["timing_s/critic_inf"] == pytest.approx(1.0)
    assert metrics["timing_s/realloc"] == pytest.approx(1.0)
    assert metrics["timing_s/iteration"] == pytest.approx(5.0)
    assert timing_metrics(records, None)["timing_s/iteration"] == pytest.approx(4.0)


def test_realloc_metrics_sum_traffic_over_ranks_and_split_pulled_bytes() -> None:
    metas = [
        {"bytes_received": 2e9, "local_bytes": 1e9, "pulled": True},
        {"bytes_received": 1e9, "local_bytes": 0, "pulled": False},
        None,  # a rank outside both meshes reports nothing
        {"bytes_received": 0, "local_bytes": 5e8, "pulled": False},
    ]
    m = realloc_metrics(metas)
    assert m == {"realloc/received_gb": pytest.approx(3.0), "realloc/pulled_gb": pytest.approx(2.0),
                 "realloc/local_gb": pytest.approx(1.5)}
    assert realloc_metrics([]) == {"realloc/received_gb": 0.0, "realloc/pulled_gb": 0.0, "realloc/local_gb": 0.0}


def test_rollout_metrics_use_owners_and_average_named_scalars() -> None:
    metas = {
        "actor_gen": [{"owner": True, "response_lengths": [2, 4]}, {"owner": False, "response_lengths": [2, 4]}],
        "rew_inf": [{"owner": True, "rewards": [1.0, 0.0]}, {"owner": True, "rewards": [0.5, 0.5]}],
        "actor_train": [{"actor/pg_loss": 1.0, "stats": {"actor/kl": 0.2}}, {"actor/pg_loss": 3.0, "stats": {"actor/kl": 0.2}}],
    }
    kinds = {"actor_gen": "generate", "rew_inf": "inference", "actor_train": "train"}
    m = rollout_metrics(metas, kinds)
    assert m["rollout/response_length_mean"] == 3.0 and m["rollout/reward_mean"] == 0.5
    assert m["actor/pg_loss"] == 2.0 and m["actor/kl"] == pytest.approx(0.2)
    assert throughput(10, {**m, "timing_s/iteration": 2.0}, 2, 4) == pytest.approx((10 + 6) / 2 / 4)
    assert math.isnan(throughput(10, m, 2, 4))


def test_run_dir_default_and_summary(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT_CONFIG, ["run.name=my run"])
    assert resolve_run_dir(cfg, now=0.0).parent == Path("runs")
    assert resolve_run_dir(cfg, now=0.0).name.startswith("my_run-")
    cfg = load_config(DEFAULT_CONFIG, [f"run.dir={tmp_path / 'x'}"])
    assert resolve_run_dir(cfg) == tmp_path / "x"
    text = summary([{"rollout/reward_mean": 0.1}, {"rollout/reward_mean": 0.3}], tmp_path)
    assert "first 2 0.200" in text and str(tmp_path) in text


def test_preflight_builds_the_algorithm_settings_from_the_config() -> None:
    from app.algorithms import call_params
    from app.run.runtime import preflight

    cfg = load_config(DEFAULT_CONFIG, ["sampling.temperature=0", "ppo.clip_eps=0.3", "batch.ppo_epochs=2"])
    inputs = preflight(cfg)
    graph = inputs.problem.graph
    gen = call_params(inputs.settings, graph.mfc("actor_gen"), 0.1)
    assert gen["max_new_tokens"] == cfg.batch.gen_len and gen["temperature"] == 0.0
    assert gen["tokenizer"] == "app.data.toy_task:CharTokenizer" and gen["eos_token_id"] == 2
    assert call_params(inputs.settings, graph.mfc("rew_inf"), 0.1)["reward_fn"] == "app.data.rewards:toy_reward"
    assert call_params(inputs.settings, graph.mfc("ref_inf"), 0.1)["temperature"] == 1.0  # greedy: T=1 logprobs
    train = call_params(inputs.settings, graph.mfc("actor_train"), 0.1)
    assert train["clip_eps"] == 0.3 and train["ppo_epochs"] == 2 and train["kl_coef"] == 0.1
    assert set(inputs.models) == {"actor", "critic", "ref"}  # the rule-based reward holds no model
