"""One rank's reallocation program: the schedule (`actors.realloc.schedule`) resolved ahead of time.

Pure Python, no torch. `compile_rank_program` turns the schedule into what `actors.realloc.executor`
does on one rank, so that a repeated reallocation does no planning work at all:

- the destination shards are views of ONE flat buffer. Their order in it follows the order this
  rank receives them (then its local copies), each starting at a multiple of `ALIGN_BYTES`, so a
  message whose segments are whole destination tensors (or row ranges that continue one another)
  is received straight into the buffer, with no staging and no unpacking (`RankMessage.direct`);
- every segment has its source view (`SrcView`: an index into the source list plus a prebuilt
  slicing key) and its destination view (`DstView`: flat-buffer geometry, or an output tensor).
  A source shard cut into pieces that tile it (a tp split) is split once per call, and its
  pieces join the source list (`RankProgram.splits`);
- packing a message is one `torch.cat` per group of segments with the same trailing shape
  (`CatRun`), straight into the message buffer; local copies that land back to back in the flat
  buffer are written the same way, the others in two `torch._foreach_copy_` lists (dense, strided);
- byte counts and the staging size per round are precomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from actors.realloc.schedule import Message, ReallocSchedule, Segment, buffer_order, destination_slices
from planning.realloc_plan import ReallocPlan, ShardSlice, Transfer

# Destination shards start at multiples of this in the flat buffer: more than the 16 bytes that
# vectorized loads, tensor cores and TMA need, while shards of common sizes still lie back to back.
ALIGN_BYTES = 64
MAX_CAT_NUMEL = 2**31 - 1  # CUDA batches a cat's copies into few kernels only when its output is 32-bit indexable

Index = slice | tuple[slice, ...] | None


@dataclass(frozen=True, slots=True)
class SrcView:
    """A segment cut out of entry `index` of this rank's source list (the source shards in
    src_shards order, then the pieces of `RankProgram.splits`): `narrows` (dim, start, length),
    no-op ones dropped; `key` is the same as a slicing key (`entry[key]`, cheaper than narrow),
    None for the whole entry."""

    index: int
    narrows: tuple[tuple[int, int, int], ...]
    key: Index


@dataclass(frozen=True, slots=True)
class DstView:
    """A segment inside the flat destination buffer: output tensor number `out` itself when the
    segment is all of it (out >= 0), else `flat.as_strided(shape, stride, offset)`."""

    out: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def contiguous(self) -> bool:
        return _is_contiguous(self.shape, self.stride)


@dataclass(frozen=True, slots=True)
class CatRun:
    """Segments that lie back to back in a flat target from `offset` on and share their trailing
    shape: one `torch.cat(sources, out=target.as_strided(shape, stride, offset))` writes them."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    sources: tuple[SrcView, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class CopyPairs:
    """dst[i] <- src[i] in one `torch._foreach_copy_` (a fused kernel on CUDA when all are dense)."""

    dst: tuple[DstView, ...]
    src: tuple[SrcView, ...]


@dataclass(frozen=True, slots=True)
class RankMessage:
    """One message this rank sends (`send`) or receives; segments lie in the message buffer in
    order, back to back (`sizes`).

    A send packs its buffer with `runs` (offsets inside the buffer), or sends `single`, the view
    of its only segment, straight from the shard when that is contiguous. A receive lands at
    flat offset `direct` of the destination buffer when its segments lie there back to back;
    else it is staged and unpacked: `dense` (segment number, 1-D destination view) pairs and
    `strided` ones (the staged piece is viewed to the destination view's shape)."""

    peer: int  # the receiver of a point-to-point send, else the message's source
    send: bool
    numel: int
    group: tuple[int, ...]  # broadcast members (source first); () for point-to-point
    sizes: tuple[int, ...]
    runs: tuple[CatRun, ...] = ()
    single: SrcView | None = None
    direct: int | None = None
    dense: tuple[tuple[int, DstView], ...] = ()
    strided: tuple[tuple[int, DstView], ...] = ()

    @property
    def staged(self) -> bool:
        """Whether the message needs a staging buffer (a single contiguous send does not)."""
        return self.single is None if self.send else self.direct is None


