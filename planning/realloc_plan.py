"""Parameter reallocation plans: who sends which slice of which parameter to whom.

A model held under (source mesh, source layout) must end up under (destination mesh, destination
layout). The plan is a pure, deterministic function of the model's parameter shapes, the split
rules of `planning.models` and the two placements: every rank computes the same list, and the
executor (`actors.realloc.executor`) only moves bytes in that order.

Each `Transfer` sends one slice (a range along one dimension, or the whole tensor) of one
parameter from one source GPU to a set of destination GPUs (a broadcast when there are several,
a local copy when the only destination is the source GPU itself). Sources are chosen per
destination node: a source on the destination GPU itself first, then one on the same node,
then the least-loaded source elsewhere; ties go to the lowest GPU index. Data-parallel replicas
of the destination all need the same bytes, so one source broadcasts to all of them on a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from planning.layout import ClusterSpec
from planning.models import (
    ModelSpec,
    ParamSpec,
    kv_replicated,
    param_specs,
    pipeline_partition,
    stages_holding,
    tp_split_dim,
    validate_tp,
)
from planning.plan import Placement


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """The part of a full parameter one rank holds: rows/columns [start, stop) along `dim`,
    or the whole tensor when `dim` is None."""

    dim: int | None
    start: int
    stop: int

    def intersect(self, other: ShardSlice) -> ShardSlice | None:
        if self.dim is None:
            return other
        if other.dim is None:
            return self
        assert self.dim == other.dim, (self, other)
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return ShardSlice(self.dim, start, stop) if start < stop else None

    def numel(self, shape: tuple[int, ...]) -> int:
        n = 1
        for i, s in enumerate(shape):
            n *= (self.stop - self.start) if i == self.dim else s
        return n

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple((self.stop - self.start) if i == self.dim else s for i, s in enumerate(shape))


def shard_slice(spec: ModelSpec, param: ParamSpec, tp: int, tp_rank: int) -> ShardSlice:
    """The slice of `param` that tensor-parallel rank `tp_rank` of `tp` holds."""
    dim = tp_split_dim(param.name, spec, tp)
    if dim is None:
        return ShardSlice(None, 0, param.shape[0])
    size = param.shape[dim] // tp
    return ShardSlice(dim, tp_rank * size, (tp_rank + 1) * size)


def rank_params(
    spec: ModelSpec, critic: bool, placement: Placement, rank: int
) -> list[tuple[ParamSpec, ShardSlice]]:
    """Every parameter (with its slice) that mesh rank `rank` of `placement` holds."""
    layout = placement.layout
    _, tp_rank, pp_rank = layout.coords(rank)
    partition = pipeline_partition(spec, layout.pp, critic)
    out = []
    for param in param_specs(spec, critic):
        if pp_rank in stages_holding(param, spec, partition, critic):
            out.append((param, shard_slice(spec, param, layout.tp, tp_rank)))
    return out


@dataclass(frozen=True, slots=True)
class Transfer:
    """Send `piece` of parameter `param` from GPU `src_gpu` to every GPU of `dst_gpus`."""

    param: str
    shape: tuple[int, ...]  # the full parameter's shape
    piece: ShardSlice
    src_gpu: int
    dst_gpus: tuple[int, ...]

    @property
    def is_local(self) -> bool:
        return self.dst_gpus == (self.src_gpu,)

    @property
    def numel(self) -> int:
        return self.piece.numel(self.shape)

    @property
    def group(self) -> tuple[int, ...]:
        """The communicator a broadcast of this transfer runs in: source first, sorted receivers."""
        return (self.src_gpu,) + tuple(g for g in self.dst_gpus if g != self.src_gpu)


@dataclass(frozen=True)
class ReallocPlan:
    """Transfers in the order every rank executes them."""

    transfers: tuple[Transfer, ...]
    gpus_per_node: int

    def bytes_per_link(self, dtype_bytes: int = 2) -> dict[tuple[int, int], int]:
        """Bytes received per (source GPU, destination GPU) pair; local copies excluded."""
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            nbytes = t.numel * dtype_bytes
            for d in t.dst_gpus:
                if d != t.src_gpu:
                    out[(t.src_gpu, d)] = out.get((t.src_gpu, d), 0) + nbytes
        return out

    def total_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes that cross a link (local copies excluded)."""
        return sum(self.bytes_per_link(dtype_bytes).values())

    def local_bytes(self, dtype_bytes: int = 2) -> int:
        return sum(t.numel * dtype_bytes for t in self.transfers if t.src_gpu in t.dst_gpus)

    @property
    def n_steps(self) -> int:
        """Number of communication steps (non-local transfers)."""
        return sum(1 for t in self.transfers if not t.is_local)

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Distinct communicator member sets (sorted), in first-use order."""
        seen: dict[tuple[int, ...], None] = {}
        for t in self.transfers:
            if not t.is_local:
                seen.setdefault(tuple(sorted(t.group)), None)
        return tuple(seen)


def check_compatible(spec: ModelSpec, src: Placement, dst: Placement) -> None:
    """Raise ValueError when a reallocation between the two layouts is not supported."""
    a, b = src.layout.tp, dst.layout.tp
    if a % b and b % a:
        raise ValueError(f"reallocation of {spec.name}: tp degrees {a} -> {b} do not divide each other")
    validate_tp(spec, a)
    validate_tp(spec, b)
    # A tp=1 side holds every head, which is compatible with both regimes; between two tp>1
    # sides, one splitting K/V heads and one replicating them, shards do not line up by rank.
    if a > 1 and b > 1 and kv_replicated(spec, a) != kv_replicated(spec, b):
        raise ValueError(
            f"reallocation of {spec.name}: K/V heads ({spec.n_kv_heads}) are split under tp={a if not kv_replicated(spec, a) else b} "
            f"but replicated under tp={b if not kv_replicated(spec, a) else a}; choose tp degrees on the same side of n_kv_heads"
        )


def plan_reallocation(spec: ModelSpec, critic: bool, src: Placement, dst: Placement) -> ReallocPlan:
    """The transfers that take the model from `src` to `dst` (see the module docstring)."""
    check_compatible(spec, src, dst)
    return ReallocPlan(tuple(_transfers(spec, critic, src, dst, param_specs(spec, critic))), src.mesh.gpus_per_node)


def estimate_realloc_s(spec: ModelSpec, critic: bool, src: Placement, dst: Placement, cluster: ClusterSpec,
                       dtype_bytes: int = 2) -> float:
    """`realloc_time_s` of the plan, computed fast for the search.

    Decoder blocks whose (source stage, destination stage) pair is the same are routed the same
    way, so one representative block per pair is planned and its traffic scaled by the count.
    """
    if src == dst:
        return 0.0
    check_compatible(spec, src, dst)
    src_part = pipeline_partition(spec, src.layout.pp, critic)
    dst_part = pipeline_partition(spec, dst.layout.pp, critic)
    weight: dict[int, int] = {}  # representative layer -> number of layers it stands for
    first: dict[tuple[int, int], int] = {}
    for layer in range(spec.n_layers):
        key = (_stage_of(layer, src_part), _stage_of(layer, dst_part))
        rep = first.setdefault(key, layer)
        weight[rep] = weight.get(rep, 0) + 1
    params = [p for p in param_specs(spec, critic) if not 0 <= p.layer < spec.n_layers or p.layer in weight]
    plan = ReallocPlan(tuple(_transfers(spec, critic, src, dst, params)), src.mesh.gpus_per_node)
    layer_of = {p.name: p.layer for p in params}
    scale = {name: weight.get(layer, 1) for name, layer in layer_of.items()}
    return realloc_time_s(plan, cluster, dtype_bytes, scale)


def _stage_of(layer: int, partition: list[tuple[int, int]]) -> int:
    for stage, (start, end) in enumerate(partition):
        if start <= layer < end:
            return stage
    raise AssertionError(layer)


def _transfers(
    spec: ModelSpec, critic: bool, src: Placement, dst: Placement, params: list[ParamSpec]
) -> list[Transfer]:
    holders = _holders(spec, critic, src, params)
    needers = _holders(spec, critic, dst, params)
    load: dict[int, int] = {}  # bytes each source GPU already sends, for load balancing
    transfers: list[Transfer] = []
    for param in params:
        for dst_piece, dst_gpus in _group_by_piece(needers[param.name]):
            for src_piece, src_gpus in _group_by_piece(holders[param.name]):
                piece = src_piece.intersect(dst_piece)
                if piece is not None:
                    transfers.extend(_route(param, piece, src_gpus, dst_gpus, load, src.mesh.gpus_per_node))
    return transfers


def realloc_time_s(
    plan: ReallocPlan, cluster: ClusterSpec, dtype_bytes: int = 2, scale: dict[str, int] | None = None
) -> float:
    """Estimated seconds to execute `plan`.

    Each GPU's NVLink and NIC carry its sends and receives; a broadcast costs the sender one
    copy of the bytes per link kind it uses (pipelined chain) and each receiver one copy.
    The busiest link of any GPU sets the time; every non-local step adds one latency, and
    local copies read and write HBM once.
    """
    hw = cluster.hardware
    m = plan.gpus_per_node
    busy: dict[tuple[int, str, str], float] = {}  # (gpu, 'send'|'recv', 'intra'|'inter') -> bytes
    local = 0.0
    steps = 0
    for t in plan.transfers:
        times = scale.get(t.param, 1) if scale else 1
        nbytes = t.numel * dtype_bytes * times
        steps += 0 if t.is_local else times
        kinds_sent = set()
        for d in t.dst_gpus:
            if d == t.src_gpu:
                local += nbytes
                continue
            kind = "intra" if d // m == t.src_gpu // m else "inter"
            kinds_sent.add(kind)
            busy[(d, "recv", kind)] = busy.get((d, "recv", kind), 0.0) + nbytes
        for kind in kinds_sent:
            busy[(t.src_gpu, "send", kind)] = busy.get((t.src_gpu, "send", kind), 0.0) + nbytes
    link_s = max((b / (hw.intra_node_bw if k[2] == "intra" else hw.inter_node_bw) for k, b in busy.items()), default=0.0)
    return link_s + steps * hw.collective_latency_s + 2 * local / hw.hbm_bw


# ---- helpers -------------------------------------------------------------------------------------


def _holders(
    spec: ModelSpec, critic: bool, placement: Placement, params: list[ParamSpec]
) -> dict[str, list[tuple[int, ShardSlice]]]:
    """Parameter name -> [(global GPU, slice it holds)] over every rank of the placement."""
    layout = placement.layout
    partition = pipeline_partition(spec, layout.pp, critic)
    stages = {p.name: stages_holding(p, spec, partition, critic) for p in params}
    slices = {(p.name, t): shard_slice(spec, p, layout.tp, t) for p in params for t in range(layout.tp)}
    out: dict[str, list[tuple[int, ShardSlice]]] = {p.name: [] for p in params}
    for rank in range(layout.world_size):
        gpu = placement.gpu_of_rank(rank)
        _, tp_rank, pp_rank = layout.coords(rank)
        for p in params:
            if pp_rank in stages[p.name]:
                out[p.name].append((gpu, slices[(p.name, tp_rank)]))
    return out


def _group_by_piece(holders: list[tuple[int, ShardSlice]]) -> list[tuple[ShardSlice, list[int]]]:
    """Group GPUs holding the same slice, slices in increasing order."""
    groups: dict[ShardSlice, list[int]] = {}
    for gpu, piece in holders:
        groups.setdefault(piece, []).append(gpu)
    return sorted(groups.items(), key=lambda kv: (kv[0].start, kv[0].stop))


def _route(
    param: ParamSpec, piece: ShardSlice, src_gpus: list[int], dst_gpus: list[int], load: dict[int, int],
    gpus_per_node: int,
) -> list[Transfer]:
    """Pick a source for every destination GPU of one piece and group destinations by source."""
    nbytes = piece.numel(param.shape)
    sources = set(src_gpus)
    by_source: dict[int, list[int]] = {}
    remote: dict[int, list[int]] = {}  # destination node -> GPUs that have no local copy
    for d in dst_gpus:
        if d in sources:
            by_source.setdefault(d, []).append(d)
        else:
            remote.setdefault(d // gpus_per_node, []).append(d)
    for node, gpus in sorted(remote.items()):
        same_node = [s for s in src_gpus if s // gpus_per_node == node]
        candidates = same_node or src_gpus
        src = min(candidates, key=lambda s: (load.get(s, 0), s))
        load[src] = load.get(src, 0) + nbytes
        by_source.setdefault(src, []).extend(gpus)
    out = []
    for src, gpus in sorted(by_source.items()):
        local = [src] if src in gpus else []
        others = sorted(g for g in gpus if g != src)
        if local:
            out.append(Transfer(param.name, param.shape, piece, src, (src,)))
        if others:
            out.append(Transfer(param.name, param.shape, piece, src, tuple(others)))
    return out
