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




# ---- this rank's program: the schedule resolved to view specs, computed once per plan ------------


@dataclass(frozen=True, slots=True)
class ViewSpec:
    """How to cut one segment out of a shard: `narrows` (dim, start, length) applied in order
    (no-op narrows dropped), giving a view of `shape`. `packed_stride` is the stride of that
    shape stored contiguously, as it lies in a packed message buffer."""

    param: str
    narrows: tuple[tuple[int, int, int], ...]
    shape: tuple[int, ...]
    packed_stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankMessage:
    """One message this rank sends (`send`) or receives, with its segments' views in order:
    source-shard views for a send, destination-shard views for a receive. `offsets` is where
    each segment starts inside the packed flat buffer [numel]."""

    peer: int  # the receiver of a point-to-point send, else the message's source
    send: bool
    numel: int
    views: tuple[ViewSpec, ...]
    offsets: tuple[int, ...]
    group: tuple[int, ...]  # broadcast members (source first); () for point-to-point


@dataclass(frozen=True)
class RankProgram:
    """Everything `execute_reallocation` does on one rank, resolved from the plan ahead of time,
    so that a repeated reallocation does no planning work: only views, copies and sends."""

    out_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # destination shards to allocate
    local_dst: tuple[ViewSpec, ...]  # local copies: destination views ...
    local_src: tuple[ViewSpec, ...]  # ... and the matching source views
    p2p_rounds: tuple[tuple[RankMessage, ...], ...]  # only rounds where this rank has a message
    broadcasts: tuple[RankMessage, ...]
    staging_half: int  # elements of the largest round on this rank
    bytes_sent: tuple[tuple[int, int], ...]  # (peer, elements)
    bytes_received: tuple[tuple[int, int], ...]
    local_numel: int


def compile_rank_program(schedule: ReallocSchedule, plan: ReallocPlan, rank: int, src_offsets: dict[Transfer, int],
                         src_shapes: dict[str, tuple[int, ...]]) -> RankProgram:
    """Resolve `schedule` for `rank`. src_offsets: where each shard this rank sends from starts
    along its piece's dim; src_shapes: those shards' shapes (the executor checks both)."""
    dst_slices = destination_slices(plan, rank)
    dst_offsets = {name: (slc.dim, slc.start) for name, (_, slc) in dst_slices.items()}

    def view(seg: Segment, is_src: bool) -> ViewSpec:
        t = seg.transfer
        if is_src:
            offset, shard_shape = src_offsets[t], src_shapes[t.param]
        else:
            dim, start = dst_offsets[t.param]
            offset = start if dim is not None and dim == t.piece.dim else 0
            shard_shape = dst_slices[t.param][1].shard_shape(t.shape)
        return _view_spec(seg, offset, shard_shape)

    sent: dict[int, int] = {}
    received: dict[int, int] = {}

    def resolve(m: Message, group: tuple[int, ...]) -> RankMessage | None:
        if m.src == rank:
            for r in m.receivers:
                sent[r] = sent.get(r, 0) + m.numel
            peer = m.receivers[0] if not group else m.src
            return RankMessage(peer, True, m.numel, tuple(view(s, True) for s in m.segments), _offsets(m), group)
        if rank in m.receivers:
            received[m.src] = received.get(m.src, 0) + m.numel
            return RankMessage(m.src, False, m.numel, tuple(view(s, False) for s in m.segments), _offsets(m), group)
        return None

    rounds = []
    for messages in schedule.p2p_rounds:
        mine = tuple(r for r in (resolve(m, ()) for m in messages) if r is not None)
        if mine:
            rounds.append(mine)
    bcasts = tuple(r for r in (resolve(m, (m.src,) + m.receivers) for m in schedule.broadcasts) if r is not None)
    local = [Segment(t, 0, t.piece.shard_shape(t.shape)[0]) for t in schedule.local if t.src_gpu == rank]
    return RankProgram(
        out_shapes=tuple((name, slc.shard_shape(shape)) for name, (shape, slc) in dst_slices.items()),
        local_dst=tuple(view(s, False) for s in local), local_src=tuple(view(s, True) for s in local),
        p2p_rounds=tuple(rounds), broadcasts=bcasts,
        staging_half=max((sum(m.numel for m in ms) for ms in rounds), default=0),
        bytes_sent=tuple(sent.items()), bytes_received=tuple(received.items()),
        local_numel=sum(s.numel for s in local),
    )


def _view_spec(seg: Segment, offset: int, shard_shape: tuple[int, ...]) -> ViewSpec:
    """The narrows that cut `seg` out of a shard of `shard_shape` that starts at `offset` along
    the piece's dim. Narrows that would select everything are dropped: each costs host time."""
    t = seg.transfer
    piece = t.piece
    piece_shape = piece.shard_shape(t.shape)
    narrows: list[tuple[int, int, int]] = []
    if piece.dim is not None:
        length = piece.stop - piece.start
        if not (piece.start == offset and shard_shape[piece.dim] == length):
            narrows.append((piece.dim, piece.start - offset, length))
    if seg.row_start != 0 or seg.row_stop != piece_shape[0]:
        narrows.append((0, seg.row_start, seg.row_stop - seg.row_start))
    shape = seg.shape
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return ViewSpec(t.param, tuple(narrows), shape, tuple(stride))


def _offsets(m: Message) -> tuple[int, ...]:
    """Where each segment of `m` starts in its packed buffer (segments laid out in order)."""
    out, at = [], 0
    for seg in m.segments:
        out.append(at)
        at += seg.numel
    return tuple(out)


__all__ = [
    "DEFAULT_BUCKET_BYTES", "DIRECT_MIN_BYTES", "Message", "RankMessage", "RankProgram", "ReallocSchedule", "Segment",
    "ViewSpec", "build_schedule", "compile_rank_program", "destination_slices",
]
