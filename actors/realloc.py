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

`ReallocGroups` creates the broadcast groups once per member set, in the same order on every rank
of the world, and reuses them across plans. Point-to-point messages use the world group, whose
communicator must already exist on every rank (run one world collective, e.g. a barrier, first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.realloc_schedule import (
    DEFAULT_BUCKET_BYTES, DIRECT_MIN_BYTES, Message, Segment, build_schedule, destination_slices,
)
from planning.realloc_plan import ReallocPlan, ShardSlice, Transfer


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
    Inputs are checked before any byte moves; the source shards are left untouched.
    """
    device = torch.device(device)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    schedule = build_schedule(plan, element_bytes, bucket_bytes, direct_min_bytes)
    dst_slices = destination_slices(plan, rank)
    src_offsets = _source_offsets(plan, rank, src_shards)
    for m in schedule.broadcasts:
        if rank == m.src or rank in m.receivers:
            groups.get((m.src,) + m.receivers)  # fail before moving anything if a group is missing
    _synchronize(device)
    start = time.perf_counter()
    out = {name: torch.empty(slc.shard_shape(shape), dtype=dtype, device=device) for name, (shape, slc) in dst_slices.items()}
    ctx = _Context(rank, src_shards, src_offsets, out, dst_slices, device, dtype)
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    local = [t for t in schedule.local if t.src_gpu == rank]
    local_bytes = sum(t.numel for t in local) * element_bytes
    n_messages = _run_p2p(schedule.p2p_rounds, ctx, local, sent, received, element_bytes)
    for m in schedule.broadcasts:
        n_messages += _run_broadcast(m, ctx, groups, sent, received, element_bytes)
    host_seconds = time.perf_counter() - start
    _synchronize(device)
    stats = ReallocStats(sent, received, local_bytes, time.perf_counter() - start, n_messages, host_seconds)
    return out, stats


@dataclass(frozen=True)
class _Context:
    """This rank's side of one execution: where slices are read from and written to."""

    rank: int
    src_shards: dict[str, torch.Tensor]
    src_offsets: dict[Transfer, int]  # start of the source shard along the piece's dim
    out: dict[str, torch.Tensor]
    dst_slices: dict[str, tuple[tuple[int, ...], ShardSlice]]
    device: torch.device
    dtype: torch.dtype

    def src_view(self, seg: Segment) -> torch.Tensor:
        return _piece_view(self.src_shards[seg.transfer.param], self.src_offsets[seg.transfer], seg)

    def dst_view(self, seg: Segment) -> torch.Tensor:
        slc = self.dst_slices[seg.transfer.param][1]
        offset = slc.start if slc.dim is not None and slc.dim == seg.transfer.piece.dim else 0
        return _piece_view(self.out[seg.transfer.param], offset, seg)

    def copy_local(self, transfers: list[Transfer]) -> None:
        """Copy whole local pieces from the source shards into the destination shards."""
        segs = [Segment(t, 0, t.piece.shard_shape(t.shape)[0]) for t in transfers]
        _copy_many([self.dst_view(s) for s in segs], [self.src_view(s) for s in segs])

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def send_buffer(self, m: Message, take: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The flat tensor to send: the shard view itself when possible, else a packed copy in
        a buffer from `take(numel)`."""
        if len(m.segments) == 1:
            view = self.src_view(m.segments[0])
            if view.is_contiguous() and view.dtype == self.dtype and view.device == self.device:
                return view.view(-1)
        buf = take(m.numel)
        _copy_many(_buffer_views(m, buf), [self.src_view(s) for s in m.segments])
        return buf

    def recv_buffer(self, m: Message, take: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """A flat tensor to receive into, and whether it is the destination view itself."""
        if len(m.segments) == 1:
            view = self.dst_view(m.segments[0])
            if view.is_contiguous():
                return view.view(-1), True
        return take(m.numel), False

    def unpack(self, m: Message, buf: torch.Tensor) -> None:
        _copy_many([self.dst_view(s) for s in m.segments], _buffer_views(m, buf))


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


def _buffer_views(m: Message, buf: torch.Tensor) -> list[torch.Tensor]:
    """The segments of message `m` inside its flat buffer [m.numel], each in its own shape."""
    shapes = [seg.shape for seg in m.segments]
    return [part.view(shape) for part, shape in zip(buf.split([seg.numel for seg in m.segments]), shapes)]


def _copy_many(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i in one fused multi-tensor call (the one torch.optim uses).

    One launch per tensor costs tens of microseconds of host time; with ~150 tensors per model
    that, not the link, bounded a reallocation on GPU. Mixed dtypes and strided views are fine.
    """
    if dst:
        torch._foreach_copy_(dst, src)


def _run_p2p(rounds: tuple[tuple[Message, ...], ...], ctx: _Context, local: list[Transfer],
             sent: dict[int, int], received: dict[int, int], element_bytes: int) -> int:
    """Run the point-to-point rounds, two in flight: round k+1 is packed and posted before round
    k is waited for and unpacked, so on CUDA packing and unpacking overlap the transfers. The
    local copies run once the first round is in flight. Returns the number of messages posted."""
    in_flight: list[tuple[list[dist.Work], list[tuple[Message, torch.Tensor]]]] = []
    n_posted = 0
    mine = [[m for m in messages if ctx.rank == m.src or ctx.rank in m.receivers] for messages in rounds]
    staging = _Staging(max((sum(m.numel for m in ms) for ms in mine), default=0), ctx)
    for messages in mine:
        staging.next_round()
        works, to_unpack, n = _post_round(messages, ctx, staging, sent, received, element_bytes)
        n_posted += n
        if n and local:
            ctx.copy_local(local)
            local = []
        in_flight.append((works, to_unpack))
        if len(in_flight) == 2:
            _finish_round(*in_flight.pop(0), ctx)
    for works, to_unpack in in_flight:
        _finish_round(works, to_unpack, ctx)
    ctx.copy_local(local)
    return n_posted


def _post_round(messages: list[Message], ctx: _Context, staging: _Staging, sent: dict[int, int],
                received: dict[int, int], element_bytes: int) -> tuple[list[dist.Work], list[tuple[Message, torch.Tensor]], int]:
    """Pack and post this rank's sends and receives of one round together (one NCCL group)."""
    ops: list[dist.P2POp] = []
    to_unpack: list[tuple[Message, torch.Tensor]] = []
    for m in messages:
        nbytes = m.numel * element_bytes
        if m.src == ctx.rank:
            ops.append(dist.P2POp(dist.isend, ctx.send_buffer(m, staging.take), m.receivers[0]))
            sent[m.receivers[0]] = sent.get(m.receivers[0], 0) + nbytes
        elif m.receivers[0] == ctx.rank:
            buf, direct = ctx.recv_buffer(m, staging.take)
            ops.append(dist.P2POp(dist.irecv, buf, m.src))
            received[m.src] = received.get(m.src, 0) + nbytes
            if not direct:
                to_unpack.append((m, buf))
    works = dist.batch_isend_irecv(ops) if ops else []
    return works, to_unpack, len(ops)


def _finish_round(works: list[dist.Work], to_unpack: list[tuple[Message, torch.Tensor]], ctx: _Context) -> None:
    """Wait for a posted round (on CUDA: make the current stream wait) and unpack its receives."""
    for work in works:
        work.wait()
    for m, buf in to_unpack:
        ctx.unpack(m, buf)


def _run_broadcast(m: Message, ctx: _Context, groups: ReallocGroups, sent: dict[int, int],
                   received: dict[int, int], element_bytes: int) -> int:
    """Broadcast one message in its group when this rank is its source or a receiver."""
    nbytes = m.numel * element_bytes
    if m.src == ctx.rank:
        dist.broadcast(ctx.send_buffer(m, ctx.empty), src=m.src, group=groups.get((m.src,) + m.receivers))
        for r in m.receivers:
            sent[r] = sent.get(r, 0) + nbytes
        return 1
    if ctx.rank in m.receivers:
        buf, direct = ctx.recv_buffer(m, ctx.empty)
        dist.broadcast(buf, src=m.src, group=groups.get((m.src,) + m.receivers))
        if not direct:
            ctx.unpack(m, buf)
        received[m.src] = received.get(m.src, 0) + nbytes
        return 1
    return 0


def _piece_view(tensor: torch.Tensor, offset: int, seg: Segment) -> torch.Tensor:
    """Rows of `seg` inside `tensor`, a shard that starts at `offset` along the piece's dim.
    Narrows that would select everything are skipped: host time per view adds up on GPU."""
    piece = seg.transfer.piece
    view = tensor
    if piece.dim is not None and (piece.start != offset or piece.stop - piece.start != view.shape[piece.dim]):
        view = view.narrow(piece.dim, piece.start - offset, piece.stop - piece.start)
    if seg.row_start != 0 or seg.row_stop != view.shape[0]:
        view = view.narrow(0, seg.row_start, seg.row_stop - seg.row_start)
    return view


def _source_offsets(plan: ReallocPlan, rank: int, src_shards: dict[str, torch.Tensor]) -> dict[Transfer, int]:
    """Where each shard this rank sends from starts along the piece's dim, checking its shape.

    A tp-split shard of size s along dim d starts at a multiple of s (tp_rank * s), and every
    piece sent from it lies inside it, so the start follows from the piece and the shard shape.
    """
    offsets: dict[Transfer, int] = {}
    for t in plan.transfers:
        if t.src_gpu != rank:
            continue
        shard = src_shards.get(t.param)
        if shard is None:
            raise ValueError(f"src_shards of rank {rank} lacks {t.param!r}, which the plan sends from it")
        shape = tuple(shard.shape)
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
