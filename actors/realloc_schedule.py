"""The reallocation schedule: how the transfers of a plan are grouped into messages and rounds.

A pure function of the plan (no torch), computed identically on every rank by the executor in
`actors/realloc.py` (`actors/realloc_program.py` then resolves it for one rank):

- local transfers (a slice that stays on its GPU) become copies;
- transfers with one receiver are grouped per link (src, dst) into messages and the messages into
  rounds: round k holds the k-th batch of every link, all posted together. Two rounds are in
  flight at a time, so a round gives each GPU half a bucket, shared among its links;
- transfers with several receivers become broadcast messages, run one at a time.

A message packs several slices into one flat buffer, or carries one large slice alone (sent
without packing when its view is contiguous). Slices larger than a message are split along
their dim 0 rows (`Segment`). Inside a message the segments lie in `buffer_order`: grouped by
their trailing shape (each group is packed by one `torch.cat`), a slice continued from the
previous message first and one continued in the next message last. `destination_slices` says
what each rank holds afterwards, `source_offsets` where the shards it sends from start.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.realloc_plan import ReallocPlan, ShardSlice, Transfer

MiB = 1024**2
# Staging per round is at most half a bucket and never more than the round's staged messages
# need. Fewer, larger rounds measured faster on two H200s (tp1 -> tp2 of a 1B model: 63-66% of
# the link at 256 MiB, 68-80% at 1-1.5 GiB; docs/benchmarks.md).
DEFAULT_BUCKET_BYTES = 1536 * MiB
# Slices at least this large travel as their own message, so contiguous ones need no packing.
# Each message costs tens of microseconds of host time; below this size packing is cheaper.
DIRECT_MIN_BYTES = 64 * MiB


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [row_start, row_stop) along dim 0 of the piece a transfer moves."""

    transfer: Transfer
    row_start: int
    row_stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        piece_shape = self.transfer.piece.shard_shape(self.transfer.shape)
        return (self.row_stop - self.row_start,) + piece_shape[1:]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def rows(self) -> int:
        """Rows (dim 0) of the whole piece this segment is cut from."""
        return self.transfer.piece.shard_shape(self.transfer.shape)[0]


@dataclass(frozen=True, slots=True)
class Message:
    """Segments sent together from `src` to every rank of `receivers` as one flat tensor."""

    src: int
    receivers: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)


@dataclass(frozen=True)
class ReallocSchedule:
    local: tuple[Transfer, ...]
    p2p_rounds: tuple[tuple[Message, ...], ...]  # messages of one round are posted together
    broadcasts: tuple[Message, ...]  # run one after the other


