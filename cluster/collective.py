"""torch.distributed over the Ray workers: the world rendezvous and the process groups of a plan.

Rendezvous: rank 0's actor reports its node IP and a free port; every worker then joins one
world of all workers (`init_world`: NCCL on GPUs, gloo on CPU) with a timeout, so a stalled
collective raises instead of hanging forever.

Process groups: `list_process_groups` is a pure function of the plan's ordered (mesh, layout)
pairs and the reallocation rank sets. It lists every group any call needs (the mesh, tp, dp and
pp groups, the embedding group of first + last pipeline stage) as sorted global-rank tuples,
without duplicates, in one deterministic order. torch's `new_group` is collective over the
world, so every worker creates every listed group in that order, members or not
(`create_process_groups`), and keeps a mapping rank-tuple -> ProcessGroup (None where it is not
a member). Calls that share members share groups, so the count stays bounded by the plan.
Groups of one rank are not created: the engine treats a None group as "nothing to do".
`parallel_groups_for` builds the engine's `ParallelGroups` of one (mesh, layout) from the mapping.

Global rank = global GPU index = the worker's rank in `WorkerGroup` (see cluster/placement.py).
The driver-side helpers (`rendezvous`, `setup_process_groups`) run the worker-side functions
inside any worker class through `WorkerGroup.call_function`; the worker receives its groups by
one method, `set_process_groups(groups)`, so it never imports this module.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.engine import ParallelGroups, world_timeout
from cluster.placement import WorkerGroup
from planning.layout import Layout, Mesh
from planning.plan import ExecutionPlan

GroupRanks = tuple[int, ...]
BACKENDS = ("nccl", "gloo")
ATTACH_METHOD = "set_process_groups"


# ---- the group listing (pure) -------------------------------------------------------------------


def layout_group_ranks(mesh: Mesh, layout: Layout) -> list[GroupRanks]:
    """Groups of one call, as global ranks: mesh, tp, dp, pp (+ embedding when pp > 1).

    Same order as `actors.engine.process_groups.build_parallel_groups`; size-1 groups are left out.
    """
    if layout.world_size != mesh.size:
        raise ValueError(f"layout {layout} has {layout.world_size} ranks but mesh {mesh} has {mesh.size} GPUs")
    ranks = list(mesh.gpus)
    groups: list[list[int]] = [ranks]
    groups += [[ranks[r] for r in layout.tp_group(d, p)] for p in range(layout.pp) for d in range(layout.dp)]
    groups += [[ranks[r] for r in layout.dp_group(t, p)] for p in range(layout.pp) for t in range(layout.tp)]
    for d in range(layout.dp):
        for t in range(layout.tp):
            column = [ranks[r] for r in layout.pp_group(d, t)]
            groups.append(column)
            if layout.pp > 1:
                groups.append([column[0], column[-1]])
    return [tuple(sorted(g)) for g in groups if len(g) > 1]


def plan_placements(plan: ExecutionPlan) -> list[tuple[Mesh, Layout]]:
    """The (mesh, layout) of every call of `plan`, in its call order."""
    return [(placement.mesh, placement.layout) for _, placement in plan.placements]


def list_process_groups(
    placements: Iterable[tuple[Mesh, Layout]],
    realloc_groups: Iterable[Iterable[int]] = (),
    world_size: int | None = None,
) -> tuple[GroupRanks, ...]:
    """Every group a plan needs, deduplicated, in a deterministic order.

    placements: (mesh, layout) per call, in the plan's call order.
    realloc_groups: rank sets of the reallocation collectives (any order inside a set).
    world_size: when given, every rank must be below it.
    Order: each placement's groups (see `layout_group_ranks`), then the reallocation groups;
    a group already listed keeps its first position.
    """
    listed: dict[GroupRanks, None] = {}  # an insertion-ordered set
    for mesh, layout in placements:
        for group in layout_group_ranks(mesh, layout):
            listed.setdefault(group, None)
    for rank_set in realloc_groups:
        group = tuple(sorted(set(rank_set)))
        if any(not isinstance(r, int) or r < 0 for r in group):
            raise ValueError(f"realloc group {sorted(set(rank_set))}: ranks must be non-negative integers")
        if len(group) > 1:
            listed.setdefault(group, None)
    if world_size is not None:
        for group in listed:
            if group[-1] >= world_size:
                raise ValueError(f"group {list(group)}: rank {group[-1]} outside the world of {world_size} workers")
    return tuple(listed)


# ---- worker side: runs inside each worker process ----------------------------------------------


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a TCP port free on it a moment ago (rank 0 hosts the store there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
    return ray.util.get_node_ip_address(), port


def init_world(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
               timeout_s: float) -> None:
    """Join the world of all workers. Collectives slower than `timeout_s` raise.

    NCCL: the worker's GPU is cuda:0 (Ray sets CUDA_VISIBLE_DEVICES to its one GPU).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed: {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}: must be positive")
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literals need brackets
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{master_port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s), **kwargs,
    )


