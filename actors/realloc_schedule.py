"""The reallocation schedule: how the transfers of a plan are grouped into messages and rounds.

A pure function of the plan (no torch), computed identically on every rank by the executor in
`actors/realloc.py`:

- local transfers (a slice that stays on its GPU) become copies;
- transfers with one receiver are grouped per link (src, dst) into messages and the messages into
  rounds: round k holds the k-th batch of every link, all posted together. Two rounds are in
  flight at a time, so a round gives each GPU half a bucket, shared among its links;
- transfers with several receivers become broadcast messages, run one at a time.

A message packs several slices into one flat buffer, or carries one large slice alone (sent
without packing when its view is contiguous). Slices larger than a message are split along
their dim 0 rows (`Segment`). `destination_slices` says what each rank holds afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.realloc_plan import ReallocPlan, ShardSlice, Transfer

MiB = 1024**2
DEFAULT_BUCKET_BYTES = 256 * MiB
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
    """Messages of at most `limit` elements, in plan order; large slices alone, small ones packed."""
    out: list[Message] = []
    pending: list[Segment] = []
    pending_numel = 0
    for t in transfers:
        for seg in _split_rows(t, limit):
            if seg.numel >= direct_min:
                out.append(Message(src, receivers, (seg,)))
                continue
            if pending and pending_numel + seg.numel > limit:
                out.append(Message(src, receivers, tuple(pending)))
                pending, pending_numel = [], 0
            pending.append(seg)
            pending_numel += seg.numel
    if pending:
        out.append(Message(src, receivers, tuple(pending)))
    return out


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


__all__ = [
    "DEFAULT_BUCKET_BYTES", "DIRECT_MIN_BYTES", "Message", "ReallocSchedule", "Segment", "build_schedule",
    "destination_slices",
]
