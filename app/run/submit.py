"""Turning the schedule's operations into Ray tasks on the workers of their meshes.

Each function submits one operation and returns its `SubmittedOp` without waiting: a call to
every rank of its placement (`submit_call`: its inputs are the producers' data ObjectRefs of the
shards it needs, `app.run.schedule.shards_needed`), a reallocation or release of a role's weights
(`submit_weights_op`), and DAPO's sampling rounds and its select call over their shards
(`sample_rounds`, `submit_select`).
Tensors never pass through the driver: calls return (metadata, data) as two objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from actors.worker import MODEL_FREE_GROUP, MODEL_FREE_OPS, CallSpec
from app.run.collect import SubmittedOp
from app.run.dynamic_sampling import SELECT_CALL, GroupFilter, rewards_in_row_order, select_call
from app.run.schedule import CallOp, Op, ReallocOp, ReleaseOp, prepared_call, shards_needed
from cluster.placement import WorkerGroup
from planning.dataflow import Graph
from planning.plan import ExecutionPlan


def call_options(spec: CallSpec) -> dict[str, Any]:
    """Ray options of a call: two returns (meta, data); a model-free call (a rule reward: decode
    and score) on the worker's own threads, so the worker's next GPU call runs meanwhile."""
    if spec.op in MODEL_FREE_OPS:
        return {"num_returns": 2, "concurrency_group": MODEL_FREE_GROUP}
    return {"num_returns": 2}


def submit_call(workers: WorkerGroup, graph: Graph, plan: ExecutionPlan, op: CallOp, i: int, params: dict[str, Any],
                dataset_ref: ray.ObjectRef, outputs: dict[str, SubmittedOp], all_reward_rows: bool) -> SubmittedOp:
    """Call `op` of iteration i on every rank of its placement, as the plan says it runs
    (`CallSpec.execution`). outputs: the data producers submitted so far, by call name;
    all_reward_rows: False when a rule reward scores only its rank's share of the rows."""
    mfc, placement = op.mfc, op.placement
    n_rows = mfc.batch.n_seqs
    spec = CallSpec(mfc.name, mfc.role, mfc.kind, placement, i, n_rows, params, plan.execution(mfc.name))
    all_rows = mfc.role != "reward" or all_reward_rows
    options = call_options(spec)
    metas, datas = [], {}
    # Generation reads the prompts; DPO's calls read the preference pairs (graph.dataset_keys).
    reads_dataset = mfc.kind == "generate" or bool(set(mfc.input_keys) & set(graph.dataset_keys))
    for rank in op.ranks:
        args: list[ray.ObjectRef] = [dataset_ref] if reads_dataset else []
        for parent in graph.data_parents(mfc.name):
            # Rows of producer and consumer are the same sequences unless their counts differ.
            source = outputs[parent]
            parent_rows = source.n_rows or graph.mfc(parent).batch.n_seqs
            needed = shards_needed(placement, rank, source.placement or plan[parent], parent_rows,
                                   all_rows or parent_rows != n_rows)
            args.extend(source.data_refs[o.rank] for o in needed)
        meta_ref, data_ref = workers.actor(rank).run_call.options(**options).remote(spec, *args)
        metas.append(meta_ref)
        datas[rank] = data_ref
    return SubmittedOp(i, mfc.name, "call", op.ranks, tuple(metas), datas, model_free="concurrency_group" in options)


def submit_weights_op(workers: WorkerGroup, graph: Graph, plan: ExecutionPlan, op: Op, i: int) -> SubmittedOp:
    """A reallocation (named by the call it prepares) or a release of one role's weights."""
    if isinstance(op, ReallocOp):
        refs = tuple(workers.actor(r).reallocate.remote(op.role, op.src, op.dst) for r in op.ranks)
        return SubmittedOp(i, prepared_call(graph, plan, op), "realloc", op.ranks, refs)
    assert isinstance(op, ReleaseOp)
    refs = tuple(workers.actor(r).release.remote(op.role, op.placement) for r in op.ranks)
    return SubmittedOp(i, op.role, "release", op.ranks, refs)


def submit_select(workers: WorkerGroup, i: int, rank: int, gpus_per_node: int, shards: list[tuple[int, SubmittedOp]],
                  round_rows: int, kept: GroupFilter) -> SubmittedOp:
    """DAPO's select_rows call (actors.worker.select) on `rank`: the kept groups of every
    round's generation and reward shards (round, op) as one batch the later calls read."""
    refs = [(r, ref) for r, sub in shards for ref in sub.data_refs.values()]
    spec = select_call(i, rank, gpus_per_node, [r for r, _ in refs], round_rows, kept)
    options = call_options(spec)
    meta, data = workers.actor(rank).run_call.options(**options).remote(spec, *(ref for _, ref in refs))
    return SubmittedOp(i, SELECT_CALL, "call", (rank,), (meta,), {rank: data}, spec.placement, spec.n_rows,
                       model_free="concurrency_group" in options)


def sample_rounds(submit_round: Callable[[int], tuple[SubmittedOp, SubmittedOp]],
                  wait: Callable[[SubmittedOp], list[Any]], n_prompts: int, group_size: int, round_rows: int,
                  max_rounds: int) -> tuple[GroupFilter, list[tuple[int, SubmittedOp]]]:
    """DAPO's rounds: submit_round(r) submits round r's generation and reward calls; after each,
    wait(reward op) gives its ranks' metadata, and the rounds stop once enough groups have
    distinct rewards (or after max_rounds). Returns the filter and every (round, shard op)."""
    kept = GroupFilter(n_prompts, group_size, max_rounds)
    shards: list[tuple[int, SubmittedOp]] = []
    for r in range(max_rounds):
        gen, reward = submit_round(r)
        shards += [(r, gen), (r, reward)]
        if kept.add_round(rewards_in_row_order(wait(reward), round_rows)):
            break
    return kept, shards


__all__ = ["call_options", "sample_rounds", "submit_call", "submit_select", "submit_weights_op"]
