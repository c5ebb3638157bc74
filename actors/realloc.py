"""Execute a parameter reallocation plan: move this rank's shards from one placement to another.

`planning.realloc_plan.plan_reallocation` says which slice of which parameter goes from which GPU
to which GPUs; this module only moves the bytes, on plain dicts of tensors (HF parameter name ->
this rank's shard), so it depends on no model code. Global rank == global GPU index.

How the bytes move (the same schedule is computed on every rank from the plan alone, so every
rank walks it in the same order and nothing deadlocks):

1. Local transfers (a slice that stays on its GPU) are copies into the fresh destination shard.
2. Transfers with one receiver go point-to-point. They are grouped per link (src, dst), packed
   into messages, and run in rounds (`actors/realloc_schedule.py`): round k posts the k-th
   batch of every link at once with
   `dist.batch_isend_irecv`, so opposite directions of a link and disjoint links run
   concurrently. Two rounds are in flight (round k+1 is packed and posted before round k is
   unpacked), and a round carries at most half a bucket per GPU however many peers it has.
3. Transfers with several receivers (data-parallel replicas of the destination) are broadcast in
   the group (source + receivers), one message at a time, in plan order.

A message is either one large slice sent straight from / received straight into the shard when
that view is contiguous (no copy), or several slices packed into one flat buffer. Slices larger
than the message limit are split along their dim 0 rows. Peak extra memory on a GPU: its fresh
destination shard plus the staging buffers of two rounds (at most one bucket).

Host time is what bounds a reallocation of ~150 tensors on GPU, so everything that follows from
the plan alone (schedule, this rank's messages, the narrows of every view, buffer offsets, byte
counts) is compiled once per (plan object, rank, element size, bucket settings, source shapes)
into a `RankProgram` and cached; a repeated reallocation only cuts views, copies and sends.

`ReallocGroups` creates the broadcast groups once per member set, in the same order on every rank
of the world, and reuses them across plans. Point-to-point messages use the world group, whose
communicator must already exist on every rank (run one world collective, e.g. a barrier, first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.realloc_schedule import (
    DEFAULT_BUCKET_BYTES, DIRECT_MIN_BYTES, RankMessage, RankProgram, ViewSpec, build_schedule, compile_rank_program,
)
from planning.realloc_plan import ReallocPlan, Transfer


@dataclass(frozen=True)
class ReallocStats:
    """What one rank moved. Peer keys are global ranks; bytes are on the wire (after casting)."""

    bytes_sent: dict[int, int] = field(default_factory=dict)  # receiver -> bytes this rank sent it
    bytes_received: dict[int, int] = field(default_factory=dict)  # sender -> bytes received from it
    local_bytes: int = 0  # bytes copied from this rank's source shards into its destination shards
    seconds: float = 0.0
    n_messages: int = 0  # point-to-point messages and broadcasts this rank took part in
    host_seconds: float = 0.0  # until the host had issued everything (seconds includes device work)

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
    mesh). Returns this rank's shards under the destination placement, freshly allocated in
    `dtype` on `device` (empty when it is not in the destination mesh), and what it moved.
    Inputs are checked before any byte moves; the source shards are left untouched. The planning
    work is cached per (plan, rank, dtype size, bucket settings, source shapes): repeating a
    reallocation only creates views, copies and sends.
    """
    device = torch.device(device)
    element_bytes = dtype.itemsize
    src_shapes = tuple((name, tuple(t.shape)) for name, t in src_shards.items())
    program = _PROGRAMS.get(plan, rank, element_bytes, bucket_bytes, direct_min_bytes, src_shapes)
    for m in program.broadcasts:
        groups.get(m.group)  # fail before moving anything if a group is missing
    _synchronize(device)
    start = time.perf_counter()
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in program.out_shapes}
    ctx = _Context(src_shards, out, device, dtype)
    n_messages = _run_p2p(program, ctx)
    for m in program.broadcasts:
        _run_broadcast(m, ctx, groups)
    host_seconds = time.perf_counter() - start
    _synchronize(device)
    stats = ReallocStats({r: n * element_bytes for r, n in program.bytes_sent},
                         {r: n * element_bytes for r, n in program.bytes_received},
                         program.local_numel * element_bytes, time.perf_counter() - start,
                         n_messages + len(program.broadcasts), host_seconds)
    return out, stats


