"""Reallocation inside one node by pulling: every rank reads what it receives straight out of its
peers' source shards (mapped into its address space with CUDA IPC) into place, together with its
local copies, in one launch of the copy kernel of `actors.kernels.segment_copy`.

Why: over NCCL each moved byte is copied three times on the GPUs (packed into staging on the
sender, sent, unpacked into place on the receiver), and those copies compete with the NCCL kernel
for SMs and HBM: a tp2 -> pp2 move of a 1B model ran at ~60% of the link while its transfers
alone ran at ~85% (benchmarks/realloc_bench.py --schedule-only). Pulling moves each byte once,
over NVLink, from the source tensor to its final place.

Protocol, on every rank of the plan (they all call `PullSession.run` with the same plan):
1. a device barrier (an all-reduce in the plan's process group, after each rank's pending work on
   its sources), which also tells whether any rank's source tensors changed since the last call;
2. if so, every rank shares its source shards (`torch.multiprocessing.reductions.reduce_tensor`:
   CUDA IPC handles) with the group and maps the others' (kept while the tensors stay the same;
   a trainable model passes the same parameters every call);
3. one kernel launch: local copies and reads from the peers' shards into the flat destination;
4. a second device barrier: no rank changes or frees its sources before every peer has read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from actors.kernels import (
    PROGRAMS,
    Copy2D,
    CopyTable,
    bases_aligned,
    launch_copies,
    resolve_fields,
    source_deltas,
)
from actors.realloc.copies import block_copy, local_copies
from actors.realloc.program import RankMessage, RankProgram, contiguous_stride
from actors.realloc.schedule import Message, ReallocSchedule, Segment, source_offsets
from planning.realloc_plan import ReallocPlan

# Positions in the arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor.
_STORAGE_DEVICE, _EVENT_SYNC_REQUIRED = 6, 14
_Shared = tuple[tuple[str, ...], tuple[tuple[int, ...], ...], list[object]]  # names, shapes, IPC handles


class PeerSources(NamedTuple):
    """A peer's source shards as this rank numbers them: from `first` on, in `names` order."""

    first: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def plan_members(plan: ReallocPlan) -> tuple[int, ...]:
    """Every GPU that sends or receives in `plan`, sorted."""
    return tuple(sorted({t.src_gpu for t in plan.transfers} | {g for t in plan.transfers for g in t.dst_gpus}))