def create_process_groups(groups: Sequence[GroupRanks]) -> dict[GroupRanks, ProcessGroup | None]:
    """Create every group in order, on every rank; this rank's handle or None per group.

    A group of all ranks reuses the default world group instead of creating a new one.
    """
    me, world = dist.get_rank(), dist.get_world_size()
    everyone = tuple(range(world))
    timeout = world_timeout()  # the world's collective timeout for every group (torch: 30 min)
    mapping: dict[GroupRanks, ProcessGroup | None] = {}
    for group in groups:
        if group == everyone:
            mapping[group] = dist.group.WORLD
            continue
        handle = dist.new_group(list(group), timeout=timeout)
        mapping[group] = handle if me in group else None
    return mapping


def parallel_groups_for(groups: Mapping[GroupRanks, ProcessGroup | None], mesh: Mesh, layout: Layout,
                        rank: int) -> ParallelGroups | None:
    """`ParallelGroups` of global rank `rank` for a call on (mesh, layout); None outside the mesh."""
    if rank not in mesh.gpus:
        return None
    if layout.world_size != mesh.size:
        raise ValueError(f"layout {layout} has {layout.world_size} ranks but mesh {mesh} has {mesh.size} GPUs")
    ranks = list(mesh.gpus)
    dp_rank, tp_rank, pp_rank = layout.coords(rank - mesh.start)
    pp_column = tuple(ranks[r] for r in layout.pp_group(dp_rank, tp_rank))

    def lookup(members: Sequence[int]) -> ProcessGroup | None:
        key = tuple(sorted(members))
        if len(key) < 2:
            return None
        if key not in groups:
            raise KeyError(f"group {list(key)} of {layout} on {mesh} was not created; list it with list_process_groups")
        return groups[key]

    return ParallelGroups(
        layout=layout,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        tp_group=lookup([ranks[r] for r in layout.tp_group(dp_rank, pp_rank)]),
        dp_group=lookup([ranks[r] for r in layout.dp_group(tp_rank, pp_rank)]),
        pp_group=lookup(pp_column),
        mesh_group=lookup(ranks),
        embedding_group=lookup([pp_column[0], pp_column[-1]]) if layout.pp > 1 else None,
        pp_global_ranks=pp_column,
        dp_global_ranks=tuple(ranks[r] for r in layout.dp_group(tp_rank, pp_rank)),
    )


# ---- driver side --------------------------------------------------------------------------------


def rendezvous(workers: WorkerGroup, backend: str, timeout_s: float = 600.0) -> tuple[str, int]:
    """Start the world over all workers; returns the (address, port) rank 0 hosted it on."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed: {', '.join(BACKENDS)}")
    [address] = workers.get(workers.call_function(_report_address, ranks=[0]), timeout_s)
    master_addr, master_port = address
    world = workers.world_size
    args = {rank: (rank, world, master_addr, master_port, backend, timeout_s) for rank in range(world)}
    # Joining blocks until all ranks arrived, so the wait gets a little longer than the timeout.
    workers.get(workers.call_function_per_rank(_join_world, args), timeout_s + 60.0)
    return master_addr, master_port


def setup_process_groups(workers: WorkerGroup, placements: Iterable[tuple[Mesh, Layout]],
                         realloc_groups: Iterable[Iterable[int]] = (),
                         timeout_s: float = 600.0) -> tuple[GroupRanks, ...]:
    """Create the plan's groups on every worker and hand each its mapping.

    Each worker gets `set_process_groups(groups)` called with its rank-tuple -> ProcessGroup
    mapping. Returns the group listing (the mapping's keys, in creation order).
    """
    listing = list_process_groups(placements, realloc_groups, world_size=workers.world_size)
    workers.get(workers.call_function(_create_and_attach, listing), timeout_s)
    return listing


def _report_address(worker: object) -> tuple[str, int]:
    return rendezvous_address()


def _join_world(worker: object, rank: int, world_size: int, master_addr: str, master_port: int,
                backend: str, timeout_s: float) -> None:
    init_world(rank, world_size, master_addr, master_port, backend, timeout_s)


def _create_and_attach(worker: object, listing: Sequence[GroupRanks]) -> int:
    """Worker side of `setup_process_groups`; returns how many groups this rank belongs to."""
    attach = getattr(worker, ATTACH_METHOD, None)
    # Checked before any new_group: every worker has the same class, so all fail alike, none hangs.
    if not callable(attach):
        raise TypeError(f"{type(worker).__name__} has no method {ATTACH_METHOD}(groups) to receive its process groups")
    mapping = create_process_groups(listing)
    attach(mapping)
    return sum(handle is not None for handle in mapping.values())
