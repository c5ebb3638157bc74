"""What the driver submits for one iteration, and which producer shards each consumer rank gets.

Pure functions of the dataflow graph and the plan, so they are unit-tested without Ray:

* `iteration_ops` turns the graph's calls, in plan order, into the operations the driver submits:
  a `ReallocOp` before any call whose placement differs from where the role's weights are (a
  trained role's weights live on its train placement; a frozen role's single copy moves with
  its calls), the `CallOp` itself, and a `ReleaseOp` dropping a trained role's extra copy after
  its last use before the next training step (the copy would be stale after it anyway).
* `data_owners` lists, per data-parallel rank of a call, the global rank that returns its rows
  (tp rank 0 of the last pipeline stage) and the row range [lo, hi) it holds: rows are split
  contiguously over dp, `[d * n // dp, (d + 1) * n // dp)`.
* `shards_needed` picks, for one consumer rank, the producer owners it must be given: all of
  them for inference and training, only those overlapping its dp rows otherwise, so Ray moves
  only the shards a rank reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planning.dataflow import MFC, Graph
from planning.plan import ExecutionPlan, Placement


@dataclass(frozen=True)
class ReallocOp:
    """Move `role`'s weights from `src` to `dst`; runs on the union of both meshes."""

    role: str
    src: Placement
    dst: Placement

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.mesh.gpus) | set(self.dst.mesh.gpus)))


@dataclass(frozen=True)
class CallOp:
    """Run one MFC on every rank of its placement's mesh."""

    mfc: MFC
    placement: Placement

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.placement.mesh.gpus)


@dataclass(frozen=True)
class ReleaseOp:
    """Drop `role`'s copy under `placement` (not its home copy) on that mesh's ranks."""

    role: str
    placement: Placement

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.placement.mesh.gpus)


Op = ReallocOp | CallOp | ReleaseOp


def home_placements(graph: Graph, plan: ExecutionPlan, model_roles: tuple[str, ...]) -> dict[str, Placement]:
    """Where each role's weights are loaded: its train call's placement, else its first call's."""
    homes: dict[str, Placement] = {}
    for role in model_roles:
        calls = [m for m in graph.mfcs if m.role == role]
        if not calls:
            raise ValueError(f"role {role!r}: no call of the {graph.algorithm} graph uses it")
        trains = [m for m in calls if m.kind == "train"]
        homes[role] = plan[(trains or calls)[0].name]
    return homes


def iteration_ops(graph: Graph, plan: ExecutionPlan, model_roles: tuple[str, ...],
                  location: dict[str, Placement], calls: tuple[str, ...] | None = None,
                  ) -> tuple[list[Op], dict[str, Placement]]:
    """The operations of one iteration and where every role's weights are after it.

    model_roles: roles that hold weights (a rule-based reward has none: its call runs alone).
    location: where each role's (home or only) copy is at the start of the iteration.
    calls: only these calls (one stage of an iteration under bounded staleness, app.run.staleness);
    every copy a stage makes of a trained role is released within the stage.
    """
    trained = set(graph.trained_roles)
    where = dict(location)
    extra_copies: dict[str, set[Placement]] = {role: set() for role in model_roles}
    ops: list[Op] = []
    chosen = [m for m in graph.mfcs if calls is None or m.name in calls]
    for index, mfc in enumerate(chosen):
        placement = plan[mfc.name]
        role = mfc.role
        if role in model_roles:
            held = extra_copies[role] | {where[role]}
            if placement not in held:
                ops.append(ReallocOp(role, where[role], placement))
                if role in trained:
                    extra_copies[role].add(placement)
                else:
                    where[role] = placement  # a frozen model keeps one copy: it moves
        ops.append(CallOp(mfc, placement))
        if role in trained and mfc.kind == "train":
            extra_copies[role].clear()  # the worker drops copies made stale by the update
        elif role in trained and placement in extra_copies[role] and not _used_again(chosen, plan, index, placement):
            ops.append(ReleaseOp(role, placement))
            extra_copies[role].discard(placement)
    return ops, where


def _used_again(calls: list[MFC], plan: ExecutionPlan, index: int, placement: Placement) -> bool:
    """Whether a later call of the same role, before its next train call, runs under `placement`."""
    role = calls[index].role
    for later in calls[index + 1:]:
        if later.role != role:
            continue
        if later.kind == "train":
            return False
        if plan[later.name] == placement:
            return True
    return False


