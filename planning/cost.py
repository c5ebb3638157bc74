"""Cost model: time and memory of one model function call under one placement.

`call_cost(problem, mfc, placement)` is an analytic roofline estimate: matmul FLOPs against the
GPU's bf16 peak or streaming the stage's weights from HBM once per micro-batch and pass,
whichever is slower; decode steps as weight + KV-cache streaming against HBM bandwidth (or
FLOPs); sampling every step; plus the communication each parallel dimension implies:

* non-matmul ops (norms, residual adds, rotary, activations) as HBM traffic per token and block
  (`planning.cost_terms.ELEMENTWISE_BYTES_PER_HIDDEN`: measured), most of it whole on every tp
  rank since the engine has no sequence parallelism;
* tp: 2 all-reduces of (tokens, hidden) bf16 per layer forward, 2 more backward, ring cost
  2(tp-1)/tp * bytes / NVLink bandwidth (tp groups never leave a node);
* pp: 1F1B bubble (pp-1)/n_micro of the stage time, plus p2p activation sends between stages;
  decoding circulates min(seqs, pp) micro-batches, a step takes max(n_micro, pp) stage slots,
  each re-reading the stage's weights, plus one p2p hop per slot;
* dp (train): ZeRO-1 gradient reduce-scatter + parameter all-gather per optimizer step, over
  NVLink or the NIC depending on whether the dp group spans nodes.

Memory: bf16 weights, fp32 gradients while training, fp32 master + Adam m, v (12 bytes/param) sharded over dp
(the `PlanningProblem.optimizer_offload` fraction of it in host memory instead, streamed through the
GPU for each optimizer step at `HardwareSpec.host_bw`: `planning.offload`),
activations of the micro-batches in flight (no recomputation), KV cache for generation. A call
that does not fit is infeasible (with a reason), never merely slow. Each call has memory
levels (`call_cost_levels`): 1x, 2x, 4x ... the base number of micro-batches (enough for the
pipeline and at most `planning.call_levels.MAX_MICRO_TOKENS` tokens each in training,
`MAX_INFERENCE_MICRO_TOKENS` in inference), or generation in
1, 2, 4 ... rounds (`planning.call_levels`); the fastest level that fits the memory left to the
call is used, so a call squeezed by other models' resident weights still runs, only slower
(`planning.plan_space` passes that budget).
Each level carries its `CallExecution` (the micro-batch token budget, or the rounds): the plan
records the chosen one and the workers run it; `execution=` prices exactly a given one.
`PlanningProblem.memory_margin` keeps that fraction of every GPU free (the usable memory is
`mem_limit_bytes`); `memory_scale` multiplies the transient bytes (activations, logits, KV
cache) as a run's own measurements calibrate them (`planning.calibrate`).

Multi-turn generation (`MFC.multi_turn`) adds observation prefills and environment waits and
decodes every turn over a growing context (`planning.cost_multiturn`, which says how); it runs at
pp = 1 only. `OpEfficiency` scales the hardware peaks per op kind; a measured
`HardwareSpec.with_profile` replaces the peaks themselves. The per-op arithmetic lives in
`planning.cost_terms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from planning.call_levels import level_execution, level_splits, split_of
from planning.cost_multiturn import MULTI_TURN_PP_REASON
from planning.cost_passes import forward_backward, generate_parts
from planning.cost_terms import MODEL_FREE_S_PER_TOKEN, Links, call_geometry
from planning.dataflow import MFC, ROLES, Graph
from planning.efficiency import OpEfficiency
from planning.layout import ClusterSpec, Layout
from planning.models import ModelSpec
from planning.offload import check_fractions, normalized
from planning.plan import CallExecution, ExecutionPlan, Placement, check_execution_kind


@dataclass(frozen=True)
class ModelRole:
    """The model one role runs: its shapes and whether it has a scalar value head."""

    spec: ModelSpec
    critic: bool

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ModelSpec):
            raise ValueError(f"ModelRole.spec={self.spec!r}: must be a planning.models.ModelSpec")


@dataclass(frozen=True)
class PlanningProblem:
    """Everything the planner needs: the dataflow graph, the cluster and one model per role."""

    graph: Graph
    cluster: ClusterSpec
    models: dict[str, ModelRole]
    efficiency: OpEfficiency = field(default_factory=OpEfficiency)
    memory_margin: float = 0.0  # fraction of each GPU's memory no plan may use
    memory_scale: float = 1.0  # multiplies the transient bytes (calibrated from measured peaks)
    # (role, fraction) of each trained role's optimizer state kept in host memory (planning.offload).
    optimizer_offload: tuple[tuple[str, float], ...] = ()
    # Whether search_plan may choose an offload when no plan fits without it (False: exactly the above).
    auto_offload: bool = True

    def __post_init__(self) -> None:
        for role in self.models:
            if role not in ROLES:
                raise ValueError(f"PlanningProblem.models: role {role!r} unknown; allowed: {', '.join(ROLES)}")
        missing = [r for r in self.graph.roles if r not in self.models]
        if missing:
            raise ValueError(f"PlanningProblem.models: graph {self.graph.algorithm} uses roles {missing} without a model")
        if not 0.0 <= self.memory_margin < 1.0:
            raise ValueError(f"PlanningProblem.memory_margin={self.memory_margin}: must be in [0, 1)")
        if not self.memory_scale > 0.0:
            raise ValueError(f"PlanningProblem.memory_scale={self.memory_scale}: must be > 0")
        check_fractions("PlanningProblem.optimizer_offload", self.optimizer_offload, self.graph.trained_roles)

    def offload_fraction(self, role: str) -> float:
        """Fraction of `role`'s optimizer state in host memory (0.0: all on its GPUs)."""
        return dict(self.optimizer_offload).get(role, 0.0)

    def with_offload(self, fractions: dict[str, float]) -> PlanningProblem:
        """This problem with exactly these offload fractions (roles at 0 left out)."""
        return replace(self, optimizer_offload=normalized(fractions))

    def for_plan(self, plan: ExecutionPlan) -> PlanningProblem:
        """This problem with `plan`'s offload: a plan carries the offload it runs with, so its
        costs (simulate, reports) are always priced with that one."""
        if plan.optimizer_offload == self.optimizer_offload:
            return self
        return replace(self, optimizer_offload=plan.optimizer_offload)

    @property
    def mem_limit_bytes(self) -> float:
        """Memory per GPU a plan may use: the GPU's, less the margin."""
        return self.cluster.hardware.mem_bytes * (1.0 - self.memory_margin)


