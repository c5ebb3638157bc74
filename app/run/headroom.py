"""The memory margin, checked before the first call: every call's estimated peak must leave
`plan.memory_margin` of its GPUs free.

The search already plans within the margin (`PlanningProblem.memory_margin`); a manual plan, a
plan found under an older model or a cluster whose GPUs differ from the preset may not. A plan
that does not leave the margin is refused with one line naming the call, its estimate and the
capacity (ConfigError: exit status 2), before any call runs. After calls, a measured peak above
its estimate by more than the margin is a warning (`app.reporting.memory_overruns`).
"""

from __future__ import annotations

from app.config import ConfigError
from planning.cost import PlanningProblem
from planning.hardware import GiB
from planning.plan import ExecutionPlan
from planning.simulate import simulate


def check_headroom(problem: PlanningProblem, plan: ExecutionPlan) -> None:
    """ConfigError naming the first call (graph order) whose estimated peak per GPU exceeds the
    GPU's memory less the margin."""
    sim = simulate(problem, plan, iterations=1)
    capacity = problem.cluster.hardware.mem_bytes
    limit = problem.mem_limit_bytes
    for mfc in problem.graph.mfcs:
        peak = sim.call_mem_bytes.get(mfc.name, 0.0)
        if peak > limit:
            margin = problem.memory_margin
            raise ConfigError(
                "plan.memory_margin", margin,
                f"a plan whose calls leave that fraction of each GPU free: call {mfc.name} on {plan[mfc.name].mesh}/"
                f"{plan[mfc.name].layout} needs an estimated {peak / GiB:.1f} GiB per GPU of {capacity / GiB:.1f} GiB "
                f"({limit / GiB:.1f} GiB after the margin); lower the margin, or give the call more GPUs, a smaller "
                "plan.manual.<call>.micro_batch_tokens or more gen_rounds",
                problem="plan exceeds the memory margin")


__all__ = ["check_headroom"]
