"""Plans that say how each call runs: CallExecution values, the level the search and simulator
record, pricing a given execution, the memory margin and the priced logprob recompute."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planning.algorithm_graphs import grpo_graph, ppo_graph
from planning.call_levels import MAX_INFERENCE_MICRO_TOKENS, MAX_MICRO_TOKENS, split_of
from planning.cost import PlanningProblem, call_cost, call_cost_levels, rlhf_problem
from planning.dataflow import BatchShape
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import model_preset
from planning.plan import CallExecution, ExecutionPlan, Placement
from planning.search import search_plan
from planning.simulate import complete_plan, simulate

pytestmark = pytest.mark.unit

ONE = Placement(Mesh(0, 1, 1), Layout())


def why_problem(margin: float = 0.0) -> PlanningProblem:
    """The issue's GRPO shape on one H200: 64 prompts x 8 samples, 128 + 512 tokens, 1B models."""
    graph = grpo_graph(BatchShape(64, 128, 512), 8, 1)
    problem = rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset("llama3.2-1b"))
    return replace(problem, memory_margin=margin)


def test_call_execution_values() -> None:
    budget, rounds = CallExecution(micro_batch_tokens=4096), CallExecution(gen_rounds=2)
    assert budget.describe() == "<=4096 tok/mb" and rounds.describe() == "2 rounds"
    assert budget.as_dict() == {"micro_batch_tokens": 4096} and rounds.as_dict() == {"gen_rounds": 2}
    for bad in ({}, {"micro_batch_tokens": 8, "gen_rounds": 1}, {"micro_batch_tokens": 0}, {"gen_rounds": True}):
        with pytest.raises(ValueError, match="CallExecution"):
            CallExecution(**bad)
    plan = ExecutionPlan((("a", ONE), ("b", ONE))).with_executions({"b": rounds})
    assert plan.execution("a") is None and plan.execution("b") == rounds
    assert hash(plan) != hash(plan.without_executions()) and plan.without_executions() == ExecutionPlan(plan.placements)
    with pytest.raises(ValueError, match="not in the plan"):
        plan.with_executions({"c": rounds})


def test_search_records_each_calls_level_and_simulate_prices_it() -> None:
    problem = why_problem()
    result = search_plan(problem, seconds=1.0, max_steps=300)
    plan = result.plan
    for mfc in problem.graph.mfcs:
        execution = plan.execution(mfc.name)
        assert execution is not None and (execution.gen_rounds is not None) == (mfc.kind == "generate")
    # The simulator with the executions pinned, and the one choosing them, agree.
    assert simulate(problem, plan).iteration_s == pytest.approx(result.est_iteration_s)
    assert simulate(problem, plan.without_executions()).iteration_s == pytest.approx(result.est_iteration_s)
    assert complete_plan(problem, plan.without_executions()) == plan
    # The run: 512 sequences x 640 tokens would be one 327k-token micro-batch at pp=1.
    train = plan.execution("actor_train")
    assert train is not None and train.micro_batch_tokens is not None and train.micro_batch_tokens <= MAX_MICRO_TOKENS
    # Inference keeps no activations for a backward: its micro-batches may be larger (fewer
    # launches per token for the host to issue), up to their own cap, as memory allows.
    ref = plan.execution("ref_inf")
    assert ref is not None and ref.micro_batch_tokens is not None
    assert MAX_MICRO_TOKENS < ref.micro_batch_tokens <= MAX_INFERENCE_MICRO_TOKENS


def test_a_given_execution_is_priced_exactly() -> None:
    problem = why_problem()
    mfc, place = problem.graph.mfc("ref_inf"), ONE
    for level in call_cost_levels(problem, mfc, place):
        assert level.execution is not None
        again = call_cost(problem, mfc, place, execution=level.execution)
        assert again.time_s == pytest.approx(level.time_s) and again.mem_bytes == pytest.approx(level.mem_bytes)
        seqs = mfc.batch.n_seqs
        assert split_of(mfc, seqs, level.execution) == level.breakdown["micro_batches"]
    # Smaller micro-batches: less memory (logits and activations of fewer tokens), never faster.
    small = call_cost(problem, mfc, place, execution=CallExecution(micro_batch_tokens=2048))
    large = call_cost(problem, mfc, place, execution=CallExecution(micro_batch_tokens=16384))
    assert small.mem_bytes < large.mem_bytes and small.time_s >= large.time_s
    rounds = [call_cost(problem, problem.graph.mfc("actor_gen"), place, execution=CallExecution(gen_rounds=r))
              for r in (1, 4)]
    assert rounds[1].breakdown["kv_cache_bytes"] == pytest.approx(rounds[0].breakdown["kv_cache_bytes"] / 4)
    with pytest.raises(ValueError, match="takes micro_batch_tokens"):
        call_cost(problem, mfc, place, execution=CallExecution(gen_rounds=2))


def test_memory_margin_and_scale_shrink_what_fits() -> None:
    problem = why_problem()
    mfc = problem.graph.mfc("actor_train")
    roomy = call_cost(problem, mfc, ONE)
    tight = why_problem(margin=0.7)
    assert tight.mem_limit_bytes == pytest.approx(0.3 * problem.cluster.hardware.mem_bytes)
    squeezed = call_cost(tight, mfc, ONE)
    assert squeezed.mem_bytes <= tight.mem_limit_bytes < roomy.mem_bytes  # a leaner level is chosen
    doubled = replace(problem, memory_scale=2.0)
    level = CallExecution(micro_batch_tokens=8192)
    one, two = (call_cost(p, mfc, ONE, execution=level) for p in (problem, doubled))
    assert two.breakdown["activation_bytes"] == pytest.approx(2 * one.breakdown["activation_bytes"])
    assert two.breakdown["weights_bytes"] == one.breakdown["weights_bytes"]
    with pytest.raises(ValueError, match="memory_margin"):
        why_problem(margin=1.0)
    # A plan that does not fit names the call, its estimate and what is usable.
    crowded = ExecutionPlan(tuple((m.name, ONE) for m in problem.graph.mfcs))
    reason = simulate(why_problem(margin=0.9), crowded).reason
    assert "call " in reason and "GiB per GPU of" in reason and "90% kept free" in reason


def test_actor_train_prices_the_logprob_recompute() -> None:
    # PPO recomputes in its own actor_inf call; the outcome algorithms inside actor_train, and only
    # with more than one optimizer step (with one, the training forward's logprobs serve).
    ppo = ppo_graph(BatchShape(64, 128, 256), 4)
    assert ppo.mfc("actor_inf").kind == "inference"
    assert not ppo.mfc("actor_train").recompute_forward and not ppo.mfc("critic_train").recompute_forward
    graph = grpo_graph(BatchShape(8, 128, 256), 8, 4)
    assert graph.mfc("actor_train").recompute_forward
    assert not grpo_graph(BatchShape(8, 128, 256), 8, 1).mfc("actor_train").recompute_forward
    problem = rlhf_problem(graph, ClusterSpec(1, 1, hardware_preset("h200-141g")), model_preset("llama3.2-1b"))
    actor = call_cost(problem, graph.mfc("actor_train"), ONE)
    plain = call_cost(problem, replace(graph.mfc("actor_train"), recompute_forward=False), ONE,
                      execution=actor.execution)
    ref = call_cost(problem, graph.mfc("ref_inf"), ONE, execution=actor.execution)
    assert actor.breakdown["recompute_s"] == pytest.approx(ref.time_s, rel=0.05)  # one forward of the batch
    assert actor.time_s == pytest.approx(plain.time_s + actor.breakdown["recompute_s"])
    assert math.isfinite(actor.time_s)