@dataclass(frozen=True)
class CallCost:
    """Predicted cost of one call. `breakdown` holds seconds (keys ending `_s`) and bytes
    (keys ending `_bytes`); time_s is the sum of the seconds, mem_bytes the sum of the bytes."""

    time_s: float
    mem_bytes: float
    feasible: bool
    breakdown: dict[str, float]
    reason: str = ""
    execution: CallExecution | None = None  # the micro-batching / rounds this cost assumes
    host_bytes: float = 0.0  # per GPU, optimizer state in pinned host memory (never in mem_bytes)


def rlhf_problem(
    graph: Graph, cluster: ClusterSpec, actor: ModelSpec, critic: ModelSpec | None = None,
    ref: ModelSpec | None = None, reward: ModelSpec | None = None, efficiency: OpEfficiency | None = None,
) -> PlanningProblem:
    """A problem for the roles `graph` uses. ref defaults to the actor's shapes, critic to the
    actor's, reward to the critic's; each role is still its own copy of the weights."""
    critic_spec = critic or actor
    specs = {"actor": (actor, False), "critic": (critic_spec, True), "ref": (ref or actor, False),
             "reward": (reward or critic_spec, True)}
    models = {role: ModelRole(*specs[role]) for role in graph.roles}
    return PlanningProblem(graph, cluster, models, efficiency or OpEfficiency())


def call_cost(problem: PlanningProblem, mfc: MFC, placement: Placement, mem_budget_bytes: float | None = None,
              execution: CallExecution | None = None) -> CallCost:
    """Time and memory of `mfc` on `placement` (see the module docstring for the model).

    mem_budget_bytes: memory per GPU this call may use (default: `problem.mem_limit_bytes`). Of
    the call's levels (`call_cost_levels`) the fastest that fits is taken; when none fits, the
    leanest is returned with feasible=False and the reason. `execution` prices exactly that
    micro-batching (or rounds) instead of choosing.
    """
    levels = call_cost_levels(problem, mfc, placement, execution)
    budget = problem.mem_limit_bytes if mem_budget_bytes is None else mem_budget_bytes
    fitting = [c for c in levels if c.feasible and c.mem_bytes <= budget]
    if fitting:
        return min(fitting, key=lambda c: (c.time_s, c.mem_bytes))
    leanest = min(levels, key=lambda c: c.mem_bytes)
    if not math.isfinite(leanest.mem_bytes):
        return leanest
    return replace(leanest, feasible=False, reason=_too_big(problem, leanest.mem_bytes, budget))


