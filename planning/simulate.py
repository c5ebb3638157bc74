"""Iteration time and per-GPU memory of an execution plan, by list scheduling.

Model (the same one the search optimises, through `planning.plan_space.PlanSpace`):

* Calls are dispatched in `Graph.dispatch_order`, as the driver submits them (on-policy:
  iteration after iteration in graph order; with max_staleness k, the generation of iteration
  i + k + 1 right after the training of iteration i); each GPU executes what it is given in that
  order. Calls on disjoint meshes therefore run concurrently and calls on overlapping meshes
  serialise.
* A call waits for its data parents of the same iteration (`Graph.data_parents`) and its
  version parents (`Graph.version_parents`: the role's train call) `Graph.version_lag`
  iterations back: 1, or k + 1 for generation.
* For a trained role, the train call's placement is where the weights (and optimizer) live.
  Another call of that role on a different placement is preceded by a reallocation task
  train -> call on the union of both meshes, which may start as soon as the new weights exist.
  Never-trained roles (ref, reward) keep their weights where their calls run: no reallocation.
* Steady-state iteration time = (end of the last iteration - end of the first) / (n - 1): the
  first iteration carries the pipeline fill, later ones show cross-iteration overlap. With
  staleness k, k more iterations are scheduled so that generation running ahead is in the window.
* Memory per GPU = resident bytes (each trained role's weights + the GPU part of its optimizer
  shard on its train mesh; each never-trained role's weights on every placement it runs on) + the largest
  transient of the calls on that GPU (activations, gradients, KV cache, and the weights of a
  reallocated copy). Each call runs at the fastest of its memory levels (more micro-batches,
  or generation in more rounds: `planning.cost.call_cost_levels`) that fits beside the
  resident bytes of its GPUs, so a crowded GPU makes a call slower before it makes the plan
  infeasible. A plan where even the leanest level does not fit is infeasible.
* Optimizer offload (`ExecutionPlan.optimizer_offload`, priced by `planning.offload`): the plan
  says which fraction of each trained role's optimizer state lives in pinned host memory. The
  train call holds only the rest on its GPUs (plus the staging buffers while it steps) and its
  time includes streaming the host part through the GPU every optimizer step (`offload_s`, also
  reported per call in `SimResult.offload_s`). The host parts on a node must fit its host memory
  (`HardwareSpec.host_mem_bytes` less a reserve): otherwise the plan is infeasible, naming the node.

A plan that names a call's execution (`ExecutionPlan.executions`: its micro-batch token budget
or generation rounds) is simulated at exactly that level; `complete_plan` fills in the level the
simulator picks for every call that has none, which is what the workers then run.

The plan's offload is the one priced: `simulate(problem, plan)` uses `problem.for_plan(plan)`.

Not modelled: moving call outputs between meshes (sequences and scalars, small next to weights)
and CPU offload of idle weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planning.cost import PlanningProblem
from planning.dataflow import Graph
from planning.plan import CallExecution, ExecutionPlan
from planning.plan_space import CallCostCache, PlanSpace, ReallocCache, TaskRecord


@dataclass(frozen=True)
class SimTask:
    """One scheduled task: a call, or a reallocation named 'realloc:<train call>-><call>'."""

    name: str
    kind: str  # 'call' | 'realloc'
    iteration: int
    gpus: tuple[int, ...]
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """iteration_s: steady-state seconds per iteration, as scheduled even when the plan does not
    fit in memory (then feasible is False and reason says why); inf when it cannot be scheduled."""

    iteration_s: float
    tasks: tuple[SimTask, ...]
    peak_mem_bytes: dict[int, float]
    feasible: bool
    reason: str = ""
    executions: dict[str, CallExecution] = field(default_factory=dict)  # how each call runs
    call_mem_bytes: dict[str, float] = field(default_factory=dict)  # peak per GPU while a call runs
    offload_s: dict[str, float] = field(default_factory=dict)  # train calls: seconds of optimizer offload per iteration


def with_default_placements(graph: Graph, plan: ExecutionPlan) -> ExecutionPlan:
    """`plan` with a placement for every call of `graph`, in graph order: a call it leaves out
    takes the placement of `graph.placement_default` (PPO's actor_inf: the actor's train call).
    Calls without a default stay missing (plan_space_for names them)."""
    given = plan.as_dict()
    out = {}
    for m in graph.mfcs:
        default = graph.placement_default(m.name)
        if m.name in given:
            out[m.name] = given[m.name]
        elif default is not None and default in given:
            out[m.name] = given[default]
    out.update({name: p for name, p in given.items() if name not in out})
    return ExecutionPlan.from_dict(out, dict(plan.executions)).with_offload(dict(plan.optimizer_offload))


def plan_space_for(
    problem: PlanningProblem, plan: ExecutionPlan, iterations: int = 3,
    costs: CallCostCache | None = None, reallocs: ReallocCache | None = None,
) -> PlanSpace:
    """A one-candidate-per-call `PlanSpace` holding `plan` (validated against the problem; calls
    it leaves out take their `Graph.placement_default`), its executions pinned where the plan
    names them, priced with the plan's optimizer offload."""
    problem = problem.for_plan(plan)
    plan = with_default_placements(problem.graph, plan)
    placements = plan.as_dict()
    names = [m.name for m in problem.graph.mfcs]
    missing = [n for n in names if n not in placements]
    if missing:
        raise ValueError(f"plan: no placement for calls {missing}; the graph has {names}")
    extra = [n for n in placements if n not in names]
    if extra:
        raise ValueError(f"plan: calls {extra} are not in graph {problem.graph.algorithm} ({names})")
    cluster = problem.cluster
    for name, p in placements.items():
        if p.mesh.gpus_per_node != cluster.gpus_per_node or p.mesh.start + p.mesh.size > cluster.n_gpus:
            raise ValueError(
                f"plan: mesh {p.mesh} of {name} is not inside the {cluster.nodes}x{cluster.gpus_per_node} cluster"
            )
    pinned = [plan.execution(n) for n in names]
    return PlanSpace(problem, [[placements[n]] for n in names], iterations, costs, reallocs, pinned)


