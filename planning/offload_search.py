"""How the search picks an optimizer offload: none when a plan fits without, else the least.

`with_least_offload(problem, search, seconds, mode)` wraps one search at a fixed offload
(`search(problem, budget)`, which raises `InfeasiblePlanError` when no plan fits) and returns its
result with the offload in the plan (`ExecutionPlan.optimizer_offload`):

1. a problem that pins its offload (`PlanningProblem.auto_offload` False, or fractions given)
   is searched as it is;
2. otherwise with no offload, with the whole budget: a problem whose plans fit gets exactly the
   plan it got before offload existed. The same placements with the first ladder step offloaded
   (`offload_ladder`) are then simulated, and taken only when that is at least
   OFFLOAD_MIN_GAIN faster (the freed memory runs a squeezed call at a faster level);
3. when nothing fits, the least step of the ladder at which a plan fits the GPUs, by bisection
   (GPU memory only falls along the ladder), each attempt with 1/OFFLOAD_ATTEMPT_SHARE of the
   budget, host memory left unchecked; then the host check of that plan, or a search at that
   step that honours host memory. So a problem that needs offload searches for at most about
   twice `seconds`. Steps that need more host memory than the whole cluster has are not tried:
   too little host memory is an error naming the roles, GiB needed and GiB available.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol, TypeVar

from planning.cost import PlanningProblem
from planning.hardware import GiB
from planning.offload import (
    OFFLOAD_MIN_GAIN,
    OFFLOAD_STEPS,
    OPTIMIZER_BYTES_PER_PARAM,
    describe_capacity,
    describe_fractions,
    host_capacity_bytes,
)
from planning.plan import ExecutionPlan
from planning.simulate import complete_plan, plan_space_for

# Each search of the offload ladder gets this share of the budget (at most ~6 of them).
OFFLOAD_ATTEMPT_SHARE = 6


class Searched(Protocol):
    """What this module reads of a search's result (`planning.search.SearchResult`, a dataclass
    it copies with `dataclasses.replace`; named here structurally, since search imports us)."""

    plan: ExecutionPlan
    baseline_plan: ExecutionPlan | None
    est_iteration_s: float
    search_s: float
    evaluated_plans: int


R = TypeVar("R", bound=Searched)
# One search at the problem's offload with a budget in seconds (raises InfeasiblePlanError).
SearchAt = Callable[[PlanningProblem, float], R]


class InfeasiblePlanError(ValueError):
    """No plan fits the problem (memory, reallocation): the search's answer, not a bad argument."""


def offload_ladder(problem: PlanningProblem) -> list[dict[str, float]]:
    """Ever larger offload choices for the trained roles: each step moves one more
    1/OFFLOAD_STEPS of one role's optimizer state to the host, of the role with the most state
    left on its GPUs (ties: role order), up to everything of every trained role."""
    params = {role: float(problem.models[role].spec.n_params(problem.models[role].critic))
              for role in problem.graph.trained_roles}
    steps = dict.fromkeys(params, 0)
    ladder: list[dict[str, float]] = []
    while any(s < OFFLOAD_STEPS for s in steps.values()):
        role = max((r for r in params if steps[r] < OFFLOAD_STEPS),
                   key=lambda r: (params[r] * (OFFLOAD_STEPS - steps[r]), -list(params).index(r)))
        steps[role] += 1
        ladder.append({r: s / OFFLOAD_STEPS for r, s in steps.items() if s})
    return ladder


def total_host_bytes(problem: PlanningProblem, fractions: Mapping[str, float]) -> float:
    """Host bytes the whole cluster holds at `fractions` (placement-independent: every role's
    optimizer state is split over its GPUs, whatever the layout)."""
    return sum(OPTIMIZER_BYTES_PER_PARAM * f * problem.models[role].spec.n_params(problem.models[role].critic)
               for role, f in fractions.items())


def with_least_offload(problem: PlanningProblem, search: SearchAt[R], seconds: float, mode: str) -> R:
    """The search's result at the least optimizer offload that lets a plan fit (see the module
    docstring); its plan and baseline plan carry that offload."""
    if not problem.auto_offload or problem.optimizer_offload:
        return _carrying(search(problem, seconds), dict(problem.optimizer_offload))
    try:
        result = search(problem, seconds)
    except InfeasiblePlanError as exc:
        return _least_offload(problem, search, seconds, exc)
    return result if mode == "manual" else _faster_with_offload(problem, result)


