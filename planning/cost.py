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
pipeline and at most `planning.call_levels.MAX_MICRO_TOKENS` tokens each), or generation in
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
from planning.cost_multiturn import MULTI_TURN_PP_REASON, observation_bytes, observation_parts, trajectory
from planning.cost_terms import (
    CASCADE_OVERHEAD_KERNELS,
    GRAD_ACCUMULATION_TRAFFIC_PER_PARAM,
    MODEL_FREE_S_PER_TOKEN,
    OPTIMIZER_TRAFFIC_PER_PARAM,
    SAMPLING_BYTES_PER_LOGIT,
    CallGeometry,
    Links,
    OpEfficiency,
    activation_bytes,
    allreduce_s,
    call_geometry,
    decode_stage_s,
    forward_tokens,
    inference_bytes_per_token_layer,
    reduce_scatter_s,
    sampling_s,
)
from planning.dataflow import MFC, ROLES, Graph
from planning.layout import ClusterSpec, Layout
from planning.models import ModelSpec
from planning.offload import check_fractions, normalized, optimizer_parts
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
            parts = _generate(mfc, geo, layout, links, seqs, split)
        else:
            parts, host = _forward_backward(mfc, geo, layout, links, seqs, split, problem.offload_fraction(mfc.role))
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
    host_s = rows * mfc.batch.gen_len * MODEL_FREE_S_PER_TOKEN * mfc.expected_runs
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


def _pass_time(
    geo: CallGeometry, layout: Layout, links: Links, tokens: int, n_micro: int, ctx: float, passes: int,
) -> dict[str, float]:
    """Seconds of `passes` sweeps (1 = forward, 3 = forward + backward) over `tokens` tokens of
    one replica split into `n_micro` micro-batches, on the slowest pipeline stage."""
    hidden = geo.spec.hidden_size
    mb_tokens = tokens / n_micro
    # Roofline per micro-batch and pass: the matmuls cannot beat streaming the stage's bf16
    # weights from HBM once, so short micro-batches are memory-bound, not free.
    # Each micro-batch's GEMMs also pay a ramp and a partly filled last wave, about as long as
    # `gemm_ramp_tokens` more tokens (on an H200, 512: an 8B model's 1024-token micro-batches run
    # ~2/3 as fast as long ones).
    matmul_s = (mb_tokens + links.hw.gemm_ramp_tokens) * geo.stage_flops_per_token(ctx) / links.flops
    compute = passes * n_micro * max(matmul_s, 2.0 * geo.stage_params / links.hbm)
    # Norms, residuals, rotary, activations: memory-bound, and mostly not split by tp.
    elementwise = passes * tokens * geo.stage_layers * geo.layer_elementwise_bytes / links.elementwise_hbm
    overhead = passes * n_micro * geo.stage_layers * links.hw.kernel_overhead_s
    # 2 all-reduces of a (mb_tokens, hidden) bf16 activation per layer per direction.
    directions = 1 if passes == 1 else 2
    tp = directions * n_micro * geo.stage_layers * 2 * allreduce_s(mb_tokens * hidden * 2, layout.tp, links.tp_bw, links.lat)
    stage = compute + elementwise + overhead + tp
    out = {"compute_s": compute, "elementwise_s": elementwise, "kernel_overhead_s": overhead, "tp_comm_s": tp}
    if layout.pp > 1:
        out["pp_bubble_s"] = stage * (layout.pp - 1) / n_micro
        # Each micro-batch crosses pp-1 stage boundaries per direction; sends overlap compute
        # except along the pipeline's fill/drain path (n_micro + pp - 1 sends).
        send = links.lat + mb_tokens * hidden * 2 / links.pp_bw
        out["pp_p2p_s"] = directions * (n_micro + layout.pp - 1) * send
    return out