def simulate(problem: PlanningProblem, plan: ExecutionPlan, iterations: int = 3) -> SimResult:
    """Simulate `iterations` iterations of `plan` (see the module docstring)."""
    space = plan_space_for(problem, plan, iterations)
    state = [0] * len(space.names)
    los, his, peaks = space.memory_per_segment(state)
    peak = {g: 0.0 for g in range(problem.cluster.n_gpus)}
    for lo, hi, value in zip(los, his, peaks):
        for g in range(lo, hi):
            peak[g] = value
    records: list[TaskRecord] = []
    durations, _, _ = space.call_levels(state)
    iteration_s, schedule_reason = space.schedule(state, durations, records)
    _, reason = space.evaluate(state)
    executions = {n: e for n, e in zip(space.names, space.executions(state)) if e is not None}
    call_mem = dict(zip(space.names, space.call_peak_bytes(state)))
    return SimResult(iteration_s, tuple(_task(r) for r in records), peak, not reason, reason or schedule_reason,
                     executions, call_mem, _offload_seconds(space))


def _offload_seconds(space: PlanSpace) -> dict[str, float]:
    """Per train call of a one-plan space that offloads: its offload seconds per iteration."""
    out = {}
    for c, name in enumerate(space.names):
        level = space.costs.levels(name, space.candidates[c][0], space.pinned[c])[0]
        seconds = level.breakdown.get("offload_s", 0.0)
        if seconds > 0:
            out[name] = seconds * space.problem.graph.mfc(name).expected_runs
    return out


def complete_plan(problem: PlanningProblem, plan: ExecutionPlan) -> ExecutionPlan:
    """`plan` with an execution for every call: the ones it names, and for the others the level
    the simulator picks (the fastest that fits beside the resident weights)."""
    plan = with_default_placements(problem.graph, plan)
    space = plan_space_for(problem, plan, iterations=1)
    chosen = space.executions([0] * len(space.names))
    given = dict(plan.executions)
    executions = {n: given.get(n, e) for n, e in zip(space.names, chosen) if given.get(n, e) is not None}
    return plan.with_executions(executions)


def _task(record: TaskRecord) -> SimTask:
    name, kind, iteration, mask, start, end = record
    gpus = tuple(g for g in range(mask.bit_length()) if mask >> g & 1)
    return SimTask(name, kind, iteration, gpus, start, end)
