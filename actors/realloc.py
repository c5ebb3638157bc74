"""Execute a parameter reallocation plan: move this rank's shards from one placement to another.

`planning.realloc_plan.plan_reallocation` says which slice of which parameter goes from which GPU
to which GPUs; this module only moves the bytes, on plain dicts of tensors (HF parameter name ->
this rank's shard), so it depends on no model code. Global rank == global GPU index.

How the bytes move (the same schedule is computed on every rank from the plan alone, so every
rank walks it in the same order and nothing deadlocks):

1. The destination shards are views of one flat buffer, allocated once per call; their order in
   it follows the order this rank receives them, so most messages land straight in it. (The
   buffer is freed once all its shards are dropped; clone a shard to give it its own storage.)
2. Local transfers (a slice that stays on its GPU) are copies into the destination buffer,
   issued once two point-to-point rounds are in flight.
3. Transfers with one receiver go point-to-point. They are grouped per link (src, dst), packed
   into messages, and run in rounds (`actors/realloc_schedule.py`): round k posts the k-th
   batch of every link at once with `dist.batch_isend_irecv`, so opposite directions of a link
   and disjoint links run concurrently. Two rounds are in flight (round k+1 is packed and posted
   before round k is unpacked), and a round stages at most half a bucket per GPU however many
   peers it has.
4. Transfers with several receivers (data-parallel replicas of the destination) are broadcast in
   the group (source + receivers), one message at a time, in plan order.

A message is one large slice sent straight from the shard when that view is contiguous (and in
the destination dtype), or several slices packed into a staging buffer (one `torch.cat` per
trailing shape). It is received
straight into the destination buffer when its slices lie there back to back, else into a
staging buffer and unpacked. Slices larger than the message limit are split along their dim 0
rows. Peak extra memory on a GPU: its fresh destination buffer plus the staging buffers of two
rounds (at most one bucket).

Host time is what bounds a reallocation of ~150 tensors on GPU, so everything that follows from
the plan alone (schedule, this rank's messages, the destination layout, the slicing key of every
view, buffer offsets, byte counts) is compiled once per (plan object, rank, element size, bucket
settings, source names and shapes) into a `RankProgram` (`actors/realloc_program.py`) and cached;
a repeated reallocation only cuts views, copies and sends (`actors/realloc_buffers.py`).

`ReallocGroups` creates the broadcast groups once per member set, in the same order on every rank
of the world, and reuses them across plans. Point-to-point messages use the world group, whose
communicator must already exist on every rank (run one world collective, e.g. a barrier, first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.realloc_buffers import Staging, copy_pairs, pack, unpack, write_runs
from actors.realloc_program import RankMessage, RankProgram, compile_rank_program
from actors.realloc_schedule import DEFAULT_BUCKET_BYTES, DIRECT_MIN_BYTES, build_schedule, source_offsets
from planning.realloc_plan import ReallocPlan


@dataclass(frozen=True)
class ReallocStats:
    """What one rank moved. Peer keys are global ranks; bytes are on the wire (after casting)."""

    bytes_sent: dict[int, int] = field(default_factory=dict)  # receiver -> bytes this rank sent it
    bytes_received: dict[int, int] = field(default_factory=dict)  # sender -> bytes received from it
    local_bytes: int = 0  # bytes copied from this rank's source shards into its destination shards
    seconds: float = 0.0
    n_messages: int = 0  # point-to-point messages and broadcasts this rank took part in
    host_seconds: float = 0.0  # until the host had issued everything (seconds includes device work)
    # Part of host_seconds spent inside torch.distributed calls (posting, waiting). On NCCL that is
    # host work; on gloo it includes the transfer itself, so host - comm is the executor's own work.
    comm_seconds: float = 0.0

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.bytes_received.values())


class ReallocGroups:
    """Broadcast process groups keyed by their sorted member ranks, created once and reused.

    `ensure` is collective over the whole world (torch's `new_group` is): every rank calls it with
    the same member sets, members or not. Missing sets are created in sorted order, so the number
    of groups is the number of distinct member sets ever asked for, never more.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], ProcessGroup | None] = {}

    def ensure(self, member_sets: Iterable[Sequence[int]]) -> None:
        world = dist.get_world_size()
        missing: set[tuple[int, ...]] = set()
        for members in member_sets:
            key = tuple(sorted(set(members)))
            if len(key) < 2 or not all(0 <= r < world for r in key):
                raise ValueError(f"ReallocGroups.ensure: member set {tuple(members)} must hold >= 2 ranks in [0, {world})")
            if key not in self._groups:
                missing.add(key)
        me = dist.get_rank()
        for key in sorted(missing):
            group = dist.new_group(list(key))
            self._groups[key] = group if me in key else None

    def get(self, members: Sequence[int]) -> ProcessGroup:
        """The group of `members` (any order); this rank must be one of them."""
        key = tuple(sorted(set(members)))
        if key not in self._groups:
            raise KeyError(f"no realloc group for ranks {key}: call ReallocGroups.ensure(broadcast_groups(plan)) on every rank first")
        group = self._groups[key]
        if group is None:
            raise ValueError(f"rank {dist.get_rank()} is not a member of realloc group {key}")
        return group

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, members: Sequence[int]) -> bool:
        return tuple(sorted(set(members))) in self._groups

    def destroy(self) -> None:
        """Free every group this rank belongs to."""
        for group in self._groups.values():
            if group is not None:
                dist.destroy_process_group(group)
        self._groups.clear()