def _carrying(result: R, fractions: dict[str, float], spent: tuple[float, int] = (0.0, 0)) -> R:
    """`result` whose plans carry `fractions`, with earlier attempts' seconds and plans added."""
    baseline = result.baseline_plan.with_offload(fractions) if result.baseline_plan is not None else None
    return replace(result, plan=result.plan.with_offload(fractions), baseline_plan=baseline,
                   search_s=result.search_s + spent[0], evaluated_plans=result.evaluated_plans + spent[1])


def _faster_with_offload(problem: PlanningProblem, result: R) -> R:
    """`result`, or its placements with the first ladder step offloaded when that simulates at
    least OFFLOAD_MIN_GAIN faster and fits host memory."""
    ladder = offload_ladder(problem)
    capacity = host_capacity_bytes(problem.cluster.hardware) * problem.cluster.n_gpus
    if not ladder or total_host_bytes(problem, ladder[0]) > capacity:
        return result
    candidate = result.plan.without_executions().with_offload(ladder[0])
    space = plan_space_for(problem, candidate)
    seconds, reason = space.evaluate([0] * len(space.names))
    if reason or not seconds < result.est_iteration_s * (1.0 - OFFLOAD_MIN_GAIN):
        return result
    return replace(result, plan=complete_plan(problem, candidate), est_iteration_s=seconds)


def _least_offload(problem: PlanningProblem, search: SearchAt[R], seconds: float, cause: InfeasiblePlanError) -> R:
    """Bisect the offload ladder for the least step whose plan fits the GPUs, then check (or
    search for) a plan at that step that fits host memory too."""
    ladder = offload_ladder(problem)
    if not ladder:
        raise cause
    hw = problem.cluster.hardware
    capacity = host_capacity_bytes(hw) * problem.cluster.n_gpus
    if total_host_bytes(problem, ladder[0]) > capacity:
        raise InfeasiblePlanError(
            f"{cause}; optimizer offload cannot help: its least step ({describe_fractions(ladder[0])}) needs "
            f"{total_host_bytes(problem, ladder[0]) / GiB:.1f} GiB of host memory, the cluster has "
            f"{capacity / GiB:.1f} GiB for it ({describe_capacity(hw)})") from None
    unlimited = replace(problem, cluster=replace(problem.cluster, hardware=replace(hw, host_mem_bytes=math.inf)))
    budget = seconds / OFFLOAD_ATTEMPT_SHARE
    results: dict[int, R | InfeasiblePlanError] = {}

    def fits(i: int) -> bool:
        try:
            results[i] = search(unlimited.with_offload(ladder[i]), budget)
        except InfeasiblePlanError as exc:
            results[i] = exc
        return not isinstance(results[i], InfeasiblePlanError)

    lo, hi = 0, len(ladder) - 1
    if not fits(hi):
        raise InfeasiblePlanError(f"{cause}; with all optimizer state in host memory "
                                  f"({describe_fractions(ladder[hi])}) still: {results[hi]}") from None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    found = results[hi]
    assert not isinstance(found, InfeasiblePlanError)
    done = [r for r in results.values() if not isinstance(r, InfeasiblePlanError)]
    spent = (sum(r.search_s for r in done) - found.search_s,
             sum(r.evaluated_plans for r in done) - found.evaluated_plans)
    return _within_host(problem, ladder[hi], found, search, budget, spent)


def _within_host(problem: PlanningProblem, fractions: dict[str, float], found: R, search: SearchAt[R], budget: float,
                 spent: tuple[float, int]) -> R:
    """`found` (searched with host memory unchecked) when its plan fits host memory; else a
    search at the same offload that checks it; else the error naming what host memory lacks."""
    plan = found.plan.with_offload(fractions)
    excess, reason = plan_space_for(problem, plan).host_excess([0] * len(problem.graph.mfcs))
    if excess <= 0:
        return _carrying(found, fractions, spent)
    try:
        return _carrying(search(problem.with_offload(fractions), budget), fractions, spent)
    except InfeasiblePlanError:
        need = total_host_bytes(problem, fractions)
        raise InfeasiblePlanError(
            f"no plan fits the GPUs without optimizer offload, and the least offload with which one does, "
            f"{describe_fractions(fractions)} ({need / GiB:.1f} GiB of optimizer state in host memory), does not fit "
            f"host memory: {reason}") from None