def call_cost_levels(problem: PlanningProblem, mfc: MFC, placement: Placement,
                     execution: CallExecution | None = None) -> list[CallCost]:
    """The call at every memory level, leanest last: training and inference with 1x, 2x, 4x ...
    the base number of micro-batches; generation in 1, 2, 4 ... rounds of sequences (each round
    holds only its own KV cache, and streams the weights again). With `execution`, the one level
    it names. A level is feasible when it fits `problem.mem_limit_bytes`; an illegal layout gives
    one infeasible level with infinite cost."""
    if mfc.model_free:
        return [model_free_cost(mfc, placement.layout)]
    if mfc.role not in problem.models:
        raise ValueError(f"call {mfc.name}: role {mfc.role!r} has no model in the problem")
    role = problem.models[mfc.role]
    layout = placement.layout
    geo = call_geometry(role.spec, role.critic, layout)
    if isinstance(geo, str):
        return [_infeasible(geo)]
    if mfc.multi_turn is not None and layout.pp > 1:
        return [_infeasible(MULTI_TURN_PP_REASON)]
    steps = mfc.n_minibatches if mfc.kind == "train" else 1
    if mfc.batch.n_seqs < layout.dp * steps:
        return [_infeasible(
            f"dp={layout.dp} x minibatches={steps} exceeds the {mfc.batch.n_seqs} sequences of {mfc.name}: "
            "a replica would get none"
        )]
    seqs = math.ceil(mfc.batch.n_seqs / (layout.dp * steps))  # per replica (per minibatch)
    links = Links(problem.cluster.hardware, problem.efficiency, placement)
    if execution is None:
        # Each level as the execution the plan will record (a token budget rounds the count).
        executions = list(dict.fromkeys(level_execution(mfc, seqs, split) for split in level_splits(mfc, layout, seqs)))
    else:
        check_execution_kind(mfc.name, mfc.kind, execution)
        executions = [execution]
    splits = [(split_of(mfc, seqs, e), e) for e in executions]
    levels = []
    for split, level in splits:
        host = 0.0
        if mfc.kind == "generate":
            parts = generate_parts(mfc, geo, layout, links, seqs, split)
        else:
            parts, host = forward_backward(mfc, geo, layout, links, seqs, split, problem.offload_fraction(mfc.role))
        for key in _TRANSIENT_KEYS:
            if key in parts:
                parts[key] *= problem.memory_scale
        # A call that runs several times per iteration (DAPO's extra generation rounds) costs that much more.
        time_s = sum(v for k, v in parts.items() if k.endswith("_s")) * mfc.expected_runs
        mem = sum(v for k, v in parts.items() if k.endswith("_bytes"))
        reason = "" if mem <= problem.mem_limit_bytes else _too_big(problem, mem, problem.mem_limit_bytes)
        levels.append(CallCost(time_s, mem, not reason, parts, reason, level, host))
    return levels


def model_free_cost(mfc: MFC, layout: Layout) -> CallCost:
    """A call that runs no model (`MFC.model_free`): host seconds for the response tokens of one
    dp replica's rows, no GPU memory, any layout."""
    rows = math.ceil(mfc.batch.n_seqs / layout.dp)
    per_token = MODEL_FREE_S_PER_TOKEN if mfc.host_s_per_token is None else mfc.host_s_per_token
    host_s = rows * mfc.batch.gen_len * per_token * mfc.expected_runs
    return CallCost(host_s, 0.0, True, {"host_s": host_s})


# Breakdown entries that grow with the work in flight (scaled by PlanningProblem.memory_scale).
_TRANSIENT_KEYS = ("activation_bytes", "kv_cache_bytes")


def _too_big(problem: PlanningProblem, need: float, budget: float) -> str:
    hw = problem.cluster.hardware
    if budget < problem.mem_limit_bytes:
        return f"needs {need / 2**30:.1f} GiB per GPU, {hw.name} has {budget / 2**30:.1f} GiB free"
    margin = f" ({problem.memory_margin:.0%} kept free)" if problem.memory_margin else ""
    return f"needs {need / 2**30:.1f} GiB per GPU, {hw.name} has {budget / 2**30:.1f} GiB{margin}"


def weight_bytes_per_gpu(role: ModelRole, layout: Layout) -> float:
    """bf16 weights on the fullest GPU of `layout` (raises ValueError for an illegal layout)."""
    geo = call_geometry(role.spec, role.critic, layout)
    if isinstance(geo, str):
        raise ValueError(geo)
    return 2.0 * geo.stage_params


# ---- internals -----------------------------------------------------------------------------------


def _infeasible(reason: str) -> CallCost:
    return CallCost(math.inf, math.inf, False, {}, reason)