def within_one_node(plan: ReallocPlan) -> bool:
    """Whether every GPU of the plan is on one node (CUDA IPC reaches only there)."""
    return len({g // plan.gpus_per_node for g in plan_members(plan)}) <= 1


def pull_group(plan: ReallocPlan) -> tuple[int, ...] | None:
    """The member set whose group lets the executor pull inside one node (`actors.realloc.pull`):
    every GPU of the plan; None when the plan spans nodes or moves nothing between GPUs (local
    copies need no peer, barrier or mapping). Pass it to `ReallocGroups.ensure` with the
    broadcast groups to allow pulling."""
    members = plan_members(plan)
    crosses = any(not t.is_local for t in plan.transfers)
    return members if crosses and len(members) > 1 and within_one_node(plan) else None


class PullSession:
    """The peers' mapped source shards and the pull table of one (plan, rank) program."""

    def __init__(self, plan: ReallocPlan, schedule: ReallocSchedule, program: RankProgram, rank: int,
                 names: tuple[str, ...], device: torch.device) -> None:
        self.plan, self.schedule, self.program, self.rank = plan, schedule, program, rank
        self.names = names
        self.device = device
        self.members = plan_members(plan)
        self._own_key: tuple[int, ...] | None = None
        self._peers: list[Tensor] = []  # the mapped shards of every other member, members in order
        self._tables: tuple[CopyTable, CopyTable] | None = None  # local copies, reads from peers
        self._uploaded: list[tuple[Tensor, Tensor, bool]] = []  # per table: fields, tile starts, aligned
        self._sources: list[Tensor] = []  # own shards, then the peers' (the tables' source indices)
        self._base_ptr = -1  # where the uploaded offsets count from
        self._side: torch.cuda.Stream | None = None

    def run(self, shards: list[Tensor], flat: Tensor, group: ProcessGroup, usable: bool,
            programs: int = PROGRAMS) -> bool:
        """Fill `flat` (this rank's destination buffer) from `shards` (this rank's sources, in
        the order of `names`) and the peers' sources. Collective over `group` (the members).
        usable: whether this rank's shards can be shared and read as they are (contiguous, in the
        destination dtype). Returns False, having moved nothing, when some member's cannot: then
        every member moves the bytes another way."""
        key = tuple(t.data_ptr() for t in shards)
        flags = torch.tensor([0 if key == self._own_key else 1, 0 if usable else 1], device=self.device,
                             dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)  # barrier 1: sources are final
        changed, unusable = (int(x) for x in flags.tolist())
        if unusable:
            return False
        if changed or self._tables is None:
            self._exchange(shards, flat, group)
            self._own_key = key
        base = shards[0] if shards else flat  # offsets count from a tensor on this GPU, not a peer's
        if any(t.n for t in self._tables):
            if base.data_ptr() != self._base_ptr:
                self._resolve(base)
            self._launch(base, flat, programs)
        dist.all_reduce(torch.zeros(1, device=self.device), group=group)  # barrier 2: peers are done reading
        return True

    def _exchange(self, shards: list[Tensor], flat: Tensor, group: ProcessGroup) -> None:
        """Share this rank's shards, map the peers', and rebuild the copy table over all of them."""
        mine: _Shared = (self.names, tuple(tuple(t.shape) for t in shards), [reduce_tensor(t.detach()) for t in shards])
        gathered: list[_Shared | None] = [None] * len(self.members)
        dist.all_gather_object(gathered, mine, group=group)
        self._peers = []
        peers: dict[int, PeerSources] = {}
        for member, shared in zip(self.members, gathered):
            if member == self.rank or shared is None:
                continue
            names, shapes, handles = shared
            tensors = [_map_peer_tensor(rebuild, args, self.device) for rebuild, args in handles]
            peers[member] = PeerSources(len(shards) + len(self._peers), names, shapes)
            self._peers += tensors
        self._sources = list(shards) + self._peers
        local = local_copies(self.program, [tuple(t.shape) for t in shards])
        reads = pull_copies(self.plan, self.schedule, self.program, self.rank, peers)
        self._tables = (CopyTable.build(local, flat.element_size()), CopyTable.build(reads, flat.element_size()))
        self._base_ptr = -1

    def _resolve(self, base: Tensor) -> None:
        """Upload the tables' offsets counted from `base` (between collectives: the stream is idle)."""
        deltas = source_deltas(self._sources, base)
        aligned = bases_aligned(*self._sources, base)
        self._uploaded = [(torch.from_numpy(resolve_fields(t, deltas).reshape(-1)).to(self.device),
                           torch.from_numpy(t.tile_start).to(self.device), t.aligned and aligned) for t in self._tables]
        self._base_ptr = base.data_ptr()

    def _launch(self, base: Tensor, flat: Tensor, programs: int) -> None:
        """The reads from peers (bound by NVLink) and the local copies (bound by HBM) at once, on
        two streams: in one launch every program would first do one kind, then the other."""
        (local, reads), ((lf, ls, la), (rf, rs, ra)) = self._tables, self._uploaded
        current = torch.cuda.current_stream(self.device)
        if local.n:
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                launch_copies(local, lf, ls, base, flat, la, max(1, programs // 2))
        launch_copies(reads, rf, rs, base, flat, ra, programs)
        if local.n:
            current.wait_stream(self._side)


def _map_peer_tensor(rebuild: Callable[..., Tensor], args: tuple[object, ...], device: torch.device) -> Tensor:
    """A peer's shared tensor mapped for reading by kernels on `device`.

    torch would open the IPC handle on the producer's device number; opening it on this rank's
    own device instead (as NCCL does) maps it into this device's address space with peer access
    enabled (cudaIpcMemLazyEnablePeerAccess), and also works where each process sees only its own
    GPU. The tensor then claims `device` though its memory is the peer's: it is only read by the
    copy kernel, by address. No event wait either: barrier 1 already orders the peer's writes."""
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise RuntimeError(f"cannot map a peer's tensor: expected rebuild_cuda_tensor with 15 arguments from "
                           f"reduce_tensor, got {getattr(rebuild, '__name__', rebuild)} with {len(args)} (torch changed?)")
    fields = list(args)
    fields[_STORAGE_DEVICE] = device.index
    fields[_EVENT_SYNC_REQUIRED] = False
    return rebuild(*fields)


def pull_copies(plan: ReallocPlan, schedule: ReallocSchedule, program: RankProgram, rank: int,
                peers: dict[int, PeerSources]) -> list[Copy2D]:
    """One read per segment `rank` receives, from the segment's place in the sender's
    (contiguous) shard to its place in the flat buffer. Sources are numbered: this rank's shards,
    then each peer's from its `PeerSources.first`."""
    offsets = {member: source_offsets(plan, member, dict(zip(p.names, p.shapes))) for member, p in peers.items()}
    out: list[Copy2D] = []
    for message, received in _received(schedule, program, rank):
        peer = peers[message.src]
        index = {name: peer.first + i for i, name in enumerate(peer.names)}
        shapes = dict(zip(peer.names, peer.shapes))
        for seg, (dst_offset, dst_stride) in zip(message.segments, _destinations(received, message)):
            src_offset, src_stride = _segment_in_shard(seg, shapes[seg.transfer.param], offsets[message.src][seg.transfer])
            out.append(block_copy(index[seg.transfer.param], src_offset, dst_offset, seg.shape, src_stride, dst_stride))
    return out


def _received(schedule: ReallocSchedule, program: RankProgram, rank: int) -> list[tuple[Message, RankMessage]]:
    """The schedule's messages that `rank` receives, each beside its compiled receive."""
    mine = [m for ms in schedule.p2p_rounds for m in ms if m.src == rank or rank in m.receivers]
    compiled = [m for ms in program.p2p_rounds for m in ms]
    bcasts = [m for m in schedule.broadcasts if m.src == rank or rank in m.receivers]
    pairs = list(zip(mine, compiled)) + list(zip(bcasts, program.broadcasts))
    return [(m, r) for m, r in pairs if not r.send]


def _destinations(received: RankMessage, message: Message) -> list[tuple[int, tuple[int, ...]]]:
    """(flat offset, stride) of each segment of a received message."""
    if received.direct is not None:
        out, at = [], received.direct
        for seg in message.segments:
            out.append((at, contiguous_stride(seg.shape)))
            at += seg.numel
        return out
    views = dict(received.dense + received.strided)
    return [(views[k].offset, views[k].stride if len(views[k].shape) == len(seg.shape) else contiguous_stride(seg.shape))
            for k, seg in enumerate(message.segments)]


def _segment_in_shard(seg: Segment, shard_shape: tuple[int, ...], shard_start: int) -> tuple[int, tuple[int, ...]]:
    """Element offset and strides of `seg` inside its (contiguous) source shard, which starts at
    `shard_start` along the piece's dim of the full tensor."""
    stride = contiguous_stride(shard_shape)
    piece = seg.transfer.piece
    offset = seg.row_start * stride[0]
    if piece.dim is not None:
        offset += (piece.start - shard_start) * stride[piece.dim]
    return offset, stride


__all__ = ["PeerSources", "PullSession", "plan_members", "pull_copies", "pull_group", "within_one_node"]