def _cascade_s(mfc: MFC, geo: CallGeometry, links: Links, n_micro: int, passes: int) -> float:
    """The shared prompts' cascade attention: fixed time per block, micro-batch and pass (0
    where the rows share no prompt)."""
    if mfc.batch.prompt_group <= 1 or mfc.batch.prompt_len == 0:
        return 0.0
    return passes * n_micro * geo.stage_layers * CASCADE_OVERHEAD_KERNELS * links.hw.kernel_overhead_s


def _forward_backward(
    mfc: MFC, geo: CallGeometry, layout: Layout, links: Links, seqs: int, n_micro: int, offload: float = 0.0,
) -> tuple[dict[str, float], float]:
    """Inference (one forward) or training (forward + backward + optimizer per minibatch) of
    `seqs` sequences per replica in `n_micro` micro-batches, and the host bytes per GPU (the
    `offload` fraction of the optimizer state, planning.offload)."""
    train = mfc.kind == "train"
    steps = mfc.n_minibatches if train else 1
    tokens, ctx = forward_tokens(mfc.batch, seqs, steps)
    parts = {k: steps * v for k, v in _pass_time(geo, layout, links, tokens, n_micro, ctx, 3 if train else 1).items()}
    if cascade := _cascade_s(mfc, geo, links, n_micro, 3 if train else 1):
        parts["cascade_s"] = steps * cascade
    parts["weights_bytes"] = 2.0 * geo.stage_params
    parts["activation_bytes"] = activation_bytes(geo, layout, tokens / n_micro, min(layout.pp, n_micro), train,
                                                  mfc.with_entropy, links.hw.fused_elementwise)
    parts["micro_batches"] = float(n_micro)  # informational: neither seconds nor bytes
    if train and mfc.recompute_forward:
        # One forward over the replica's whole batch (every minibatch), in micro-batches of the
        # same token budget, before the optimizer steps.
        all_seqs = math.ceil(mfc.batch.n_seqs / layout.dp)
        n_all = min(all_seqs, max(1, math.ceil(all_seqs * n_micro / seqs)))
        all_tokens, all_ctx = forward_tokens(mfc.batch, all_seqs, 1)
        forward = _pass_time(geo, layout, links, all_tokens, n_all, all_ctx, 1)
        parts["recompute_s"] = sum(forward.values()) + _cascade_s(mfc, geo, links, n_all, 1)
    if train:
        # Gradients accumulate in fp32 (the optimizer's main_grad, actors.engine.optimizer), the
        # buffer ZeRO-1 reduce-scatters; the updated fp32 master slices are all-gathered back.
        grad_bytes = 4.0 * geo.stage_params
        parts["dp_comm_s"] = steps * 2 * reduce_scatter_s(grad_bytes, layout.dp, links.dp_bw, links.lat)
        shard = geo.stage_params / layout.dp
        parts["optimizer_s"] = steps * (shard * OPTIMIZER_TRAFFIC_PER_PARAM / links.opt_hbm + links.hw.kernel_overhead_s)
        # The linear layers add their weight gradients into that buffer inside the GEMM
        # (actors.engine.main_grad_linear); the rest (embedding, head, norms) pass through .grad.
        hooked = max(0.0, geo.stage_params - geo.stage_layers * geo.layer_matmul_flops / 2)
        parts["grad_accumulation_s"] = steps * n_micro * hooked * GRAD_ACCUMULATION_TRAFFIC_PER_PARAM / links.opt_hbm
        parts["grad_bytes"] = grad_bytes
        optimizer, host = optimizer_parts(shard, offload, links.hw.host_bw, steps)
        parts.update(optimizer)
        return parts, host
    return parts, 0.0


