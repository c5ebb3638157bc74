"""Process groups of one (dp, tp, pp) layout, and helpers to start gloo worlds for tests.

`ParallelGroups` is the frozen value every parallel component takes explicitly (no globals):
the rank's coordinates in the layout, its tp/dp/pp groups, the group over the whole mesh (for
global gradient norms), the embedding group that keeps tied embeddings of the first and last
pipeline stage in sync, and the global ranks of its pipeline and dp peers (for p2p and
broadcasts, which torch addresses by global rank).

Groups of size 1 are stored as None: every collective helper treats None as "nothing to do",
so a serial model runs the same code path without communication.

`build_parallel_groups` must be called by every rank of the default world in the same order
(torch's `new_group` is collective over the world), including ranks outside the mesh, which
get None back. Every group gets the world's collective timeout (`world_timeout`): torch would
otherwise give each new group its own default of 30 minutes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from planning.layout import Layout


@dataclass(frozen=True)
class ParallelGroups:
    """Where one rank sits in a layout and the groups it talks over."""

    layout: Layout
    dp_rank: int
    tp_rank: int
    pp_rank: int
    tp_group: ProcessGroup | None
    dp_group: ProcessGroup | None
    pp_group: ProcessGroup | None
    mesh_group: ProcessGroup | None
    # First + last pipeline stage of this (dp, tp) column; None unless pp > 1.
    embedding_group: ProcessGroup | None
    # Global rank of every stage of this rank's pipeline (index = pp rank).
    pp_global_ranks: tuple[int, ...]
    # Global rank of every dp replica holding this rank's (tp, pp) shard (index = dp rank).
    dp_global_ranks: tuple[int, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of the previous pipeline stage (only valid when not the first stage)."""
        if self.is_first_stage:
            raise ValueError(f"pp_rank={self.pp_rank}: the first stage has no previous stage")
        return self.pp_global_ranks[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (only valid when not the last stage)."""
        if self.is_last_stage:
            raise ValueError(f"pp_rank={self.pp_rank}: the last stage has no next stage")
        return self.pp_global_ranks[self.pp_rank + 1]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_global_ranks[-1]

    @staticmethod
    def serial() -> ParallelGroups:
        """Groups of a single-process run: every group None, one rank at (0, 0, 0)."""
        return ParallelGroups(Layout(), 0, 0, 0, None, None, None, None, None, (0,), (0,))


def group_size(group: ProcessGroup | None) -> int:
    """World size of a group; None (a size-1 group) counts 1."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside a group; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def broadcast_from_first(value: Any, group: ProcessGroup | None) -> Any:
    """The group's first rank's `value` (any picklable object) on every rank of it; a group of
    one (or None) returns `value` as it is. The other ranks pass anything (e.g. None)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def world_timeout() -> timedelta | None:
    """The collective timeout of the default (world) group, which every group we create shares;
    None without a world (or where torch does not expose it: new groups then get its default)."""
    if not dist.is_initialized():
        return None
    for device in ("cpu", "cuda"):
        try:  # torch keeps it on the backend's options; there is no public getter
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def build_parallel_groups(layout: Layout, mesh_ranks: list[int] | None = None) -> ParallelGroups | None:
    """Create the process groups of `layout` on the mesh of global ranks `mesh_ranks`.

    Collective over the default world: every rank calls it with the same arguments in the same
    order. mesh_ranks defaults to range(world_size) and must have layout.world_size entries.
    Returns this rank's groups, or None when this rank is not in the mesh.
    """
    world = dist.get_world_size()
    ranks = list(range(world)) if mesh_ranks is None else list(mesh_ranks)
    if len(ranks) != layout.world_size:
        raise ValueError(f"mesh_ranks has {len(ranks)} ranks; layout {layout} needs {layout.world_size}")
    if len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        raise ValueError(f"mesh_ranks={ranks}: must be distinct ranks in [0, {world})")
    me = dist.get_rank()
    mine: dict[str, ProcessGroup | None] = {}
    timeout = world_timeout()

    def make(kind: str, members: list[int]) -> None:
        # Size-1 groups are skipped on every rank alike, so creation order stays identical.
        if len(members) < 2:
            return
        group = dist.new_group(members, timeout=timeout)
        if me in members:
            mine[kind] = group

    make("mesh", ranks)
    for p in range(layout.pp):
        for d in range(layout.dp):
            make("tp", [ranks[r] for r in layout.tp_group(d, p)])
    for p in range(layout.pp):
        for t in range(layout.tp):
            make("dp", [ranks[r] for r in layout.dp_group(t, p)])
    for d in range(layout.dp):
        for t in range(layout.tp):
            column = [ranks[r] for r in layout.pp_group(d, t)]
            make("pp", column)
            if layout.pp > 1:
                make("embedding", [column[0], column[-1]])
    if me not in ranks:
        return None
    dp_rank, tp_rank, pp_rank = layout.coords(ranks.index(me))
    return ParallelGroups(
        layout=layout,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        tp_group=mine.get("tp"),
        dp_group=mine.get("dp"),
        pp_group=mine.get("pp"),
        mesh_group=mine.get("mesh"),
        embedding_group=mine.get("embedding"),
        pp_global_ranks=tuple(ranks[r] for r in layout.pp_group(dp_rank, tp_rank)),
        dp_global_ranks=tuple(ranks[r] for r in layout.dp_group(tp_rank, pp_rank)),
    )


def lookup_parallel_groups(layout: Layout, ranks: list[int], me: int,
                           lookup: Callable[[list[int]], ProcessGroup | None]) -> ParallelGroups:
    """Rank `me`'s groups on the mesh of global ranks `ranks` (mesh order) under `layout`, each
    found by `lookup(members)` among groups created before (None: a group of one rank)."""
    dp_rank, tp_rank, pp_rank = layout.coords(ranks.index(me))
    column = tuple(ranks[r] for r in layout.pp_group(dp_rank, tp_rank))
    dp_ranks = [ranks[r] for r in layout.dp_group(tp_rank, pp_rank)]
    return ParallelGroups(
        layout=layout, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank,
        tp_group=lookup([ranks[r] for r in layout.tp_group(dp_rank, pp_rank)]), dp_group=lookup(dp_ranks),
        pp_group=lookup(list(column)), mesh_group=lookup(ranks),
        embedding_group=lookup([column[0], column[-1]]) if layout.pp > 1 else None,
        pp_global_ranks=column, dp_global_ranks=tuple(dp_ranks),
    )


def destroy_parallel_groups(groups: ParallelGroups) -> None:
    """Free the groups this rank belongs to (each distinct group once)."""
    seen: set[int] = set()
    for group in (groups.tp_group, groups.dp_group, groups.pp_group, groups.mesh_group, groups.embedding_group):
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            dist.destroy_process_group(group)


# ---- gloo worlds for tests and CPU runs ---------------------------------------------------------


def node_address() -> tuple[str, int]:
    """This node's IP (the interface used for outbound traffic) and a free TCP port on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            ip = probe.getsockname()[0]
        except OSError:
            try:
                ip = socket.gethostbyname(socket.gethostname())
            except OSError:
                ip = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return ip, int(sock.getsockname()[1])


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_local_world(rank: int, world_size: int, port: int, backend: str = "gloo", threads: int = 1,
                     gpu: int | None = None) -> None:
    """Join a single-host world of `world_size` processes rendezvousing on localhost:`port`.

    backend "gloo" (CPU) or "nccl" (one GPU per rank: rank r uses cuda:r, or cuda:`gpu` when
    given, e.g. 0 where each process sees only its own GPU). Limits torch to `threads` intra-op
    threads: tests run several processes on few cores.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: allowed: gloo, nccl")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank if gpu is None else gpu)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def init_gloo_world(rank: int, world_size: int, port: int, threads: int = 1) -> None:
    """Join a localhost gloo world (see init_local_world)."""
    init_local_world(rank, world_size, port, "gloo", threads)



def reduce_scatter_flat(out: Tensor, flat: Tensor, group: ProcessGroup) -> None:
    """out [S] = this rank's slice of flat [S * world] summed over the group."""
    # reduce_scatter_single is the newer name (torch >= 2.12); older torch has only _tensor.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat, group=group)


def all_gather_flat(full: Tensor, part: Tensor, group: ProcessGroup) -> None:
    """full [S * world] = every rank's part [S] in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(full, part, group=group)


__all__ = [
    "all_gather_flat", "reduce_scatter_flat",
    "ParallelGroups", "broadcast_from_first", "build_parallel_groups", "destroy_parallel_groups", "free_port",
    "group_rank", "group_size", "init_gloo_world", "init_local_world", "lookup_parallel_groups", "node_address", "world_timeout",
]