class _ProgramCache:
    """Compiled rank programs of recently executed plans, most recent last.

    Keyed by the plan's identity (plus rank, element size, bucket settings and source shapes)
    rather than its value: hashing a plan of ~300 transfers costs more host time than the rest
    of a small reallocation. Entries keep their plan alive, so an id is never reused while its
    entry exists. An equal plan in a new object compiles once more, which is only slower.
    """

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[ReallocPlan, RankProgram]] = OrderedDict()

    def get(self, plan: ReallocPlan, rank: int, element_bytes: int, bucket_bytes: int, direct_min_bytes: int,
            src_shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> RankProgram:
        key = (id(plan), rank, element_bytes, bucket_bytes, direct_min_bytes, src_shapes)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is plan:
            self._entries.move_to_end(key)
            return entry[1]
        shapes = dict(src_shapes)
        schedule = build_schedule(plan, element_bytes, bucket_bytes, direct_min_bytes)
        program = compile_rank_program(schedule, plan, rank, _source_offsets(plan, rank, shapes), shapes)
        self._entries[key] = (plan, program)
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return program


_PROGRAMS = _ProgramCache(max_entries=32)  # plain data, no process groups; per process


@dataclass(frozen=True)
class _Context:
    """This rank's tensors in one execution: where views are cut from and written to."""

    src_shards: dict[str, torch.Tensor]
    out: dict[str, torch.Tensor]
    device: torch.device
    dtype: torch.dtype

    def views(self, m: RankMessage) -> list[torch.Tensor]:
        """The message's segments inside the source shards (a send) or destination shards."""
        return _views(self.src_shards if m.send else self.out, m.views)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def send_buffer(self, m: RankMessage, take: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The flat tensor to send: the shard view itself when possible, else a packed copy in
        a buffer from `take(numel)`."""
        views = self.views(m)
        if len(views) == 1:
            view = views[0]
            if view.is_contiguous() and view.dtype == self.dtype and view.device == self.device:
                return view.view(-1)
        buf = take(m.numel)
        _copy_many(_buffer_views(m, buf), views)
        return buf

    def recv_buffer(self, m: RankMessage, take: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """A flat tensor to receive into, and whether it is the destination view itself."""
        if len(m.views) == 1:
            view = self.views(m)[0]
            if view.is_contiguous():
                return view.view(-1), True
        return take(m.numel), False

    def unpack(self, m: RankMessage, buf: torch.Tensor) -> None:
        _copy_many(self.views(m), _buffer_views(m, buf))


class _Staging:
    """Packing buffers of the point-to-point rounds: two halves of one flat tensor, one per round
    in flight, carved in order within a round and reused two rounds later.

    Stream order makes the reuse safe: round k+2 is packed (current stream) and posted (the NCCL
    stream waits for the current one) only after round k was waited for and unpacked. Reusing
    one buffer also keeps the caching allocator out of the loop: blocks NCCL used on its stream
    are not free at once, so an allocation per message kept asking the driver for new memory.
    """

    def __init__(self, half: int, ctx: _Context) -> None:
        self._half = half
        self._ctx = ctx
        self._buf = ctx.empty(2 * half) if half else None
        self._round = -1
        self._cursor = 0

    def next_round(self) -> None:
        self._round += 1
        self._cursor = 0

    def take(self, numel: int) -> torch.Tensor:
        if self._buf is None or self._cursor + numel > self._half:
            return self._ctx.empty(numel)  # a single row larger than a round's share
        start = (self._round % 2) * self._half + self._cursor
        self._cursor += numel
        return self._buf.narrow(0, start, numel)


def _views(tensors: dict[str, torch.Tensor], specs: tuple[ViewSpec, ...]) -> list[torch.Tensor]:
    """Each spec's view of its tensor: the narrows were resolved ahead, so this is the only
    per-segment host work besides the copy."""
    out = []
    for spec in specs:
        view = tensors[spec.param]
        for dim, start, length in spec.narrows:
            view = view.narrow(dim, start, length)
        out.append(view)
    return out


def _buffer_views(m: RankMessage, buf: torch.Tensor) -> list[torch.Tensor]:
    """The segments of message `m` inside its flat buffer [m.numel], each in its own shape.
    One as_strided per segment from precomputed offsets: cheaper than split + view."""
    base = buf.storage_offset()
    return [buf.as_strided(spec.shape, spec.packed_stride, base + offset) for spec, offset in zip(m.views, m.offsets)]


def _copy_many(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i in fused multi-tensor calls (the ones torch.optim uses).

    One launch per tensor costs tens of microseconds of host time; with ~150 tensors per model
    that, not the link, bounded a reallocation on GPU. CUDA fuses a list only when every tensor
    in it is dense (else it loops over the pairs), so the contiguous pairs (dim-0 slices, packed
    buffers) go in one call and the strided ones (dim-1 slices) in another.
    """
    dense = [i for i, (d, s) in enumerate(zip(dst, src)) if d.is_contiguous() and s.is_contiguous()]
    if len(dense) in (0, len(dst)):
        if dst:
            torch._foreach_copy_(dst, src)
        return
    dense_set = set(dense)
    strided = [i for i in range(len(dst)) if i not in dense_set]
    torch._foreach_copy_([dst[i] for i in dense], [src[i] for i in dense])
    torch._foreach_copy_([dst[i] for i in strided], [src[i] for i in strided])


def _run_p2p(program: RankProgram, ctx: _Context) -> int:
    """Run the point-to-point rounds, two in flight: round k+1 is packed and posted before round
    k is waited for and unpacked, so on CUDA packing and unpacking overlap the transfers. The
    local copies run once the first round is in flight. Returns the number of messages posted."""
    in_flight: list[tuple[list[dist.Work], list[tuple[RankMessage, torch.Tensor]]]] = []
    staging = _Staging(program.staging_half, ctx)
    local_done = False
    for messages in program.p2p_rounds:
        staging.next_round()
        in_flight.append(_post_round(messages, ctx, staging))
        if not local_done:
            _copy_many(_views(ctx.out, program.local_dst), _views(ctx.src_shards, program.local_src))
            local_done = True
        if len(in_flight) == 2:
            _finish_round(*in_flight.pop(0), ctx)
    for works, to_unpack in in_flight:
        _finish_round(works, to_unpack, ctx)
    if not local_done:
        _copy_many(_views(ctx.out, program.local_dst), _views(ctx.src_shards, program.local_src))
    return sum(len(ms) for ms in program.p2p_rounds)


def _post_round(messages: tuple[RankMessage, ...], ctx: _Context,
                staging: _Staging) -> tuple[list[dist.Work], list[tuple[RankMessage, torch.Tensor]]]:
    """Pack and post this rank's sends and receives of one round together (one NCCL group)."""
    ops: list[dist.P2POp] = []
    to_unpack: list[tuple[RankMessage, torch.Tensor]] = []
    for m in messages:
        if m.send:
            ops.append(dist.P2POp(dist.isend, ctx.send_buffer(m, staging.take), m.peer))
        else:
            buf, direct = ctx.recv_buffer(m, staging.take)
            ops.append(dist.P2POp(dist.irecv, buf, m.peer))
            if not direct:
                to_unpack.append((m, buf))
    works = dist.batch_isend_irecv(ops) if ops else []
    return works, to_unpack


def _finish_round(works: list[dist.Work], to_unpack: list[tuple[RankMessage, torch.Tensor]], ctx: _Context) -> None:
    """Wait for a posted round (on CUDA: make the current stream wait) and unpack its receives."""
    for work in works:
        work.wait()
    for m, buf in to_unpack:
        ctx.unpack(m, buf)


def _run_broadcast(m: RankMessage, ctx: _Context, groups: ReallocGroups) -> None:
    """Broadcast one message in its group (source first in `m.group`); this rank is in it."""
    group = groups.get(m.group)
    if m.send:
        dist.broadcast(ctx.send_buffer(m, ctx.empty), src=m.group[0], group=group)
        return
    buf, direct = ctx.recv_buffer(m, ctx.empty)
    dist.broadcast(buf, src=m.group[0], group=group)
    if not direct:
        ctx.unpack(m, buf)


def _source_offsets(plan: ReallocPlan, rank: int, src_shapes: dict[str, tuple[int, ...]]) -> dict[Transfer, int]:
    """Where each shard this rank sends from starts along the piece's dim, checking its shape.

    A tp-split shard of size s along dim d starts at a multiple of s (tp_rank * s), and every
    piece sent from it lies inside it, so the start follows from the piece and the shard shape.
    """
    offsets: dict[Transfer, int] = {}
    for t in plan.transfers:
        if t.src_gpu != rank:
            continue
        shape = src_shapes.get(t.param)
        if shape is None:
            raise ValueError(f"src_shards of rank {rank} lacks {t.param!r}, which the plan sends from it")
        dim = t.piece.dim
        others_match = all(s == f for i, (s, f) in enumerate(zip(shape, t.shape)) if i != dim)
        if len(shape) != len(t.shape) or not others_match:
            raise ValueError(f"src_shards[{t.param!r}] on rank {rank} has shape {shape}; the plan expects a slice of {t.shape}")
        if dim is None or shape[dim] == t.shape[dim]:
            offsets[t] = 0
            continue
        offset = (t.piece.start // shape[dim]) * shape[dim]
        if t.piece.stop > offset + shape[dim]:
            raise ValueError(f"src_shards[{t.param!r}] on rank {rank} (shape {shape}) cannot hold piece {t.piece}")
        offsets[t] = offset
    return offsets


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["ReallocGroups", "ReallocStats", "broadcast_groups", "execute_reallocation"]
