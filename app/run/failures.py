"""Explaining a failed run when a node was lost: which node, and which calls were running on it.

When a Ray node dies mid-run (its raylet killed, the machine gone), the driver usually hears
first from the survivors (a collective that lost its peer) and only ~15 s later from Ray (the
node's actors "died because its node has died"). `explain_node_loss` waits, within a bound, for
Ray to confirm a lost node when the failure looks like one (`may_be_node_loss`), and then names
the node, its workers and the operations in flight on it: the calls and reallocations of the
submitted iterations that had not finished there. It gives up early when a worker turns out to
have died on a live node (a crash, which the driver reports as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError

from cluster.health import NODE_LOSS_WAIT_S, LostNode, wait_for_lost_nodes
from cluster.placement import WorkerSlot

# Words of a collective that lost a peer (gloo, NCCL, torch.distributed timeouts), lower case.
PEER_LOSS_MARKERS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out", "timeout")
MAX_LISTED_OPS = 8


class InFlightOp(Protocol):
    """What the driver submitted: an operation on some ranks, one metadata ref per rank."""

    ranks: tuple[int, ...]
    meta_refs: tuple[ray.ObjectRef, ...]

    def describe(self) -> str: ...


def may_be_node_loss(error: BaseException) -> bool:
    """A failure a lost node could cause: an actor gone, or a collective that lost its peer."""
    if isinstance(error, (ActorDiedError, ActorUnavailableError)):
        return True
    text = str(getattr(error, "cause", None) or error).lower()
    return any(marker in text for marker in PEER_LOSS_MARKERS)


def explain_node_loss(slots: Sequence[WorkerSlot], ops: Sequence[InFlightOp], error: BaseException,
                      max_wait_s: float = NODE_LOSS_WAIT_S) -> str | None:
    """The message naming the lost node(s) and the operations in flight there, or None when no
    node of `slots` was lost (after up to `max_wait_s` when `error` may come from one)."""
    wait_s = max_wait_s if may_be_node_loss(error) else 0.0
    lost = wait_for_lost_nodes(slots, wait_s, stop=lambda: _worker_died(ops))
    return node_loss_message(lost, ops) if lost else None


def node_loss_message(lost: Sequence[LostNode], ops: Sequence[InFlightOp]) -> str:
    """'lost node 1 (...): the run stopped; in flight there: <op>, <op>, ...' (one line)."""
    ranks = {rank for node in lost for rank in node.ranks}
    running = [op.describe() for op in ops if not _finished_on(op, ranks)]
    listed = ", ".join(running[:MAX_LISTED_OPS]) or "nothing (between calls)"
    more = f" and {len(running) - MAX_LISTED_OPS} more" if len(running) > MAX_LISTED_OPS else ""
    return (f"lost {'; '.join(node.describe() for node in lost)}: Ray reports the node dead, so the run stopped; "
            f"in flight there: {listed}{more}")


def _finished_on(op: InFlightOp, ranks: set[int]) -> bool:
    """True when `op` has no rank in `ranks` or finished successfully on all of them."""
    refs = [ref for rank, ref in zip(op.ranks, op.meta_refs) if rank in ranks]
    if not refs:
        return True
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if len(ready) < len(refs):
        return False
    try:
        ray.get(ready, timeout=0)
    except RayError:
        return False
    return True


def _worker_died(ops: Sequence[InFlightOp]) -> bool:
    """Whether an actor of `ops` has been reported dead (checked before the nodes, so a death
    caused by a lost node is seen together with the node's death)."""
    refs = [ref for op in ops for ref in op.meta_refs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except ActorDiedError:
            return True
        except RayError:
            continue
    return False


__all__ = ["PEER_LOSS_MARKERS", "InFlightOp", "explain_node_loss", "may_be_node_loss", "node_loss_message"]
