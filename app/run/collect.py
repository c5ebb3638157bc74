"""The operations the driver submitted: checkpoint writes, and waiting for results or the failure.

`wait_ops` returns every op's per-rank metadata, or raises a `WorkerFailure`
(app.run.recovery) as soon as one fails or the ops stall:

* a lost Ray node (app.run.failures): named with the operations in flight on it; not
  recoverable (a restart could not reserve its GPUs);
* a failure: the errors that arrive within FAILURE_SETTLE_S are compared, and the one reported
  is a dead worker's first, then an exception raised by code (fatal: a restart would not help),
  then a broken collective (usually a peer of the worker that failed); it is named with the op
  that worker was running (a dead actor fails its queued tasks in no set order), or for an
  exception raised by code with the earliest submitted op that raised it (its consumers fail
  with the same exception: a rule reward that raised is named, not the train call after it);
* a stall: no op finished for `timeout_s`; the ranks of the first stuck op are probed on their
  monitor threads and the one that stopped (not waiting in a collective) is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from app.run.checkpoint import RNG_DIR, STATE_DIR
from app.run.failures import explain_node_loss
from app.run.recovery import WorkerFailure, describe_error, is_recoverable, probe_workers, stall_message
from cluster.health import NODE_LOSS_WAIT_S
from cluster.placement import WorkerGroup
from planning.plan import Placement

FAILURE_SETTLE_S = 5.0
RESULT_WAIT_S = 30.0


@dataclass(frozen=True, eq=False)  # identity equality: ops are dict keys while collected
class SubmittedOp:
    """One operation as submitted: meta refs in `ranks` order, data refs of the data owners."""

    iteration: int
    name: str
    kind: str  # call | realloc | release | export | save
    ranks: tuple[int, ...]
    meta_refs: tuple[ray.ObjectRef, ...]
    data_refs: dict[int, ray.ObjectRef] = field(default_factory=dict)
    placement: Placement | None = None  # where its data came from, when not the plan's (dyn_select)
    n_rows: int | None = None  # rows of its data, when not its call's (dyn_select)
    model_free: bool = False  # runs on the worker's model-free threads, beside its GPU calls

    def describe(self) -> str:
        return f"{self.kind} '{self.name}' of iteration {self.iteration}"


Where = dict[ray.ObjectRef, tuple[SubmittedOp, int]]


def submit_checkpoint(workers: WorkerGroup, iteration: int, staging: Path,
                      homes: dict[str, tuple[int, ...]]) -> list[SubmittedOp]:
    """The writes of a checkpoint after `iteration` into `staging`: per trained role (by the
    ranks of its home mesh) its HF export and its state shards, then every worker's random
    generators. Submitted after the iteration's last train call, so they see its result."""
    subs = []
    for role, ranks in homes.items():
        actors = [workers.actor(r) for r in ranks]
        subs.append(SubmittedOp(iteration, role, "export", ranks,
                                tuple(a.export.remote(role, str(staging / role)) for a in actors)))
        state_dir = str(staging / STATE_DIR / role)
        subs.append(SubmittedOp(iteration, role, "save", ranks,
                                tuple(a.save_state.remote(role, state_dir) for a in actors)))
    everyone = tuple(range(workers.world_size))
    rng_dir = str(staging / STATE_DIR / RNG_DIR)
    subs.append(SubmittedOp(iteration, "rng", "save", everyone,
                            tuple(workers.actor(r).save_rng_state.remote(rng_dir) for r in everyone)))
    return subs


def wait_ops(workers: WorkerGroup, ops: Sequence[SubmittedOp], later: Sequence[SubmittedOp],
             timeout_s: float) -> dict[SubmittedOp, list[Any]]:
    """Per op, its ranks' metadata in `ranks` order. `later`: ops submitted after these (a
    failed worker may have been running one of them when it died)."""
    where: Where = {ref: (sub, rank) for sub in ops for rank, ref in zip(sub.ranks, sub.meta_refs)}
    results: dict[ray.ObjectRef, Any] = {}
    remaining = list(where)
    while remaining:
        ready, remaining = ray.wait(remaining, num_returns=1, timeout=timeout_s)
        if not ready:
            raise stall_failure(workers, ops, remaining, where, timeout_s)
        for ref in ready:
            try:
                results[ref] = ray.get(ref)
            except RayError as error:
                lost = explain_node_loss(workers.slots, [*ops, *later], error, min(timeout_s, NODE_LOSS_WAIT_S))
                if lost is not None:  # the node is gone: a restart could not reserve its GPUs
                    raise WorkerFailure(lost, "node", "", recoverable=False) from error
                raise failure_of(workers, [*ops, *later], (ref, error), remaining, where) from error
    return {sub: [results[ref] for ref in sub.meta_refs] for sub in ops}


