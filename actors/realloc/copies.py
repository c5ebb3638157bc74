"""A rank program's copies as kernel tables: what `actors.kernels.segment_copy` launches in place of
the per-tensor torch copies of `actors.realloc.buffers`.

`compile_copy_tables` resolves, once per (program, source shapes), every copy the executor makes:
- the local copies (source shards -> the flat destination buffer), one table;
- per point-to-point round, the packing of its staged sends (source shards -> the round's half of
  the staging buffer) and the unpacking of its staged receives (that half -> the flat buffer),
  one table each, plus where each staged message lies in the half (the order `Staging.take`
  would give it).
Offsets count from each source shard's first element (source shards contiguous), from the staging
half and from the flat buffer. A copy whose view cannot be written as rows of contiguous
columns makes the whole program fall back to torch (`None`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from actors.kernels import (
    PROGRAMS,
    Copy2D,
    CopyTable,
    bases_aligned,
    launch_copies,
    resolve_fields,
    source_deltas,
)
from actors.realloc.program import (
    CatRun,
    CopyPairs,
    DstView,
    RankMessage,
    RankProgram,
    SrcView,
    contiguous_stride,
)

_Geometry = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (shard, offset, shape, stride)
_STAGING_ALIGN = 64  # elements: staged messages start on 128-byte boundaries (bf16), for vector copies


@dataclass(frozen=True, slots=True)
class MessageBuffer:
    """Where a message's flat tensor lies: at `staged` in the round's staging half (>= 0), or
    `numel` elements from `shard_offset` of source shard `shard` (a contiguous single send), or,
    both -1, straight in the flat destination buffer (`RankMessage.direct`)."""

    staged: int = -1
    shard: int = -1
    shard_offset: int = 0


@dataclass(frozen=True)
class RoundTables:
    pack: CopyTable  # reads the source shards, writes the round's staging half
    unpack: CopyTable  # reads the round's staging half, writes the flat buffer
    buffers: tuple[MessageBuffer, ...]  # per message of the round
    staged: int  # elements of the staging half the round uses


@dataclass(frozen=True)
class ProgramTables:
    local: CopyTable  # reads the source shards, writes the flat buffer
    rounds: tuple[RoundTables, ...]


class DeviceTables:
    """A program's tables on one device, and their launches.

    The unpack tables read one staging half, so they are uploaded once. The local and pack
    tables read the source shards, whose addresses enter their offsets: they are resolved and
    uploaded again only when those addresses change (a trainable model passes the same
    parameters every time). Uploads happen at the start of a call, while the stream is idle (a
    copy from pageable host memory waits for the stream).
    """

    def __init__(self, tables: ProgramTables, device: torch.device) -> None:
        self.tables = tables
        self.device = device
        self.programs = PROGRAMS  # thread blocks per launch (set per call by the executor)
        self.staging_half = max((r.staged for r in tables.rounds), default=0)
        self._unpack = _upload([(r.unpack, None) for r in tables.rounds], device)
        self._key: tuple[int, ...] | None = None
        self._from_shards: list[tuple[Tensor, Tensor]] = []
        self._shards_aligned = False

    def prepare(self, shards: list[Tensor]) -> None:
        """Resolve the shard-reading tables for these shards (same shapes, contiguous, one dtype)."""
        key = tuple(t.data_ptr() for t in shards)
        if key == self._key:
            return
        deltas = source_deltas(shards) if shards else None
        self._from_shards = _upload([(self.tables.local, deltas)] + [(r.pack, deltas) for r in self.tables.rounds],
                                    self.device)
        self._shards_aligned = bases_aligned(*shards)
        self._key = key

    def local(self, shards: list[Tensor], flat: Tensor) -> None:
        fields, starts = self._from_shards[0]
        table = self.tables.local
        launch_copies(table, fields, starts, shards[0] if shards else flat, flat, table.aligned and self._shards_aligned,
                      self.programs)

    def pack(self, k: int, shards: list[Tensor], half: Tensor) -> None:
        fields, starts = self._from_shards[1 + k]
        table = self.tables.rounds[k].pack
        if table.n:
            launch_copies(table, fields, starts, shards[0], half, table.aligned and self._shards_aligned, self.programs)

    def unpack(self, k: int, half: Tensor, flat: Tensor) -> None:
        fields, starts = self._unpack[k]
        table = self.tables.rounds[k].unpack
        launch_copies(table, fields, starts, half, flat, table.aligned, self.programs)


def _upload(tables: list[tuple[CopyTable, np.ndarray | None]], device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """Each table's resolved fields and tile starts on `device`, in one host-to-device copy."""
    arrays = []
    for table, deltas in tables:
        arrays += [resolve_fields(table, deltas).reshape(-1), table.tile_start]
    if not arrays:
        return []
    flat = torch.from_numpy(np.concatenate(arrays)).to(device)
    out = []
    at = 0
    for table, _ in tables:
        n_fields, n_starts = table.fields.size, table.tile_start.size
        fields = flat[at:at + n_fields]
        out.append((fields, flat[at + n_fields:at + n_fields + n_starts]))
        at += n_fields + n_starts
    return out