@dataclass(frozen=True)
class RankProgram:
    """Everything `execute_reallocation` does on one rank, resolved from the plan ahead of time."""

    out_names: tuple[str, ...]  # destination shards, in the order of `out_views`
    out_views: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (shape, stride, offset) in the flat buffer
    flat_numel: int
    splits: tuple[tuple[int, int, tuple[int, ...]], ...]  # (shard, dim, sizes): split per call, pieces appended
    local_runs: tuple[CatRun, ...]  # local copies that land back to back in the flat buffer
    local_pairs: tuple[CopyPairs, ...]  # the other local copies: dense pairs, then strided ones
    local_after_round: int  # index in p2p_rounds of the round after whose posting they are issued
    p2p_rounds: tuple[tuple[RankMessage, ...], ...]  # only rounds where this rank has a message
    broadcasts: tuple[RankMessage, ...]
    staging_half: int  # elements of the largest round's staged messages on this rank
    staging_half_all: int  # the same when single sends need staging too (their view is not sendable)
    single_sources: tuple[int, ...]  # source shards that single sends are sent straight from
    bytes_sent: tuple[tuple[int, int], ...]  # (peer, elements)
    bytes_received: tuple[tuple[int, int], ...]
    local_numel: int

    @property
    def out_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((name, view[0]) for name, view in zip(self.out_names, self.out_views))


def compile_rank_program(schedule: ReallocSchedule, plan: ReallocPlan, rank: int, src_offsets: dict[Transfer, int],
                         src_shapes: dict[str, tuple[int, ...]], element_bytes: int) -> RankProgram:
    """Resolve `schedule` for `rank`. src_offsets: where each shard this rank sends from starts
    along its piece's dim; src_shapes: those shards' shapes, in src_shards order (the executor
    checks both); element_bytes: of the destination dtype (for the alignment of shards)."""
    dst = _Destination(destination_slices(plan, rank), element_bytes)
    mine = [[m for m in ms if m.src == rank or rank in m.receivers] for ms in schedule.p2p_rounds]
    bcasts = [m for m in schedule.broadcasts if m.src == rank or rank in m.receivers]
    local = buffer_order([Segment(t, 0, t.piece.shard_shape(t.shape)[0]) for t in schedule.local if t.src_gpu == rank])
    sent_segments = [seg for m in [m for ms in mine for m in ms] + bcasts if m.src == rank for seg in m.segments]
    sources = _Sources(src_offsets, src_shapes, sent_segments + list(local))
    for m in [m for ms in mine for m in ms] + bcasts:
        if m.src != rank:
            for seg in m.segments:
                dst.place(seg.transfer.param)
    for seg in local:
        dst.place(seg.transfer.param)
    dst.place_rest()
    sent: dict[int, int] = {}
    received: dict[int, int] = {}

    def resolve(m: Message, group: tuple[int, ...]) -> RankMessage:
        if m.src == rank:
            for r in m.receivers:
                sent[r] = sent.get(r, 0) + m.numel
            return _send(m, m.src if group else m.receivers[0], group, sources)
        received[m.src] = received.get(m.src, 0) + m.numel
        return _receive(m, group, dst)

    rounds = tuple(tuple(resolve(m, ()) for m in ms) for ms in mine if ms)
    broadcasts = tuple(resolve(m, (m.src,) + m.receivers) for m in bcasts)
    local_runs, local_pairs = _local_copies(local, dst, sources)
    return RankProgram(
        out_names=tuple(dst.order), out_views=tuple(dst.out_view(name) for name in dst.order), flat_numel=dst.numel,
        splits=tuple(sources.splits),
        local_runs=local_runs, local_pairs=local_pairs, p2p_rounds=rounds, broadcasts=broadcasts,
        local_after_round=max(range(len(rounds)), key=lambda k: sum(m.numel for m in rounds[k]), default=0),
        staging_half=max((sum(m.numel for m in ms if m.staged) for ms in rounds), default=0),
        staging_half_all=max((sum(m.numel for m in ms if m.send or m.staged) for ms in rounds), default=0),
        single_sources=tuple(sorted({m.single.index for ms in rounds for m in ms if m.single is not None})),
        bytes_sent=tuple(sent.items()), bytes_received=tuple(received.items()),
        local_numel=sum(s.numel for s in local),
    )