def failure_of(workers: WorkerGroup, ops: Sequence[SubmittedOp], first: tuple[ray.ObjectRef, RayError],
               remaining: list[ray.ObjectRef], where: Where) -> WorkerFailure:
    """The failure to report (see the module docstring)."""
    failures = [first]
    if remaining:
        settled, _ = ray.wait(remaining, num_returns=len(remaining), timeout=FAILURE_SETTLE_S)
        for ref in settled:
            try:
                ray.get(ref, timeout=0)
            except RayError as error:
                failures.append((ref, error))

    def priority(item: tuple[ray.ObjectRef, RayError]) -> int:
        error = item[1]
        return 0 if isinstance(error, RayActorError) else 2 if is_recoverable(error) else 1

    ref, error = min(failures, key=priority)
    sub, rank = where[ref]
    if priority((ref, error)) == 1:
        # An exception raised by code: its worker is alive and the op that raised it is the one to
        # name. Its consumers fail with the same exception (a failed input), so among the ops that
        # raised one, the earliest submitted is named: a rule reward, not the train call reading it.
        order = {id(op): index for index, op in enumerate(ops)}
        ref, error = min((f for f in failures if priority(f) == 1),
                         key=lambda f: order.get(id(where[f[0]][0]), len(order)))
        sub, rank = where[ref]
    else:
        sub = first_unfinished(rank, ops, sub)
    name = workers.slots[rank].name
    return WorkerFailure(f"{sub.describe()} failed on worker {name} (rank {rank}): {describe_error(error)}",
                         sub.describe(), name, is_recoverable(error))


def first_unfinished(rank: int, ops: Sequence[SubmittedOp], reported: SubmittedOp) -> SubmittedOp:
    """The op a failed worker was running: its first op, in submission order, without a
    successful result. Ops on the worker's model-free threads (a rule reward beside the GPU call)
    are named only when no GPU-thread op is unfinished: when the process dies both fail, and the
    GPU thread's op is the one that was running in the worker's order. A result that completed
    before the failure arrives at once even under load; RESULT_WAIT_S bounds the wait for one that
    never will (a live worker still inside an earlier op)."""
    mine = [sub for sub in ops if rank in sub.ranks]
    for candidates in ([sub for sub in mine if not sub.model_free], [sub for sub in mine if sub.model_free]):
        for sub in candidates:
            ref = sub.meta_refs[sub.ranks.index(rank)]
            ready, _ = ray.wait([ref], timeout=RESULT_WAIT_S)
            if not ready:
                return sub
            try:
                ray.get(ref, timeout=0)
            except RayError:
                return sub
    return reported


def stall_failure(workers: WorkerGroup, ops: Sequence[SubmittedOp], remaining: list[ray.ObjectRef], where: Where,
                  timeout_s: float) -> WorkerFailure:
    """A recoverable WorkerFailure naming the rank(s) of the first stuck op that stopped (a lost
    node instead ends the run, naming it)."""
    lost = explain_node_loss(workers.slots, ops, TimeoutError(), max_wait_s=0.0)
    if lost is not None:
        return WorkerFailure(lost, "node", "", recoverable=False)
    first = min((where[ref] for ref in remaining), key=lambda sr: list(ops).index(sr[0]))[0]
    stuck = [rank for sub, rank in (where[r] for r in remaining) if sub is first]
    message, stopped = stall_message(first.describe(), timeout_s, probe_workers(workers, stuck))
    return WorkerFailure(message, first.describe(), ", ".join(stopped), recoverable=True)


__all__ = ["FAILURE_SETTLE_S", "SubmittedOp", "failure_of", "first_unfinished", "stall_failure", "submit_checkpoint",
           "wait_ops"]