class _Unsupported(Exception):
    """A copy the kernel cannot express (no contiguous innermost dim)."""


def compile_copy_tables(program: RankProgram, src_shapes: list[tuple[int, ...]],
                        element_bytes: int) -> ProgramTables | None:
    """The kernel tables of `program` for contiguous source shards of `src_shapes` (in src_shards
    order), or None when some copy has no contiguous innermost dim."""
    sources = _source_geometry(program, src_shapes)
    try:
        local = _local(program, sources)
        rounds = tuple(_round_tables(messages, sources, element_bytes) for messages in program.p2p_rounds)
    except _Unsupported:
        return None
    return ProgramTables(CopyTable.build(local, element_bytes), rounds)


def local_copies(program: RankProgram, src_shapes: list[tuple[int, ...]]) -> list[Copy2D]:
    """The local copies of `program` (source shards -> flat buffer) for contiguous shards of
    `src_shapes`; ValueError for a copy the kernel cannot express."""
    try:
        return _local(program, _source_geometry(program, src_shapes))
    except _Unsupported as e:
        raise ValueError(f"local copy not expressible as rows of contiguous columns: {e}") from e


def _local(program: RankProgram, sources: list[_Geometry]) -> list[Copy2D]:
    return _run_copies(program.local_runs, sources, 0) + _pair_copies(program.local_pairs, program, sources)