@dataclass(frozen=True)
class DataOwner:
    """The global rank that returns rows [row_lo, row_hi) of a call, for one dp rank."""

    dp_rank: int
    rank: int
    row_lo: int
    row_hi: int


def dp_rows(n_rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Contiguous rows of one data-parallel rank: [d * n // dp, (d + 1) * n // dp)."""
    if n_rows < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rows(n_rows={n_rows}, dp={dp}, dp_rank={dp_rank}): need n_rows >= 1, 0 <= dp_rank < dp")
    return dp_rank * n_rows // dp, (dp_rank + 1) * n_rows // dp


def data_owners(placement: Placement, n_rows: int) -> list[DataOwner]:
    """Per dp rank: tp rank 0 of the last pipeline stage, and its rows."""
    layout = placement.layout
    owners = []
    for d in range(layout.dp):
        lo, hi = dp_rows(n_rows, layout.dp, d)
        rank = placement.gpu_of_rank(layout.rank(d, 0, layout.pp - 1))
        owners.append(DataOwner(d, rank, lo, hi))
    return owners


def shards_needed(consumer: Placement, consumer_rank: int, producer: Placement, n_rows: int,
                  all_rows: bool) -> list[DataOwner]:
    """Producer owners a consumer rank must be given.

    all_rows: the consumer needs every row (inference and training ranks get the whole batch:
    the engine balances it over dp by tokens and whitens advantages over all of it); otherwise
    only the owners whose rows overlap the consumer's dp rows (generation, rule rewards). That
    range is widened by one row on each side so a worker rounding its split differently still
    finds every row it keeps; an extra shard only costs a copy.
    """
    if consumer_rank not in consumer.mesh.gpus:
        raise ValueError(f"rank {consumer_rank} is not in the consumer mesh {consumer.mesh}")
    owners = data_owners(producer, n_rows)
    if all_rows:
        return owners
    dp_rank, _, _ = consumer.layout.coords(consumer_rank - consumer.mesh.start)
    lo, hi = dp_rows(n_rows, consumer.layout.dp, dp_rank)
    lo, hi = max(lo - 1, 0), min(hi + 1, n_rows)
    return [o for o in owners if o.row_lo < hi and lo < o.row_hi]


def prepared_call(graph: Graph, plan: ExecutionPlan, op: ReallocOp) -> str:
    """The call a reallocation prepares (the first call of the role on its destination)."""
    return next(m.name for m in graph.mfcs if m.role == op.role and plan[m.name] == op.dst)


def sequences_per_iteration(graph: Graph) -> int:
    """The first generation call's rows (the first call's without one, e.g. DPO's 2 x pairs)."""
    return next((m.batch.n_seqs for m in graph.mfcs if m.kind == "generate"), graph.mfcs[0].batch.n_seqs)


def last_train_call(graph: Graph) -> MFC:
    """The iteration's last train call (a checkpoint is written after it)."""
    return [m for m in graph.mfcs if m.kind == "train"][-1]


def prompt_shard(batch: Sequence[Any]) -> dict[str, Any]:
    """The generation call's input from PromptExamples: rows 0..n-1 with prompt ids (int64 [p_i]),
    texts and answers."""
    import torch

    from actors.worker import make_shard

    return make_shard(0, {
        "prompt_ids": [torch.tensor(e.prompt_ids, dtype=torch.int64) for e in batch],
        "prompt": [e.prompt for e in batch],
        "answer": [e.answer for e in batch],
    })


def realloc_member_sets(graph: Graph, plan: ExecutionPlan, model_roles: tuple[str, ...]) -> list[tuple[Placement, Placement, str]]:
    """Every (src, dst, role) reallocation the steady state and the first iteration perform."""
    location = home_placements(graph, plan, model_roles)
    seen: dict[tuple[Placement, Placement, str], None] = {}
    # Two iterations cover the first one (from the load placement) and the repeating pattern.
    for _ in range(2):
        ops, location = iteration_ops(graph, plan, model_roles, location)
        for op in ops:
            if isinstance(op, ReallocOp):
                seen.setdefault((op.src, op.dst, op.role), None)
    return list(seen)


__all__ = [
    "CallOp", "DataOwner", "Op", "ReallocOp", "ReleaseOp", "data_owners", "dp_rows", "home_placements",
    "iteration_ops", "last_train_call", "prepared_call", "prompt_shard", "realloc_member_sets",
    "sequences_per_iteration", "shards_needed",
]
