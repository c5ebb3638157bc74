"""Dataflow graphs: pruning drops the calls whose outputs nobody reads, and only those."""

from __future__ import annotations

import pytest

from planning.algorithm_graphs import dpo_graph, grpo_graph, ppo_graph
from planning.dataflow import MFC, BatchShape, Graph, prune_graph

pytestmark = pytest.mark.unit

BATCH = BatchShape(4, 8, 8)


def names(graph: Graph) -> list[str]:
    return [m.name for m in graph.mfcs]


def test_grpo_without_ref_logprobs_drops_the_reference_call() -> None:
    full = grpo_graph(BATCH, group_size=4)
    pruned = prune_graph(full, ["ref_logprobs"])
    assert names(pruned) == ["actor_gen", "rew_inf", "actor_train"]
    assert "ref_logprobs" not in pruned.mfc("actor_train").input_keys
    assert pruned.roles == ("actor", "reward") and pruned.trained_roles == ("actor",)
    assert pruned.data_parents("actor_train") == ("actor_gen", "rew_inf")
    assert names(prune_graph(full)) == names(full)  # nothing unread: nothing dropped


def test_pruning_is_transitive_and_keeps_train_calls() -> None:
    seq = ("seq",)
    graph = Graph("chain", (
        MFC("gen", "actor", "generate", ("prompts",), seq, BATCH),
        MFC("feature", "critic", "inference", seq, ("feature",), BATCH),
        MFC("ref", "ref", "inference", ("feature",), ("ref_logprobs",), BATCH),  # only feeds the unread key
        MFC("train", "actor", "train", seq + ("ref_logprobs",), ("stats",), BATCH),
        MFC("side_train", "critic", "train", seq, ("critic_stats",), BATCH),  # a sink nobody reads
    ))
    pruned = prune_graph(graph, ("ref_logprobs",))
    assert names(pruned) == ["gen", "train", "side_train"]


def test_keys_still_read_keep_their_producers() -> None:
    assert names(prune_graph(ppo_graph(BATCH), ["values"])) == [
        "actor_gen", "rew_inf", "ref_inf", "actor_inf", "actor_train", "critic_train"]
    # DPO's loss reads the reference: nothing to drop unless asked.
    assert names(prune_graph(dpo_graph(BATCH))) == ["ref_inf", "actor_train"]


def test_pruning_keeps_the_staleness_and_the_expected_runs() -> None:
    from planning.algorithm_graphs import outcome_graph
    from planning.dataflow import with_staleness

    graph = with_staleness(outcome_graph("dapo", BATCH, group_size=4, gen_runs=1.5), 2)
    pruned = prune_graph(graph, ["ref_logprobs"])
    assert names(pruned) == ["actor_gen", "rew_inf", "actor_train"]
    assert pruned.max_staleness == 2 and pruned.mfc("actor_gen").expected_runs == 1.5
