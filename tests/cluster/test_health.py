"""Which planner nodes of a worker group are lost, from `ray.nodes()` records (no Ray needed)."""

from __future__ import annotations

import pytest

from cluster.health import lost_nodes
from cluster.placement import WorkerSlot

pytestmark = pytest.mark.unit


def test_a_dead_or_vanished_node_is_named_with_its_workers() -> None:
    slots = [WorkerSlot(r, r // 2, r % 2, f"worker-n{r // 2}-g{r % 2}", f"id{r // 2}" * 4, f"10.0.0.{r // 2}")
             for r in range(6)]
    records = [{"NodeID": "id0" * 4, "Alive": True}, {"NodeID": "id1" * 4, "Alive": False}]  # node 2 vanished
    lost = lost_nodes(slots, records)
    assert [(n.node, n.ranks, n.workers) for n in lost] == [
        (1, (2, 3), ("worker-n1-g0", "worker-n1-g1")), (2, (4, 5), ("worker-n2-g0", "worker-n2-g1"))]
    assert lost[0].describe() == "node 1 (10.0.0.1, Ray node id1id1id; workers worker-n1-g0, worker-n1-g1)"
    alive = [{"NodeID": f"id{n}" * 4, "Alive": True} for n in range(3)]
    assert lost_nodes(slots, alive) == []
    # Slots not pinned to a Ray node (no id) are never reported.
    assert lost_nodes([WorkerSlot(0, 0, 0, "w")], []) == []