def broadcast_groups(plan: ReallocPlan) -> tuple[tuple[int, ...], ...]:
    """Member sets the executor broadcasts in (transfers with several receivers), sorted."""
    return tuple(sorted({tuple(sorted(t.group)) for t in plan.transfers if len(t.group) > 2}))


# ---- execution ------------------------------------------------------------------------------------


def execute_reallocation(
    plan: ReallocPlan,
    rank: int,
    src_shards: dict[str, torch.Tensor],
    groups: ReallocGroups,
    device: torch.device | str,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> tuple[dict[str, torch.Tensor], ReallocStats]:
    """Run `plan` on global rank `rank`; every rank of the source and destination meshes calls it.

    src_shards: this rank's shards under the source placement (empty when it is not in the source
    mesh). Returns this rank's shards under the destination placement in `dtype` on `device`
    (empty when it is not in the destination mesh), and what it moved. The shards returned are
    views of one freshly allocated flat buffer, which lives as long as any of them does.
    Inputs are checked before any byte moves; the source shards are left untouched (copied to
    `device` first if they are on another device; cast to `dtype` on the way). The planning
    work is cached per (plan, rank, dtype size, bucket settings, source names and shapes):
    repeating a reallocation only creates views, copies and sends.
    """
    device = _resolve(torch.device(device))
    program = _PROGRAMS.get(plan, rank, dtype.itemsize, bucket_bytes, direct_min_bytes, src_shards)
    for m in program.broadcasts:
        groups.get(m.group)  # fail before moving anything if a group is missing
    src = list(src_shards.values())
    if not all(t.device == device for t in src):
        src = [t.to(device) for t in src]
    _synchronize(device)
    start = time.perf_counter()
    run = _Execution(program, src, device, dtype)  # the shards returned: outside inference mode
    with torch.inference_mode():  # the views cut below are temporary: skip their autograd bookkeeping
        n_messages = run.point_to_point()
        for m in program.broadcasts:
            run.broadcast(m, groups.get(m.group))
    host_seconds = time.perf_counter() - start
    _synchronize(device)
    element_bytes = dtype.itemsize
    stats = ReallocStats({r: n * element_bytes for r, n in program.bytes_sent},
                         {r: n * element_bytes for r, n in program.bytes_received},
                         program.local_numel * element_bytes, time.perf_counter() - start,
                         n_messages + len(program.broadcasts), host_seconds, run.comm_seconds)
    return dict(zip(program.out_names, run.outs)), stats


_Entry = tuple[ReallocPlan, tuple[str, ...], tuple[torch.Size, ...], RankProgram]  # plan, source names, shapes


class _ProgramCache:
    """Compiled rank programs of recently executed plans, most recent last.

    Keyed by the plan's identity (plus rank, element size and bucket settings) rather than its
    value: hashing a plan of ~300 transfers costs more host time than the rest of a small
    reallocation. Each entry also holds the source names and shapes it was compiled for and is
    recompiled when they change. Entries keep their plan alive, so an id is never reused while
    its entry exists. An equal plan in a new object compiles once more, which is only slower.
    """

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()

    def get(self, plan: ReallocPlan, rank: int, element_bytes: int, bucket_bytes: int, direct_min_bytes: int,
            src_shards: dict[str, torch.Tensor]) -> RankProgram:
        key = (id(plan), rank, element_bytes, bucket_bytes, direct_min_bytes)
        names = tuple(src_shards)
        shapes = tuple([t.shape for t in src_shards.values()])
        entry = self._entries.get(key)
        if entry is not None and entry[0] is plan and entry[1] == names and entry[2] == shapes:
            self._entries.move_to_end(key)
            return entry[3]
        shape_of = {name: tuple(shape) for name, shape in zip(names, shapes)}
        schedule = build_schedule(plan, element_bytes, bucket_bytes, direct_min_bytes)
        offsets = source_offsets(plan, rank, shape_of)
        program = compile_rank_program(schedule, plan, rank, offsets, shape_of, element_bytes)
        self._entries[key] = (plan, names, shapes, program)
        self._entries.move_to_end(key)
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return program


_PROGRAMS = _ProgramCache(max_entries=32)  # plain data, no process groups; per process


class _Execution:
    """One execution of a program: the flat destination buffer, its output views and the source
    list (the source shards in src_shards order, then the pieces split from them)."""

    def __init__(self, program: RankProgram, src: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        self.program = program
        self.src = src
        self.device = device
        self.dtype = dtype
        self.flat = torch.empty(program.flat_numel, dtype=dtype, device=device)
        flat = self.flat
        self.outs = [flat.as_strided(shape, stride, offset) for shape, stride, offset in program.out_views]
        self.comm_seconds = 0.0

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def local_copies(self) -> None:
        write_runs(self.program.local_runs, self.flat, self.src)
        copy_pairs(self.program.local_pairs, self.flat, self.outs, self.src)

    def point_to_point(self) -> int:
        """Run the point-to-point rounds, two in flight: round k+1 is packed and posted before
        round k is waited for and unpacked, so on CUDA packing and unpacking overlap the
        transfers. The local copies are issued once two rounds are in flight, so on CUDA their
        device time hides behind those transfers (issued after the first round only, they would
        hold back the packing of the second). Returns the number of messages posted."""
        program = self.program
        src = self.src
        for index, dim, sizes in program.splits:
            src.extend(src[index].split_with_sizes(sizes, dim))
        singles_sendable = all(src[i].dtype == self.dtype and src[i].is_contiguous() for i in program.single_sources)
        staging = Staging(program.staging_half if singles_sendable else program.staging_half_all, self.empty)
        in_flight: list[tuple[list[dist.Work], list[tuple[RankMessage, torch.Tensor]]]] = []
        local_after = min(1, len(program.p2p_rounds) - 1)
        for k, messages in enumerate(program.p2p_rounds):
            staging.next_round()
            in_flight.append(self._post_round(messages, staging))
            if k == local_after:
                self.local_copies()
            if len(in_flight) == 2:
                self._finish_round(*in_flight.pop(0))
        for works, to_unpack in in_flight:
            self._finish_round(works, to_unpack)
        if not program.p2p_rounds:
            self.local_copies()
        return sum(len(ms) for ms in program.p2p_rounds)

    def _post_round(self, messages: tuple[RankMessage, ...],
                    staging: Staging) -> tuple[list[dist.Work], list[tuple[RankMessage, torch.Tensor]]]:
        """Pack and post this rank's sends and receives of one round together (one NCCL group)."""
        ops: list[dist.P2POp] = []
        to_unpack: list[tuple[RankMessage, torch.Tensor]] = []
        for m in messages:
            if m.send:
                ops.append(dist.P2POp(dist.isend, pack(m, self.src, self.dtype, staging.take), m.peer))
            elif m.direct is not None:
                ops.append(dist.P2POp(dist.irecv, self.flat[m.direct:m.direct + m.numel], m.peer))
            else:
                buf = staging.take(m.numel)
                ops.append(dist.P2POp(dist.irecv, buf, m.peer))
                to_unpack.append((m, buf))
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops)
        self.comm_seconds += time.perf_counter() - start
        return works, to_unpack

    def _finish_round(self, works: list[dist.Work], to_unpack: list[tuple[RankMessage, torch.Tensor]]) -> None:
        """Wait for a posted round (on CUDA: make the current stream wait) and unpack its receives."""
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.comm_seconds += time.perf_counter() - start
        for m, buf in to_unpack:
            unpack(m, buf, self.flat)

    def broadcast(self, m: RankMessage, group: ProcessGroup) -> None:
        """Broadcast one message in its group (source first in `m.group`); this rank is in it."""
        if m.send:
            buf = pack(m, self.src, self.dtype, self.empty)
        else:
            buf = self.empty(m.numel) if m.direct is None else self.flat[m.direct:m.direct + m.numel]
        start = time.perf_counter()
        dist.broadcast(buf, src=m.group[0], group=group)
        self.comm_seconds += time.perf_counter() - start
        if not m.send and m.direct is None:
            unpack(m, buf, self.flat)


def _resolve(device: torch.device) -> torch.device:
    """`device` with its index, so that it compares equal to a tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["ReallocGroups", "ReallocStats", "broadcast_groups", "execute_reallocation"]
