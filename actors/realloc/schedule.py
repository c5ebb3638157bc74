"""The reallocation schedule: how the transfers of a plan are grouped into messages and rounds.

A pure function of the plan (no torch), computed identically on every rank by the executor in
`actors.realloc.executor` (`actors.realloc.program` then resolves it for one rank):

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
# With lead_bytes > 0 a link's first and last rounds carry that much (`round_sizes`) and the ones
# between grow and shrink by RAMP_GROWTH per round up to the bucket's share, so that the first
# pack and the last unpack, which nothing overlaps, are short. Off by default: on two H200s a
# 32 MiB lead measured within the run-to-run spread (docs/benchmarks.md).
DEFAULT_LEAD_BYTES = 0
RAMP_GROWTH = 4


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
                   direct_min_bytes: int = DIRECT_MIN_BYTES, lead_bytes: int = DEFAULT_LEAD_BYTES) -> ReallocSchedule:
    """Split the plan into local copies, point-to-point rounds and broadcasts (see module doc).

    Two rounds are in flight at a time, so a round gives each GPU at most half a bucket, shared
    among its links. A link's rounds ramp up from `lead_bytes` and back down (`round_sizes`;
    0 = every round as large as allowed). Slices of at least `direct_min_bytes` travel as their
    own message.
    """
    if bucket_bytes < element_bytes:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must hold at least one element of {element_bytes} bytes")
    if lead_bytes < 0:
        raise ValueError(f"lead_bytes={lead_bytes}: must be >= 0 (0 = no ramp)")
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
    share = max(degree.values(), default=1)
    p2p_limit = max(1, bucket_bytes // (2 * element_bytes * share))
    lead = lead_bytes // (element_bytes * share)
    direct_min = max(1, direct_min_bytes // element_bytes)
    link_rounds: list[list[list[Message]]] = []
    broadcasts: list[Message] = []
    for (src, receivers), transfers in by_key.items():
        if len(receivers) == 1:
            sizes = round_sizes(sum(t.numel for t in transfers), p2p_limit, lead)
            link_rounds.append(_link_rounds(src, receivers, transfers, sizes, direct_min))
        else:
            broadcasts.extend(m for rnd in _link_rounds(src, receivers, transfers, [bucket_bytes // element_bytes],
                                                        direct_min) for m in rnd)
    n_rounds = max((len(b) for b in link_rounds), default=0)
    rounds = tuple(tuple(m for b in link_rounds if k < len(b) for m in b[k]) for k in range(n_rounds))
    return ReallocSchedule(tuple(local), rounds, tuple(broadcasts))


def round_sizes(total: int, cap: int, lead: int, growth: int = RAMP_GROWTH) -> list[int]:
    """Element budgets of the successive rounds of one link that moves `total` elements, each at
    most `cap`: lead, lead * growth, ... up to the cap, then the same steps down again.

    Nothing overlaps the packing of the first round or the unpacking of the last, so those are
    kept small; in between, the copies of rounds k - 1 and k + 1 run while round k is on the wire,
    which hides them as long as neighbouring rounds differ by less than the ratio of copy to link
    speed (about 5 on H200s). lead <= 0 or lead >= cap: rounds of `cap` only.
    """
    if lead <= 0 or lead >= cap:
        return [cap] * max(1, -(-total // cap))
    steps: list[int] = []
    while lead * growth ** len(steps) < cap and 2 * (sum(steps) + lead * growth ** len(steps)) <= total:
        steps.append(lead * growth ** len(steps))
    rest = total - 2 * sum(steps)
    while True:
        n_middle = -(-rest // cap)
        middle = [rest // n_middle + (1 if i < rest % n_middle else 0) for i in range(n_middle)] if rest > 0 else []
        if not (steps and middle and middle[-1] < steps[-1]):
            break
        rest += 2 * steps.pop()  # a middle round below its neighbours would leave their copies exposed
    return steps + middle + steps[::-1]


def _link_rounds(src: int, receivers: tuple[int, ...], transfers: list[Transfer], sizes: list[int],
                 direct_min: int) -> list[list[Message]]:
    """The messages of one link, round by round: round k carries at most sizes[k] elements
    (the last size repeats), filled in plan order and cutting slices along their dim 0 rows at
    a round's end. In a round, slices of at least `direct_min` elements go alone and the others
    are packed into one message (segments in `buffer_order`)."""
    rounds: list[list[Message]] = []
    pending: list[Segment] = []
    filled = 0

    def close() -> None:
        nonlocal pending, filled
        direct = [s for s in pending if s.numel >= direct_min]
        packed = [s for s in pending if s.numel < direct_min]
        rounds.append([Message(src, receivers, (s,)) for s in direct]
                      + ([Message(src, receivers, buffer_order(packed))] if packed else []))
        pending, filled = [], 0

    for t in transfers:
        n_rows = t.piece.shard_shape(t.shape)[0]
        row_numel = t.numel // n_rows
        row = 0
        while row < n_rows:
            budget = sizes[min(len(rounds), len(sizes) - 1)]
            fit = min(n_rows - row, max(0, budget - filled) // row_numel)
            if fit == 0 and pending:
                close()
                continue
            fit = max(fit, 1)  # a single row larger than a round goes alone
            pending.append(Segment(t, row, row + fit))
            filled += fit * row_numel
            row += fit
    if pending:
        close()
    return rounds


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
    "DEFAULT_BUCKET_BYTES", "DEFAULT_LEAD_BYTES", "DIRECT_MIN_BYTES", "Message", "ReallocSchedule", "Segment", "buffer_order", "build_schedule",
    "destination_slices", "round_sizes", "source_offsets",
]