def _round_tables(messages: tuple[RankMessage, ...], sources: list[_Geometry], element_bytes: int) -> RoundTables:
    pack: list[Copy2D] = []
    unpack: list[Copy2D] = []
    buffers: list[MessageBuffer] = []
    cursor = 0
    for m in messages:
        if m.send and m.single is not None:  # sent straight from its (contiguous) shard
            shard, offset, _, _ = _src_view(sources, m.single)
            buffers.append(MessageBuffer(shard=shard, shard_offset=offset))
            continue
        if not m.send and m.direct is not None:  # received straight into place
            buffers.append(MessageBuffer())
            continue
        buffers.append(MessageBuffer(staged=cursor))
        if m.send:
            pack += _run_copies(m.runs, sources, cursor)
        else:
            starts = [cursor]
            for size in m.sizes:
                starts.append(starts[-1] + size)
            for k, view in m.dense + m.strided:
                unpack.append(_copy(0, starts[k], view.offset, view.shape, contiguous_stride(view.shape), view.stride))
        cursor += -(-m.numel // _STAGING_ALIGN) * _STAGING_ALIGN
    return RoundTables(CopyTable.build(pack, element_bytes), CopyTable.build(unpack, element_bytes), tuple(buffers),
                       cursor)


def _run_copies(runs: tuple[CatRun, ...], sources: list[_Geometry], base: int) -> list[Copy2D]:
    """Each run's sources, written back to back from `base + run.offset` of a dense target."""
    out: list[Copy2D] = []
    for run in runs:
        at = base + run.offset
        for view in run.sources:
            shard, offset, shape, stride = _src_view(sources, view)
            out.append(_copy(shard, offset, at, shape, stride, contiguous_stride(shape)))
            at += math.prod(shape)
    return out


def _pair_copies(pairs: tuple[CopyPairs, ...], program: RankProgram, sources: list[_Geometry]) -> list[Copy2D]:
    out: list[Copy2D] = []
    for p in pairs:
        for dst, view in zip(p.dst, p.src):
            shape, stride, offset = _dst_view(dst, program)
            shard, src_offset, src_shape, src_stride = _src_view(sources, view)
            if src_shape != shape:
                raise _Unsupported(f"source view {src_shape} vs destination {shape}")
            out.append(_copy(shard, src_offset, offset, shape, src_stride, stride))
    return out


def _dst_view(v: DstView, program: RankProgram) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return program.out_views[v.out] if v.out >= 0 else (v.shape, v.stride, v.offset)


def _source_geometry(program: RankProgram, shapes: list[tuple[int, ...]]) -> list[_Geometry]:
    """(shard, offset, shape, stride) of every entry of the executor's source list: the shards,
    then the pieces of `program.splits`."""
    entries: list[_Geometry] = [(i, 0, tuple(s), contiguous_stride(tuple(s))) for i, s in enumerate(shapes)]
    for index, dim, sizes in program.splits:
        shard, offset, shape, stride = entries[index]
        start = 0
        for size in sizes:
            entries.append((shard, offset + start * stride[dim], shape[:dim] + (size,) + shape[dim + 1:], stride))
            start += size
    return entries


def _src_view(sources: list[_Geometry], v: SrcView) -> _Geometry:
    shard, offset, shape, stride = sources[v.index]
    sizes = list(shape)
    for dim, start, length in v.narrows:
        offset += start * stride[dim]
        sizes[dim] = length
    return shard, offset, tuple(sizes), stride


def block_copy(src: int, src_offset: int, dst_offset: int, shape: tuple[int, ...], src_stride: tuple[int, ...],
               dst_stride: tuple[int, ...]) -> Copy2D:
    """`_copy`, raising ValueError where the kernel cannot express the copy."""
    try:
        return _copy(src, src_offset, dst_offset, shape, src_stride, dst_stride)
    except _Unsupported as e:
        raise ValueError(f"copy not expressible as rows of contiguous columns: {e}") from e


def _copy(src: int, src_offset: int, dst_offset: int, shape: tuple[int, ...], src_stride: tuple[int, ...],
          dst_stride: tuple[int, ...]) -> Copy2D:
    """The copy of `shape` elements as rows of contiguous columns: dims of size 1 dropped, dims
    that continue each other on both sides merged; at most two may remain, the inner one
    contiguous on both sides."""
    dims = [[n, a, b] for n, a, b in zip(shape, src_stride, dst_stride) if n != 1]
    if not dims:
        return Copy2D(src, src_offset, dst_offset, 1, 1, 1, 1)
    merged = [dims[-1]]
    for n, a, b in reversed(dims[:-1]):
        inner = merged[0]
        if a == inner[1] * inner[0] and b == inner[2] * inner[0]:
            inner[0] *= n
        else:
            merged.insert(0, [n, a, b])
    cols, inner_src, inner_dst = merged[-1]
    if inner_src != 1 or inner_dst != 1 or len(merged) > 2:
        raise _Unsupported(f"shape {shape}, strides {src_stride} / {dst_stride}")
    if len(merged) == 1:
        return Copy2D(src, src_offset, dst_offset, 1, cols, cols, cols)
    rows, row_src, row_dst = merged[0]
    return Copy2D(src, src_offset, dst_offset, rows, cols, row_src, row_dst)


__all__ = ["DeviceTables", "MessageBuffer", "ProgramTables", "RoundTables", "block_copy", "compile_copy_tables",
           "local_copies"]
