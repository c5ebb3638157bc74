"""Multi-turn generation in the cost model (planning.cost_multiturn): decode over every turn,
observation prefills, environment waits, the pp = 1 rule, the calls priced at the response
budget, and recalibration taking the measured environment step time and turns."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planning.algorithm_graphs import grpo_graph, ppo_graph, remax_graph
from planning.calibrate import CallMeasurement, calibrate, calibrated_problem, with_measured_rollout
from planning.cost import PlanningProblem, call_cost, call_cost_levels, rlhf_problem
from planning.cost_multiturn import MULTI_TURN_PP_REASON, observation_parts, trajectory
from planning.cost_passes import E4M3_GATHERED_READ_BYTES, kv_read_bytes
from planning.cost_terms import Links, call_geometry
from planning.dataflow import MFC, BatchShape, MultiTurn
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import CallExecution, ExecutionPlan, Placement
from planning.search import search_plan

pytestmark = pytest.mark.unit

BATCH = BatchShape(64, 256, 128)  # prompts; grouped x 4 below
ON_8 = Placement(Mesh(0, 8, 8), Layout(dp=2, tp=4))


def _problem(multi_turn: MultiTurn | None, batch: BatchShape = BATCH, gpus: int = 8) -> PlanningProblem:
    graph = grpo_graph(batch, 4, 1, multi_turn=multi_turn)
    return rlhf_problem(graph, ClusterSpec(1, gpus, hardware_preset("h100-80g")), model_preset("llama-7b"))


def _gen_s(multi_turn: MultiTurn | None, placement: Placement = ON_8, rounds: int = 1) -> float:
    problem = _problem(multi_turn)
    cost = call_cost(problem, problem.graph.mfc("actor_gen"), placement, execution=CallExecution(gen_rounds=rounds))
    assert cost.feasible, cost.reason
    return cost.time_s


def test_multi_turn_validation_and_placement() -> None:
    with pytest.raises(ValueError, match="turns"):
        MultiTurn(0, 8, 0.1)
    with pytest.raises(ValueError, match="obs_tokens"):
        MultiTurn(2, -1, 0.1)
    with pytest.raises(ValueError, match="env_step_s"):
        MultiTurn(2, 8, -0.1)
    with pytest.raises(ValueError, match="env_step_s"):
        MultiTurn(2, 8, math.inf)
    with pytest.raises(ValueError, match="response_tokens"):
        MultiTurn(2, 8, 0.1, response_tokens=0)
    with pytest.raises(ValueError, match="multi_turn is for generate calls"):
        MFC("x", "actor", "inference", (), ("y",), BATCH, multi_turn=MultiTurn(2, 8, 0.1))
    assert MultiTurn(3, 32, 0.0).budget(128) == 3 * (128 + 32)
    assert MultiTurn(3, 32, 0.0, response_tokens=300).budget(128) == 300


def test_builders_attach_multi_turn_to_generation_and_the_budget_to_the_rest() -> None:
    turns = MultiTurn(3, 32, 0.05)
    budget = turns.budget(BATCH.gen_len)
    for graph in (ppo_graph(BATCH, multi_turn=turns), grpo_graph(BATCH, 4, multi_turn=turns),
                  remax_graph(BATCH, multi_turn=turns)):
        for m in graph.mfcs:
            if m.kind == "generate":
                assert m.multi_turn == turns and m.batch.gen_len == BATCH.gen_len
            else:
                assert m.multi_turn is None and m.batch.gen_len == budget and m.batch.prompt_len == BATCH.prompt_len
    # Without multi_turn the graphs are what they were.
    assert ppo_graph(BATCH) == ppo_graph(BATCH, multi_turn=None)


def test_multi_turn_costs_more_and_grows_with_turns_and_env_time() -> None:
    single = _gen_s(None)
    two = _gen_s(MultiTurn(2, 32, 0.05))
    assert two > single
    assert _gen_s(MultiTurn(4, 32, 0.05)) > two
    assert _gen_s(MultiTurn(2, 32, 0.5)) > two
    # The environment's wait is its own part: turns x env_step_s per round.
    problem = _problem(MultiTurn(3, 32, 0.25))
    for rounds in (1, 2):
        cost = call_cost(problem, problem.graph.mfc("actor_gen"), ON_8, execution=CallExecution(gen_rounds=rounds))
        assert cost.breakdown["env_wait_s"] == pytest.approx(rounds * 3 * 0.25)
        assert cost.breakdown["obs_prefill_s"] > 0
        assert cost.time_s == pytest.approx(sum(v for k, v in cost.breakdown.items() if k.endswith("_s")))


def test_an_fp8_cache_makes_the_observation_prefill_gather_and_widen_its_history() -> None:
    """The observation prefill runs the bf16 weights and reads a bf16 cache in place; an e4m3
    cache it gathers token-major and widens first (E4M3_GATHERED_READ_BYTES per value against 2):
    only that read moves."""
    problem = _problem(MultiTurn(3, 32, 0.0), batch=BatchShape(64, 256, 128))
    gen = problem.graph.mfc("actor_gen")
    geo = call_geometry(problem.models["actor"].spec, False, ON_8.layout)
    links = Links(problem.cluster.hardware, problem.efficiency, ON_8)
    traj = trajectory(gen.batch, gen.multi_turn)
    seqs = 256
    bf16, fp8 = (observation_parts(geo, ON_8.layout, links, seqs, traj, b)["obs_prefill_s"]
                 for b in (2.0, E4M3_GATHERED_READ_BYTES))
    values = seqs * traj.ctx * geo.kv_bytes_per_token_layer * geo.stage_layers / 2  # cached values read
    assert fp8 - bf16 == pytest.approx(traj.turns * values * (E4M3_GATHERED_READ_BYTES - 2) / links.hbm)
    assert kv_read_bytes(True, problem.cluster.hardware, observation=True) == E4M3_GATHERED_READ_BYTES
    cached = [call_cost(problem, replace(gen, fp8_kv_cache=f), ON_8, execution=CallExecution(gen_rounds=1))
              for f in (False, True)]
    assert cached[1].breakdown["obs_prefill_s"] > cached[0].breakdown["obs_prefill_s"]
    assert cached[1].breakdown["kv_cache_bytes"] == pytest.approx(cached[0].breakdown["kv_cache_bytes"] / 2)


def test_decode_over_every_turn_and_the_whole_trajectory_in_the_cache() -> None:
    turns = MultiTurn(4, 32, 0.0)
    traj = trajectory(BATCH, turns)
    budget = 4 * (128 + 32)
    assert traj.decode_steps == 4 * 128 and traj.kv_slots == 256 + budget + 1
    assert traj.ctx == 256 + budget / 2
    # A budget tighter than the turns scales sampled and observed tokens alike to fit it.
    tight = trajectory(BATCH, replace(turns, response_tokens=budget // 2))
    assert tight.decode_steps == pytest.approx(2 * 128) and tight.obs_tokens == pytest.approx(16)
    assert tight.kv_slots == 256 + budget // 2 + 1
    # KV cache bytes: prompt_len + budget + 1 slots per sequence.
    problem = _problem(turns)
    geo = call_geometry(model_preset("llama-7b"), False, ON_8.layout)
    assert not isinstance(geo, str)
    cost = call_cost(problem, problem.graph.mfc("actor_gen"), ON_8, execution=CallExecution(gen_rounds=1))
    per_seq = (256 + budget + 1) * geo.kv_bytes_per_token_layer * geo.stage_layers
    assert cost.breakdown["kv_cache_bytes"] == pytest.approx(64 * 4 / 2 * per_seq)


def test_one_turn_without_observations_or_environment_is_single_turn() -> None:
    trivial = MultiTurn(1, 0, 0.0)
    for placement in (ON_8, Placement(Mesh(0, 1, 8), Layout()), Placement(Mesh(0, 4, 8), Layout(dp=4))):
        for rounds in (1, 4):
            one, multi = _problem(None), _problem(trivial)
            execution = CallExecution(gen_rounds=rounds)
            a = call_cost(one, one.graph.mfc("actor_gen"), placement, execution=execution)
            b = call_cost(multi, multi.graph.mfc("actor_gen"), placement, execution=execution)
            assert b.time_s == a.time_s
            assert {k: v for k, v in b.breakdown.items() if k.endswith("_s") and k != "env_wait_s"} == \
                   {k: v for k, v in a.breakdown.items() if k.endswith("_s")}
            assert b.breakdown["env_wait_s"] == 0.0 and "obs_prefill_s" not in b.breakdown
            # The multi-turn cache holds one slot more per sequence; nothing else differs.
            geo = call_geometry(model_preset("llama-7b"), False, placement.layout)
            assert not isinstance(geo, str)
            per_round = math.ceil(64 * 4 / placement.layout.dp / rounds)
            slot = per_round * geo.kv_bytes_per_token_layer * geo.stage_layers
            assert b.breakdown["kv_cache_bytes"] - a.breakdown["kv_cache_bytes"] == pytest.approx(slot)


def test_pp_above_one_is_infeasible_with_the_reason_tp_and_dp_are_fine() -> None:
    problem = _problem(MultiTurn(2, 32, 0.05))
    gen = problem.graph.mfc("actor_gen")
    for layout in (Layout(dp=1, tp=4, pp=2), Layout(dp=4, pp=2), Layout(pp=8)):
        levels = call_cost_levels(problem, gen, Placement(Mesh(0, 8, 8), layout))
        assert len(levels) == 1 and not levels[0].feasible and math.isinf(levels[0].time_s)
        assert levels[0].reason == MULTI_TURN_PP_REASON and "multi-turn generation runs at pp=1" in levels[0].reason
    for layout in (Layout(dp=8), Layout(dp=2, tp=4), Layout(tp=8)):
        assert call_cost(problem, gen, Placement(Mesh(0, 8, 8), layout)).feasible
    # Single-turn generation and the other calls still may pipeline.
    pp = Placement(Mesh(0, 8, 8), Layout(dp=4, pp=2))
    assert call_cost(problem, problem.graph.mfc("actor_train"), pp).feasible
    assert call_cost(_problem(None), _problem(None).graph.mfc("actor_gen"), pp).feasible


def test_manual_plan_with_pipelined_multi_turn_generation_fails_naming_the_rule() -> None:
    problem = _problem(MultiTurn(2, 32, 0.05))
    pp = Placement(Mesh(0, 8, 8), Layout(dp=4, pp=2))
    plan = ExecutionPlan(tuple((m.name, pp if m.kind == "generate" else ON_8) for m in problem.graph.mfcs))
    with pytest.raises(ValueError, match=r"manual plan is infeasible: actor_gen: multi-turn generation runs at pp=1"):
        search_plan(problem, "manual", manual=plan)
    # The search never picks one.
    found = search_plan(problem, "search", seconds=2.0, max_steps=300).plan
    assert found["actor_gen"].layout.pp == 1


def test_inference_and_training_are_priced_at_the_response_budget() -> None:
    turns = MultiTurn(3, 32, 0.05)
    budget = turns.budget(BATCH.gen_len)
    multi = _problem(turns)
    as_long = _problem(None, batch=replace(BATCH, gen_len=budget))
    for name in ("rew_inf", "ref_inf", "actor_train"):
        a = call_cost(multi, multi.graph.mfc(name), ON_8)
        b = call_cost(as_long, as_long.graph.mfc(name), ON_8)
        assert a.time_s == b.time_s and a.mem_bytes == b.mem_bytes
        assert a.time_s > call_cost(_problem(None), _problem(None).graph.mfc(name), ON_8).time_s


def _measured_problem() -> tuple[PlanningProblem, ExecutionPlan]:
    problem = _problem(MultiTurn(4, 32, 0.01), gpus=8)
    plan = ExecutionPlan(tuple((m.name, ON_8) for m in problem.graph.mfcs))
    return problem, plan


def test_calibration_takes_the_measured_environment_step_and_turns() -> None:
    problem, plan = _measured_problem()
    truth = with_measured_rollout(problem, {"actor_gen": CallMeasurement(1.0, env_step_s=0.8, turns=2.5)})
    gen = truth.graph.mfc("actor_gen").multi_turn
    assert gen is not None and gen.env_step_s == 0.8 and gen.turns == 2.5
    # The budget (the cache the engine allocates, the other calls' length) does not follow the turns.
    assert gen.budget(BATCH.gen_len) == 4 * (128 + 32)
    seconds = {m.name: call_cost_levels(truth, m, plan[m.name])[0].time_s for m in truth.graph.mfcs}
    measured = {name: CallMeasurement(s, env_step_s=0.8 if name == "actor_gen" else None,
                                      turns=2.5 if name == "actor_gen" else None) for name, s in seconds.items()}
    result = calibrate(problem, plan, measured, max_turns=4)
    assert result.multi_turn["actor_gen"].env_step_s == 0.8 and result.multi_turn["actor_gen"].turns == 2.5
    assert result.time_errors(after=True)[1] < 0.02  # the environment explains it: no factor has to
    fitted = calibrated_problem(problem, result)
    fitted_gen = fitted.graph.mfc("actor_gen")
    assert fitted_gen.multi_turn == gen
    assert call_cost_levels(fitted, fitted_gen, ON_8)[0].breakdown["env_wait_s"] == pytest.approx(2.5 * 0.8)


def test_measured_turns_stay_within_one_and_max_turns() -> None:
    problem, _ = _measured_problem()
    high = with_measured_rollout(problem, {"actor_gen": CallMeasurement(1.0, turns=9.0)}, max_turns=4)
    low = with_measured_rollout(problem, {"actor_gen": CallMeasurement(1.0, turns=0.4)}, max_turns=4)
    assert high.graph.mfc("actor_gen").multi_turn.turns == 4  # type: ignore[union-attr]
    assert low.graph.mfc("actor_gen").multi_turn.turns == 1.0  # type: ignore[union-attr]
    # Nothing measured, or a single-turn problem: unchanged.
    assert with_measured_rollout(problem, {"actor_gen": CallMeasurement(1.0)}) is problem
    single = _problem(None)
    assert with_measured_rollout(single, {"actor_gen": CallMeasurement(1.0, env_step_s=3.0, turns=2.0)}) is single
    with pytest.raises(ValueError, match="env_step_s"):
        CallMeasurement(1.0, env_step_s=-1.0)
    with pytest.raises(ValueError, match="turns"):
        CallMeasurement(1.0, turns=0.0)