def build_schedule(plan: ReallocPlan, element_bytes: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   direct_min_bytes: int = DIRECT_MIN_BYTES) -> ReallocSchedule:
    """Split the plan into local copies, point-to-point rounds and broadcasts (see module doc).

    Two rounds are in flight at a time, so a round gives each GPU half a bucket, shared among
    its links. Slices of at least `direct_min_bytes` travel as their own message.
    """
    if bucket_bytes < element_bytes:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must hold at least one element of {element_bytes} bytes")
    by_key: dict[tuple[int, tuple[int, ...]], list[Transfer]] = {}
    local: list[Transfer] = []
    for t in plan.transfers:
        if t.is_local:
            local.append(t)
        else:
            by_key.setdefault((t.src_gpu, t.dst_gpus), []).append(t)
    degree: dict[int, int] = {}  # point-to-point links per GPU, to split the bucket between them
    for src, receivers in by_key:
        if len(receivers) == 1:
            for gpu in (src, receivers[0]):
                degree[gpu] = degree.get(gpu, 0) + 1
    p2p_limit = max(1, bucket_bytes // (2 * element_bytes * max(degree.values(), default=1)))
    bcast_limit = bucket_bytes // element_bytes
    link_batches: list[list[list[Message]]] = []
    broadcasts: list[Message] = []
    for (src, receivers), transfers in by_key.items():
        limit = p2p_limit if len(receivers) == 1 else bcast_limit
        messages = _pack_messages(src, receivers, transfers, limit, max(1, direct_min_bytes // element_bytes))
        if len(receivers) == 1:
            link_batches.append(_batch(messages, limit))
        else:
            broadcasts.extend(messages)
    n_rounds = max((len(b) for b in link_batches), default=0)
    rounds = tuple(tuple(m for b in link_batches if k < len(b) for m in b[k]) for k in range(n_rounds))
    return ReallocSchedule(tuple(local), rounds, tuple(broadcasts))


def _pack_messages(src: int, receivers: tuple[int, ...], transfers: list[Transfer], limit: int,
                   direct_min: int) -> list[Message]:
    """Messages of at most `limit` elements, filled in plan order (segments in `buffer_order`);
    large slices alone, small ones packed."""
    out: list[Message] = []
    pending: list[Segment] = []
    pending_numel = 0
    for t in transfers:
        for seg in _split_rows(t, limit):
            if seg.numel >= direct_min:
                out.append(Message(src, receivers, (seg,)))
                continue
            if pending and pending_numel + seg.numel > limit:
                out.append(Message(src, receivers, buffer_order(pending)))
                pending, pending_numel = [], 0
            pending.append(seg)
            pending_numel += seg.numel
    if pending:
        out.append(Message(src, receivers, buffer_order(pending)))
    return out


def buffer_order(segments: list[Segment]) -> tuple[Segment, ...]:
    """`segments` in the order they lie in a packed buffer: grouped by trailing shape (one
    `torch.cat` along dim 0 writes each group), stable within a group. A segment continuing a
    slice split across messages comes first and one that the next message continues comes last,
    so a receiver that lays out its destination in this order receives both back to back."""
    def key(seg: Segment) -> tuple[int, int, tuple[int, ...]]:
        place = 0 if seg.row_start > 0 else 2 if seg.row_stop < seg.rows else 1
        shape = seg.shape
        return place, len(shape), shape[1:]
    return tuple(sorted(segments, key=key))


def _split_rows(t: Transfer, limit: int) -> list[Segment]:
    """The piece of `t` cut along dim 0 into segments of at most `limit` elements."""
    piece_shape = t.piece.shard_shape(t.shape)
    row_numel = t.numel // piece_shape[0]
    rows_per = max(1, limit // row_numel)
    return [Segment(t, r, min(r + rows_per, piece_shape[0])) for r in range(0, piece_shape[0], rows_per)]


def _batch(messages: list[Message], limit: int) -> list[list[Message]]:
    """Consecutive messages grouped into batches of at most `limit` elements (one per round)."""
    batches: list[list[Message]] = []
    size = 0
    for m in messages:
        if not batches or (batches[-1] and size + m.numel > limit):
            batches.append([])
            size = 0
        batches[-1].append(m)
        size += m.numel
    return batches


def destination_slices(plan: ReallocPlan, rank: int) -> dict[str, tuple[tuple[int, ...], ShardSlice]]:
    """Parameter -> (full shape, slice) that `rank` holds after the plan: the union of its pieces."""
    pieces: dict[str, list[Transfer]] = {}
    for t in plan.transfers:
        if rank in t.dst_gpus:
            pieces.setdefault(t.param, []).append(t)
    out: dict[str, tuple[tuple[int, ...], ShardSlice]] = {}
    for name, transfers in pieces.items():
        shape = transfers[0].shape
        dims = {t.piece.dim for t in transfers}
        if len(dims) != 1:
            raise ValueError(f"plan for {name} on rank {rank}: pieces split along several dims {sorted(map(str, dims))}")
        dim = dims.pop()
        whole = ShardSlice(None, 0, shape[0])
        slc = whole if dim is None else ShardSlice(dim, min(t.piece.start for t in transfers), max(t.piece.stop for t in transfers))
        if slc.dim is not None and slc.stop - slc.start == shape[slc.dim]:
            slc = whole  # pieces of a split source that rebuild the full tensor
        if sum(t.numel for t in transfers) != slc.numel(shape):
            raise ValueError(f"plan for {name} on rank {rank}: pieces do not tile the slice {slc} exactly once")
        out[name] = (shape, slc)
    return out


def source_offsets(plan: ReallocPlan, rank: int, src_shapes: dict[str, tuple[int, ...]]) -> dict[Transfer, int]:
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


__all__ = [
    "DEFAULT_BUCKET_BYTES", "DIRECT_MIN_BYTES", "Message", "ReallocSchedule", "Segment", "buffer_order", "build_schedule",
    "destination_slices", "source_offsets",
]