class _Destination:
    """The flat destination buffer: shards placed in first-use order, aligned, and each
    segment's place in it."""

    def __init__(self, slices: dict[str, tuple[tuple[int, ...], ShardSlice]], element_bytes: int) -> None:
        self._slices = slices
        self._align = max(1, ALIGN_BYTES // element_bytes)
        self._offsets: dict[str, int] = {}
        self._position: dict[str, int] = {}  # index in `order`
        self.order: list[str] = []
        self.numel = 0

    def place(self, name: str) -> None:
        if name not in self._offsets:
            start = -(-self.numel // self._align) * self._align
            self._offsets[name] = start
            self._position[name] = len(self.order)
            self.order.append(name)
            shape, slc = self._slices[name]
            self.numel = start + slc.numel(shape)

    def place_rest(self) -> None:
        for name in self._slices:
            self.place(name)

    def out_view(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        shape, slc = self._slices[name]
        shard = slc.shard_shape(shape)
        return shard, contiguous_stride(shard), self._offsets[name]

    def view(self, seg: Segment) -> DstView:
        """Where `seg` lies in the flat buffer (the shard's slice and the piece share their dim)."""
        t = seg.transfer
        shape, slc = self._slices[t.param]
        shard = slc.shard_shape(shape)
        stride = contiguous_stride(shard)
        starts = [0] * len(shard)
        if t.piece.dim is not None:
            starts[t.piece.dim] = t.piece.start - (slc.start if slc.dim == t.piece.dim else 0)
        starts[0] += seg.row_start
        offset = self._offsets[t.param] + sum(s * st for s, st in zip(starts, stride))
        out = self._position[t.param] if seg.shape == shard else -1
        return DstView(out, seg.shape, stride, offset)


class _Sources:
    """Each segment's view of this rank's source shards. A shard that the segments cut into
    pieces tiling it along one dim is split once per call (`splits`: one `split_with_sizes`
    instead of a slicing per piece); its pieces follow the shards in the source list."""

    def __init__(self, offsets: dict[Transfer, int], shapes: dict[str, tuple[int, ...]],
                 segments: list[Segment]) -> None:
        self._offsets = offsets
        self._shapes = shapes
        self._index = {name: i for i, name in enumerate(shapes)}
        self.splits: list[tuple[int, int, tuple[int, ...]]] = []  # (shard, dim, sizes)
        self._parts: dict[tuple[str, int], int] = {}  # (shard name, piece start) -> source list index
        pieces: dict[str, set[tuple[int, int, int] | None]] = {}
        for seg in segments:
            pieces.setdefault(seg.transfer.param, set()).add(self._piece(seg.transfer))
        n = len(shapes)
        for name, cuts in pieces.items():
            if None in cuts or len(cuts) < 2 or len({d for d, _, _ in cuts}) != 1:
                continue
            ordered = sorted(cuts, key=lambda c: c[1])
            dim = ordered[0][0]
            ends = [0] + [start + length for _, start, length in ordered]
            if [start for _, start, _ in ordered] != ends[:-1] or ends[-1] != shapes[name][dim]:
                continue  # the pieces do not tile the shard exactly
            self.splits.append((self._index[name], dim, tuple(length for _, _, length in ordered)))
            for _, start, _ in ordered:
                self._parts[(name, start)] = n
                n += 1

    def _piece(self, t: Transfer) -> tuple[int, int, int] | None:
        """The narrow (dim, start, length) that cuts t's piece out of its source shard; None when
        the piece is the whole shard."""
        piece = t.piece
        if piece.dim is None:
            return None
        start, length = piece.start - self._offsets[t], piece.stop - piece.start
        return None if start == 0 and self._shapes[t.param][piece.dim] == length else (piece.dim, start, length)

    def view(self, seg: Segment) -> SrcView:
        """The source list entry (a shard or a piece split from it) and the narrows left to cut
        `seg` out of it. Narrows that would select everything are dropped."""
        t = seg.transfer
        index = self._index[t.param]
        narrows: list[tuple[int, int, int]] = []
        piece = self._piece(t)
        if piece is not None:
            part = self._parts.get((t.param, piece[1]))
            if part is None:
                narrows.append(piece)
            else:
                index = part
        if seg.row_start != 0 or seg.row_stop != seg.rows:
            narrows.append((0, seg.row_start, seg.row_stop - seg.row_start))
        return SrcView(index, tuple(narrows), _slicing_key(narrows))

    def contiguous(self, seg: Segment) -> bool:
        """Whether the segment's view is contiguous in a contiguous source shard."""
        shard = self._shapes[seg.transfer.param]
        return _is_contiguous(seg.shape, contiguous_stride(shard))


def _send(m: Message, peer: int, group: tuple[int, ...], sources: _Sources) -> RankMessage:
    """A message this rank sends: one cat run per group of segments sharing their trailing shape."""
    offsets = [0]
    for seg in m.segments:
        offsets.append(offsets[-1] + seg.numel)
    chains = _chains([(seg, offset, True) for seg, offset in zip(m.segments, offsets)])
    runs = tuple(_cat_run(c, sources) for c in chains)
    only = m.segments[0]
    single = sources.view(only) if len(m.segments) == 1 and sources.contiguous(only) else None
    return RankMessage(peer, True, m.numel, group, tuple(s.numel for s in m.segments), runs, single=single)


def _receive(m: Message, group: tuple[int, ...], dst: _Destination) -> RankMessage:
    """A message this rank receives: straight into the flat buffer when its segments lie there
    back to back, else staged and unpacked segment by segment."""
    views = [dst.view(seg) for seg in m.segments]
    sizes = tuple(s.numel for s in m.segments)
    back_to_back = all(v.contiguous for v in views) and all(
        a.offset + n == b.offset for a, b, n in zip(views, views[1:], sizes))
    if back_to_back:
        return RankMessage(m.src, False, m.numel, group, sizes, direct=views[0].offset)
    dense = tuple((k, DstView(-1, (n,), (1,), v.offset)) for k, (v, n) in enumerate(zip(views, sizes)) if v.contiguous)
    strided = tuple((k, DstView(-1, v.shape, v.stride, v.offset)) for k, v in enumerate(views) if not v.contiguous)
    return RankMessage(m.src, False, m.numel, group, sizes, dense=dense, strided=strided)


def _local_copies(local: tuple[Segment, ...], dst: _Destination,
                  sources: _Sources) -> tuple[tuple[CatRun, ...], tuple[CopyPairs, ...]]:
    """Runs of >= 2 local segments back to back in the flat buffer (with one trailing shape), and
    the other segments as pairs: dense (contiguous on both sides) first, then strided."""
    views = {seg: dst.view(seg) for seg in local}
    chains = _chains([(seg, views[seg].offset, views[seg].contiguous) for seg in local])
    runs = tuple(_cat_run(c, sources) for c in chains if len(c) > 1)
    rest = [(seg, views[seg]) for c in chains if len(c) == 1 for seg, _ in c]
    dense = [(s, v) for s, v in rest if v.contiguous and sources.contiguous(s)]
    strided = [(s, v) for s, v in rest if not (v.contiguous and sources.contiguous(s))]
    pairs = tuple(CopyPairs(tuple(v for _, v in ps), tuple(sources.view(s) for s, _ in ps))
                  for ps in (dense, strided) if ps)
    return runs, pairs


def _chains(placed: list[tuple[Segment, int, bool]]) -> list[list[tuple[Segment, int]]]:
    """(segment, offset in a flat target, contiguous there) grouped into chains of segments that
    lie back to back, contiguous, with one trailing shape and at most MAX_CAT_NUMEL elements."""
    chains: list[list[tuple[Segment, int]]] = []
    end: int | None = None
    total = 0
    for seg, offset, contiguous in placed:
        if (contiguous and end == offset and chains[-1][-1][0].shape[1:] == seg.shape[1:]
                and total + seg.numel <= MAX_CAT_NUMEL):
            chains[-1].append((seg, offset))
            total += seg.numel
        else:
            chains.append([(seg, offset)])
            total = seg.numel
        end = offset + seg.numel if contiguous else None
    return chains


def _cat_run(chain: list[tuple[Segment, int]], sources: _Sources) -> CatRun:
    segs = [seg for seg, _ in chain]
    shape = (sum(s.shape[0] for s in segs),) + segs[0].shape[1:]
    return CatRun(chain[0][1], shape, contiguous_stride(shape), tuple(sources.view(s) for s in segs))


def _slicing_key(narrows: list[tuple[int, int, int]]) -> Index:
    """`tensor[key]` is `tensor` narrowed by `narrows` (at most one per dim, as built above)."""
    if not narrows:
        return None
    ndim = max(d for d, _, _ in narrows) + 1
    key = [slice(None)] * ndim
    for dim, start, length in narrows:
        current = key[dim]
        base = current.start or 0
        key[dim] = slice(base + start, base + start + length)
    return key[0] if ndim == 1 else tuple(key)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of `shape`, in elements."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


__all__ = ["ALIGN_BYTES", "CatRun", "CopyPairs", "DstView", "RankMessage", "RankProgram", "SrcView", "contiguous_stride",
           "compile_rank_program"]
