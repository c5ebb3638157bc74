"""Execute a parameter reallocation plan: move this rank's shards from one placement to another.

`planning.realloc_plan.plan_reallocation` says which slice of which parameter goes from which GPU
to which GPUs; this module only moves the bytes, on plain dicts of tensors (HF parameter name ->
this rank's shard), so it depends on no model code. Global rank == global GPU index. The
destination shards are views of one flat buffer, allocated once per call.

Two ways to move the bytes, chosen per call, the same on every rank of the plan:

* pull (inside one node, on CUDA; `actors.realloc.pull`): each rank reads the slices it
  receives straight out of its peers' source shards, mapped with CUDA IPC, into place, and makes
  its local copies at the same time, with the copy kernel of `actors.kernels.segment_copy`. Each byte
  crosses NVLink once and is never staged. Used when the caller created the plan's group
  (`pull_group`) in its `ReallocGroups`.
* rounds over NCCL (any backend; gloo on CPU): the same schedule is computed on every rank from
  the plan alone (`actors.realloc.schedule`), so every rank walks it in the same order:
  1. local transfers (a slice that stays on its GPU) are copies into the destination buffer,
     issued right after the largest point-to-point round is posted, so they run while it is on
     the wire;
  2. transfers with one receiver are grouped per link (src, dst), packed into messages and run
     in rounds: round k posts the k-th batch of every link at once with `dist.batch_isend_irecv`,
     so opposite directions and disjoint links run concurrently. Two rounds are in flight (round
     k+1 is packed and posted before round k is unpacked), and a round stages at most half a
     bucket per GPU however many peers it has;
  3. transfers with several receivers (data-parallel replicas) are broadcast in the group
     (source + receivers), one message at a time, in plan order.
  A message is one large slice sent straight from the shard when that view is contiguous (and
  in the destination dtype), or several slices packed into a staging buffer (one `torch.cat` per
  trailing shape, or the copy kernel with copy_kernels=True). It is received straight into the
  destination buffer when its slices lie there back to back, else staged and unpacked. Slices
  larger than the message limit are split along their dim 0 rows. Peak extra memory on a GPU:
  its destination buffer plus the staging buffers of two rounds (at most one bucket).

Everything that follows from the plan alone (schedule, this rank's messages, the destination
layout, the slicing key of every view, buffer offsets, byte counts) is compiled once per (plan
object, rank, element size, schedule settings, source names and shapes) into a `RankProgram`
(`actors.realloc.program`) and cached (`actors.realloc.cache`); a repeated reallocation only
cuts views, copies and sends (`actors.realloc.buffers`).

`ReallocGroups` creates the broadcast (and pull) groups once per member set, in the same order on
every rank of the world, and reuses them across plans. Point-to-point messages use the world
group, whose communicator must already exist on every rank (run one world collective first).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.engine import world_timeout
from actors.kernels import PROGRAMS as COPY_PROGRAMS
from actors.kernels import triton_on
from actors.realloc.buffers import Staging, copy_pairs, pack, unpack, write_runs
from actors.realloc.cache import PROGRAMS, PULLS, device_tables
from actors.realloc.copies import DeviceTables, MessageBuffer
from actors.realloc.program import RankMessage, RankProgram
from actors.realloc.pull import PullSession, pull_group
from actors.realloc.schedule import DEFAULT_BUCKET_BYTES, DEFAULT_LEAD_BYTES, DIRECT_MIN_BYTES
from planning.realloc_plan import ReallocPlan


@dataclass(frozen=True)
class ReallocStats:
    """What one rank moved. Peer keys are global ranks; bytes are on the wire (after casting)."""

    bytes_sent: dict[int, int] = field(default_factory=dict)  # receiver -> bytes this rank sent it
    bytes_received: dict[int, int] = field(default_factory=dict)  # sender -> bytes received from it
    local_bytes: int = 0  # bytes copied from this rank's source shards into its destination shards
    seconds: float = 0.0
    n_messages: int = 0  # point-to-point messages and broadcasts this rank took part in (0 when it pulled)
    host_seconds: float = 0.0  # until the host had issued everything (seconds includes device work)
    # Part of host_seconds spent inside torch.distributed calls (posting, waiting). On NCCL that is
    # host work; on gloo it includes the transfer itself, so host - comm is the executor's own work.
    comm_seconds: float = 0.0
    pulled: bool = False  # the received bytes were read from the peers' shards (CUDA IPC), not sent

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

    def ensure(self, member_sets: Iterable[Sequence[int]], timeout: timedelta | None = None) -> None:
        """Create the missing groups; `timeout` bounds their collectives (None: the world's, see
        actors.engine.world_timeout)."""
        world = dist.get_world_size()
        missing: set[tuple[int, ...]] = set()
        for members in member_sets:
            key = tuple(sorted(set(members)))
            if len(key) < 2 or not all(0 <= r < world for r in key):
                raise ValueError(f"ReallocGroups.ensure: member set {tuple(members)} must hold >= 2 ranks in [0, {world})")
            if key not in self._groups:
                missing.add(key)
        me = dist.get_rank()
        timeout = timeout if timeout is not None else world_timeout()
        for key in sorted(missing):
            group = dist.new_group(list(key), timeout=timeout)
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


def release_peer_mappings() -> None:
    """Forget this process's CUDA IPC mappings of its peers' source shards (kept between pull
    calls so that a trained model's parameters are mapped once). A peer cannot free memory that
    another process maps, so call this on every rank once a reallocation's sources are released
    (a frozen model's old copy); the next pull maps its sources afresh."""
    PULLS.clear()


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
    lead_bytes: int = DEFAULT_LEAD_BYTES,
    copy_kernels: bool | None = False,
    copy_programs: int = COPY_PROGRAMS,
    pull: bool | None = None,
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

    copy_kernels: when not pulling, do the packing, unpacking and local copies of the rounds with
    the Triton kernel of `actors.kernels.segment_copy` (a few launches per round instead of one torch
    copy per tensor: far less host time, but on two H200s no faster overall, the kernel's copies
    slowing the NCCL transfers they overlap; docs/benchmarks.md). None: on CUDA when triton is
    installed and the shards are contiguous in `dtype`; True: required (CUDA, or CPU under
    Triton's interpreter); False (default): torch copies.
    copy_programs: thread blocks per copy kernel launch (each loops over tiles).
    pull: inside one node, read the received slices straight from the peers' source shards (CUDA
    IPC, `actors.realloc.pull`) instead of sending them with NCCL. None: when on CUDA with
    triton and the plan's group (`pull_group`) exists in `groups`, and every member's shards are
    contiguous in `dtype` (decided together); True: required; False: never.
    """
    device = _resolve(torch.device(device))
    program, schedule = PROGRAMS.get(plan, rank, dtype.itemsize, (bucket_bytes, direct_min_bytes, lead_bytes),
                                      src_shards)
    members = _pull_members(plan, rank, groups, device, pull)
    for m in program.broadcasts:
        groups.get(m.group)  # fail before moving anything if a group is missing
    src = list(src_shards.values())
    if not all(t.device == device for t in src):
        src = [t.to(device) for t in src]
    _synchronize(device)
    start = time.perf_counter()
    run = _Execution(program, src, device, dtype)  # the shards returned: outside inference mode
    with torch.inference_mode():  # the views cut below are temporary: skip their autograd bookkeeping
        pulled = False
        if members is not None:
            session = PULLS.get(program, device, lambda: PullSession(plan, schedule, program, rank, tuple(src_shards),
                                                                     device))
            usable = all(t.dtype == dtype and t.is_contiguous() for t in src)
            pulled = session.run(src, run.flat, groups.get(members), usable, copy_programs)
        if pull and not pulled:
            raise ValueError(f"pull=True: some rank of {members} has source shards that are not contiguous in {dtype}")
        n_messages = 0 if pulled else run.over_the_network(groups, copy_kernels, copy_programs)
    host_seconds = time.perf_counter() - start
    _synchronize(device)
    element_bytes = dtype.itemsize
    stats = ReallocStats({r: n * element_bytes for r, n in program.bytes_sent},
                         {r: n * element_bytes for r, n in program.bytes_received},
                         program.local_numel * element_bytes, time.perf_counter() - start,
                         n_messages, host_seconds, run.comm_seconds, pulled)
    return dict(zip(program.out_names, run.outs)), stats


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

    def over_the_network(self, groups: ReallocGroups, copy_kernels: bool | None, copy_programs: int) -> int:
        """The point-to-point rounds, then the broadcasts; returns the messages this rank took
        part in."""
        tables = device_tables(self.program, self.src, self.device, self.dtype, copy_kernels)
        if tables is not None:
            tables.programs = copy_programs
        n_messages = self.point_to_point() if tables is None else self.point_to_point_kernels(tables)
        for m in self.program.broadcasts:
            self.broadcast(m, groups.get(m.group))
        return n_messages + len(self.program.broadcasts)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def local_copies(self) -> None:
        write_runs(self.program.local_runs, self.flat, self.src)
        copy_pairs(self.program.local_pairs, self.flat, self.outs, self.src)

    def point_to_point(self) -> int:
        """Run the point-to-point rounds, two in flight: round k+1 is packed and posted before
        round k is waited for and unpacked, so on CUDA packing and unpacking overlap the
        transfers. The local copies are issued right after the round that is longest on the wire
        is posted, so on CUDA their device time hides behind it (issued after the first, short
        round, they would hold back the packing of the next ones). Returns the number of messages
        posted."""
        program = self.program
        src = self.src
        for index, dim, sizes in program.splits:
            src.extend(src[index].split_with_sizes(sizes, dim))
        singles_sendable = all(src[i].dtype == self.dtype and src[i].is_contiguous() for i in program.single_sources)
        staging = Staging(program.staging_half if singles_sendable else program.staging_half_all, self.empty)
        in_flight: list[tuple[list[dist.Work], list[tuple[RankMessage, torch.Tensor]]]] = []
        local_after = program.local_after_round
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

    def point_to_point_kernels(self, tables: DeviceTables) -> int:
        """`point_to_point` with the copies of each step as one kernel launch (`DeviceTables`):
        the same rounds, two in flight, local copies after the longest round is posted."""
        program, shards = self.program, list(self.src)
        tables.prepare(shards)
        if program.broadcasts:  # they cut their views from the source list, split pieces included
            for index, dim, sizes in program.splits:
                self.src.extend(self.src[index].split_with_sizes(sizes, dim))
        half = tables.staging_half
        staging = self.empty(2 * half) if half else self.flat[:0]
        in_flight: list[tuple[int, list[dist.Work], torch.Tensor]] = []
        for k, messages in enumerate(program.p2p_rounds):
            buf = staging[(k % 2) * half:(k % 2 + 1) * half]
            tables.pack(k, shards, buf)
            ops = [dist.P2POp(dist.isend if m.send else dist.irecv, self._message_tensor(m, where, buf), m.peer)
                   for m, where in zip(messages, tables.tables.rounds[k].buffers)]
            started = time.perf_counter()
            in_flight.append((k, dist.batch_isend_irecv(ops), buf))
            self.comm_seconds += time.perf_counter() - started
            if k == program.local_after_round:
                tables.local(shards, self.flat)
            if len(in_flight) == 2:
                self._finish_kernel_round(tables, *in_flight.pop(0))
        for k, works, buf in in_flight:
            self._finish_kernel_round(tables, k, works, buf)
        if not program.p2p_rounds:
            tables.local(shards, self.flat)
        return sum(len(ms) for ms in program.p2p_rounds)

    def _message_tensor(self, m: RankMessage, where: MessageBuffer, buf: torch.Tensor) -> torch.Tensor:
        if where.staged >= 0:
            return buf[where.staged:where.staged + m.numel]
        if where.shard >= 0:
            return self.src[where.shard].view(-1)[where.shard_offset:where.shard_offset + m.numel]
        return self.flat[m.direct:m.direct + m.numel]

    def _finish_kernel_round(self, tables: DeviceTables, k: int, works: list[dist.Work], buf: torch.Tensor) -> None:
        started = time.perf_counter()
        for work in works:
            work.wait()
        self.comm_seconds += time.perf_counter() - started
        tables.unpack(k, buf, self.flat)

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


def _pull_members(plan: ReallocPlan, rank: int, groups: ReallocGroups, device: torch.device,
                  pull: bool | None) -> tuple[int, ...] | None:
    """The plan's members when this call may pull (see `execute_reallocation`), else None.
    Depends only on things every member sees alike, so they all decide the same."""
    if pull is False:
        return None
    members = pull_group(plan)
    possible = members is not None and rank in members and members in groups and triton_on(device)
    if pull and not possible:
        raise ValueError(f"pull=True needs CUDA with triton, a plan inside one node, and ReallocGroups holding "
                         f"pull_group(plan) = {members} (ensure it on every rank first)")
    return members if possible else None


def _resolve(device: torch.device) -> torch.device:
    """`device` with its index, so that it compares equal to a tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["ReallocGroups", "ReallocStats", "broadcast_groups", "execute_reallocation", "release_peer_mappings"]
