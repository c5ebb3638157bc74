"""Which of a worker group's Ray nodes are gone: to name a lost node when a run fails.

Ray declares a node dead once its raylet misses health checks (about 15 s with Ray's defaults);
only then do the actors on it fail with "its node has died". Their peers on other nodes notice
earlier: their collectives fail ("Connection closed by peer" over gloo) or stall. So a caller
that sees such a failure waits a bounded time (`wait_for_lost_nodes`) for Ray to confirm a node
loss before blaming a worker. `lost_nodes` is the pure check on `ray.nodes()` records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from cluster.placement import WorkerSlot

# Ray's default health checks declare a dead raylet's node dead after about 15 s; twice that.
NODE_LOSS_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class LostNode:
    """A planner node whose Ray node is no longer alive, with the workers it held."""

    node: int
    node_id: str
    ip: str
    workers: tuple[str, ...]
    ranks: tuple[int, ...]

    def describe(self) -> str:
        """e.g. 'node 1 (192.0.2.2, Ray node bbab5594; workers worker-n1-g0, worker-n1-g1)'."""
        return f"node {self.node} ({self.ip}, Ray node {self.node_id[:8]}; workers {', '.join(self.workers)})"


def lost_nodes(slots: Sequence[WorkerSlot], records: Sequence[Mapping[str, Any]]) -> list[LostNode]:
    """The planner nodes of `slots` whose Ray node is dead or missing in `ray.nodes()` records."""
    alive = {r["NodeID"] for r in records if r.get("Alive", False)}
    by_node: dict[int, list[WorkerSlot]] = {}
    for slot in slots:
        if slot.node_id and slot.node_id not in alive:
            by_node.setdefault(slot.node, []).append(slot)
    return [LostNode(node, group[0].node_id, group[0].ip, tuple(s.name for s in group), tuple(s.rank for s in group))
            for node, group in sorted(by_node.items())]


def wait_for_lost_nodes(slots: Sequence[WorkerSlot], wait_s: float, poll_s: float = 0.5,
                        stop: Callable[[], bool] | None = None) -> list[LostNode]:
    """Poll Ray for up to `wait_s` until a node of `slots` is dead; returns the lost nodes (empty
    when none was lost by then, or as soon as `stop()` says another explanation turned up)."""
    deadline = time.monotonic() + wait_s
    while True:
        # `stop` first: Ray marks a node dead before its actors, so a death seen by `stop` that
        # the node caused is seen as a lost node below in the same round.
        stopping = stop is not None and stop()
        lost = lost_nodes(slots, ray.nodes())
        if lost or stopping or time.monotonic() >= deadline:
            return lost
        time.sleep(poll_s)


__all__ = ["NODE_LOSS_WAIT_S", "LostNode", "lost_nodes", "wait_for_lost_nodes"]
