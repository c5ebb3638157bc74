"""Caches the plan evaluator (`planning.plan_space.PlanSpace`) shares across plan spaces: call
costs per (call, mesh size, layout) and reallocation times per (role, source, destination), both
independent of where a mesh starts (up to a shift by whole nodes for reallocations)."""

from __future__ import annotations

from planning.cost import CallCost, PlanningProblem, call_cost, call_cost_levels
from planning.plan import CallExecution, Placement
from planning.realloc_estimate import approx_realloc_s
from planning.realloc_plan import estimate_realloc_s


class ReallocCache:
    """Reallocation seconds per (role, source, destination), shared across plan spaces.

    exact=True asks `realloc_plan.estimate_realloc_s` (plans the transfers: what the simulator
    reports); exact=False the closed form `realloc_estimate.approx_realloc_s` (what the search
    ranks with). A plan is a function of node membership and GPU order only, so shifting both
    placements by the same number of whole nodes gives the same time: the key is taken
    relative to the first node either placement touches.
    """

    def __init__(self, problem: PlanningProblem, exact: bool = True) -> None:
        self._problem = problem
        self.exact = exact
        self._seconds: dict[tuple, float | str] = {}

    def seconds(self, role: str, src: Placement, dst: Placement) -> float | str:
        """Seconds to move `role`'s weights from `src` to `dst`, or why it cannot be done."""
        m = src.mesh.gpus_per_node
        base = min(src.mesh.start, dst.mesh.start) // m * m
        key = (role, src.layout, src.mesh.size, src.mesh.start - base, dst.layout, dst.mesh.size, dst.mesh.start - base)
        found = self._seconds.get(key)
        if found is None:
            model = self._problem.models[role]
            if not self.exact:
                found = approx_realloc_s(model.spec, model.critic, src, dst, self._problem.cluster)
            else:
                try:
                    found = estimate_realloc_s(model.spec, model.critic, src, dst, self._problem.cluster)
                except ValueError as err:
                    found = str(err)
            self._seconds[key] = found
        return found


class CallCostCache:
    """`call_cost` (whole GPU free) and `call_cost_levels` per (call, mesh size, layout, pinned
    execution): the position of a mesh does not change them."""

    def __init__(self, problem: PlanningProblem) -> None:
        self._problem = problem
        self._costs: dict[tuple, CallCost] = {}
        self._levels: dict[tuple, list[CallCost]] = {}

    def cost(self, call: str, placement: Placement) -> CallCost:
        key = (call, placement.mesh.size, placement.layout)
        found = self._costs.get(key)
        if found is None:
            found = call_cost(self._problem, self._problem.graph.mfc(call), placement)
            self._costs[key] = found
        return found

    def levels(self, call: str, placement: Placement, execution: CallExecution | None = None) -> list[CallCost]:
        """Every level, or only the one `execution` names."""
        key = (call, placement.mesh.size, placement.layout, execution)
        found = self._levels.get(key)
        if found is None:
            found = call_cost_levels(self._problem, self._problem.graph.mfc(call), placement, execution)
            self._levels[key] = found
        return found


__all__ = ["CallCostCache", "ReallocCache"]