def _generate(mfc: MFC, geo: CallGeometry, layout: Layout, links: Links, seqs: int, rounds: int) -> dict[str, float]:
    """`rounds` rounds, each a prefill of its prompts then gen_len decode steps, memory- or
    compute-bound per step; only one round's KV cache is alive at a time. Multi-turn: every
    turn's decode steps, observation prefills and environment waits (planning.cost_multiturn)."""
    batch = mfc.batch
    traj = trajectory(batch, mfc.multi_turn)
    spec = geo.spec
    per_round = math.ceil(seqs / rounds)
    # A round prefills its prompts in one packed pass (pp = 1), each distinct prompt once (a
    # group of samples shares it), or every row's prompt in one pass per pipeline micro-batch.
    distinct = math.ceil(per_round / batch.prompt_group) if layout.pp == 1 else per_round
    prompt_tokens = distinct * max(batch.prompt_len, 1)
    n_prefill = min(per_round, layout.pp)
    prefill = _pass_time(geo, layout, links, prompt_tokens, n_prefill, batch.prompt_len / 2, 1)
    parts = {"prefill_s": prefill.pop("compute_s")}
    parts.update(prefill)
    # Decode: a round is cut into min(seqs, pp) micro-batches so every stage has work; each
    # step every stage streams its weights once per micro-batch plus that micro-batch's KV cache.
    weights = 2.0 * geo.stage_params
    n_mb = min(per_round, layout.pp)
    mb = per_round / n_mb
    # Rows of one prompt read its cached K/V from one copy (the Triton decode attention's shared
    # prefix, pp = 1): HBM serves a group's prompt slots once, L2 the rest.
    shared = batch.prompt_len * (1 - 1 / batch.prompt_group) if layout.pp == 1 else 0.0
    per_mb_stage = decode_stage_s(geo, links, mb, traj.ctx - shared)
    tp_s = geo.stage_layers * 2 * allreduce_s(mb * spec.hidden_size * 2, layout.tp, links.tp_bw, links.lat)
    slots = max(n_mb, layout.pp)  # a step takes max(n_mb, pp) stage slots in steady state
    steps = traj.decode_steps
    parts["decode_s"] = steps * slots * per_mb_stage
    # The last stage samples every micro-batch every step; it is then the busiest stage.
    parts["sampling_s"] = steps * slots * sampling_s(spec.vocab_size, mb, layout.tp, links, mfc.truncated_sampling)
    parts["kernel_overhead_s"] = parts.get("kernel_overhead_s", 0.0) + steps * slots * geo.stage_layers * links.hw.kernel_overhead_s
    parts["setup_s"] = geo.stage_layers * links.hw.generate_setup_s
    parts["tp_comm_s"] = parts.get("tp_comm_s", 0.0) + steps * slots * tp_s
    if layout.pp > 1:
        send = links.lat + mb * spec.hidden_size * 2 / links.pp_bw
        parts["pp_p2p_s"] = parts.get("pp_p2p_s", 0.0) + steps * slots * send
        parts["pp_bubble_s"] = parts.get("pp_bubble_s", 0.0) + (layout.pp - 1) * per_mb_stage  # pipeline fill
    if mfc.multi_turn is not None:
        parts.update(observation_parts(geo, layout, links, per_round, traj))
    parts = {k: rounds * v for k, v in parts.items()}
    parts["weights_bytes"] = weights
    parts["kv_cache_bytes"] = per_round * traj.kv_slots * geo.kv_bytes_per_token_layer * geo.stage_layers
    # Prefill keeps the logits of each prompt's last token only, so its peak is a block's working
    # set (plus, for shared prompts, a layer's K/V copied out to every row); sampling's
    # [rows, vocab] buffers (gathered on tp rank 0) are the other candidate.
    prefill_bytes = prompt_tokens / n_prefill * inference_bytes_per_token_layer(spec, layout.tp)
    if distinct < per_round:
        prefill_bytes += per_round * batch.prompt_len * geo.kv_bytes_per_token_layer
    parts["activation_bytes"] = max(prefill_bytes, per_round * spec.vocab_size * SAMPLING_BYTES_PER_LOGIT,
                                    observation_bytes(geo, layout, per_round, traj))
    parts["generation_rounds"] = float(rounds)  # informational
    return parts
