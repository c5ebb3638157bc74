"""Many strided 2-D copies in one kernel launch: the packing, unpacking and local copies of a
parameter reallocation (`actors.realloc.executor`).

Why: a reallocation of a 1B model between tp2 and pp2 copies ~170 tensor pieces per GPU (halves
of every split weight into staging, received halves into place, the halves a GPU keeps). Issued
as torch copies, each costs ~10 us of host time, and the host, not the GPU, paced the transfers
(2 ms of host work in a 3.6 ms reallocation on two H200s). Here a `CopyTable` lists every copy of
one step ahead of time, and one launch does them all.

Every copy is a 2-D block: `rows` x `cols` elements, rows `src_stride` / `dst_stride` elements
apart, the columns contiguous on both sides. Offsets are in elements from a base tensor: the
launch's destination, and either one source tensor or, for copies out of many source shards, the
first of them (a shard's offset is then `its data_ptr - the first's`, in elements, resolved per
call by `resolve_fields`; all sources share one dtype). Contiguous copies are re-cut into rows of
the tile width so that every tile is a full [BLOCK_R, BLOCK_C] block.

The kernel: program p finds its copy by binary search over the copies' first tile numbers and
copies one [BLOCK_R, BLOCK_C] tile of it. `copy_reference` does the same copies in torch (the
tests compare the two; on CPU the kernel runs in Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from actors.kernels.switch import triton_installed

BLOCK_R = 32  # rows per tile
BLOCK_C = 256  # columns per tile: 512 contiguous bytes of bf16 per row
NUM_WARPS = 4
# Thread blocks per launch, each looping over tiles: 8 per SM of an H200 (132 SMs). Fewer left
# more room to an NCCL kernel running beside the copies but measured no faster overall; the pull
# path reads over NVLink fastest with this many (benchmarks/realloc_bench.py --copy-programs).
PROGRAMS = 1024
ALIGN_ELEMENTS_BYTES = 16  # offsets and strides on this boundary let the kernel use vector loads
N_FIELDS = 8  # per copy: src offset, dst offset, rows, cols, src stride, dst stride, column tiles, pad

if triton_installed():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_tiles_kernel(src_ptr, dst_ptr, fields_ptr, tile_start_ptr, n_tiles, LOG2_N: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr):
        # Few programs, each looping over tiles: a grid of every tile would take all SMs and keep
        # the NCCL kernel that runs beside it waiting for free ones.
        zero = tl.program_id(0).to(tl.int64) * 0
        for step in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            tile = zero + step
            # The copy this tile belongs to: the last e with tile_start[e] <= tile (tile_start is
            # padded to 2**LOG2_N entries with a value no tile number reaches).
            e = tile * 0
            for k in tl.static_range(LOG2_N - 1, -1, -1):
                cand = e + (1 << k)
                e = tl.where(tl.load(tile_start_ptr + cand) <= tile, cand, e)
            row = fields_ptr + e * 8
            src_off = tl.load(row)
            dst_off = tl.load(row + 1)
            rows = tl.load(row + 2)
            cols = tl.load(row + 3)
            src_stride = tl.load(row + 4)
            dst_stride = tl.load(row + 5)
            col_tiles = tl.load(row + 6)
            if ALIGNED:
                src_off = tl.multiple_of(src_off, VEC)
                dst_off = tl.multiple_of(dst_off, VEC)
                src_stride = tl.multiple_of(src_stride, VEC)
                dst_stride = tl.multiple_of(dst_stride, VEC)
            local = tile - tl.load(tile_start_ptr + e)
            c0 = (local % col_tiles) * BLOCK_C
            r = (local // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
            c = tl.arange(0, BLOCK_C)  # int32: 64-bit arithmetic only per row, not per element
            limit = (cols - c0).to(tl.int32)
            if ALIGNED:  # columns come in whole vectors: the mask is constant over each of them
                limit = tl.multiple_of(limit, VEC)
            mask = (r < rows)[:, None] & (c < limit)[None, :]
            src_rows = src_ptr + (src_off + c0 + r * src_stride)
            dst_rows = dst_ptr + (dst_off + c0 + r * dst_stride)
            x = tl.load(src_rows[:, None] + c[None, :], mask=mask)
            tl.store(dst_rows[:, None] + c[None, :], x, mask=mask)


@dataclass(frozen=True, slots=True)
class Copy2D:
    """dst[dst_offset + i * dst_stride + j] = sources[src][src_offset + i * src_stride + j] for
    i < rows, j < cols (element offsets from each base tensor's first element)."""

    src: int
    src_offset: int
    dst_offset: int
    rows: int
    cols: int
    src_stride: int
    dst_stride: int


@dataclass(frozen=True)
class CopyTable:
    """The copies of one launch, as arrays: `src_index` [n] (which source each reads),
    `fields` [n, N_FIELDS] int64 (offsets relative to each copy's own source), `tile_start`
    [2**log2_n] (first tile of each copy, padded), `tiles` in all, and whether every static
    offset, row length and stride is a whole number of 16-byte vectors."""

    src_index: np.ndarray
    fields: np.ndarray
    tile_start: np.ndarray
    log2_n: int
    tiles: int
    aligned: bool
    block_r: int = BLOCK_R  # the tile shape the tile counts are for
    block_c: int = BLOCK_C

    @property
    def n(self) -> int:
        return len(self.src_index)

    @staticmethod
    def build(copies: list[Copy2D], element_bytes: int, block_r: int = BLOCK_R, block_c: int = BLOCK_C) -> CopyTable:
        """The table of `copies` (empty copies dropped; contiguous ones re-cut into rows) for
        tiles of block_r x block_c elements (powers of two)."""
        cut = [piece for c in copies if c.rows and c.cols for piece in _recut(c, block_c)]
        n = len(cut)
        fields = np.zeros((n, N_FIELDS), dtype=np.int64)
        tile_counts = np.zeros(n, dtype=np.int64)
        for i, c in enumerate(cut):
            col_tiles = -(-c.cols // block_c)
            fields[i, :7] = (c.src_offset, c.dst_offset, c.rows, c.cols, c.src_stride, c.dst_stride, col_tiles)
            tile_counts[i] = -(-c.rows // block_r) * col_tiles
        log2_n = max(0, (n - 1).bit_length())
        tile_start = np.full(max(1, 2**log2_n), np.iinfo(np.int64).max, dtype=np.int64)
        tile_start[:n] = np.cumsum(tile_counts) - tile_counts
        vec = max(1, ALIGN_ELEMENTS_BYTES // element_bytes)
        aligned = bool(np.all(fields[:, [0, 1, 3, 4, 5]] % vec == 0)) if n else True
        return CopyTable(np.array([c.src for c in cut], dtype=np.int64), fields, tile_start, log2_n,
                         int(tile_counts.sum()), aligned, block_r, block_c)


def _recut(c: Copy2D, cols: int) -> list[Copy2D]:
    """A copy contiguous on both sides as rows of `cols` elements plus a tail; others as is."""
    dense = c.rows == 1 or (c.src_stride == c.cols and c.dst_stride == c.cols)
    n = c.rows * c.cols
    if not dense or n < 2 * cols:
        return [c]
    rows, tail = divmod(n, cols)
    out = [Copy2D(c.src, c.src_offset, c.dst_offset, rows, cols, cols, cols)]
    if tail:
        done = rows * cols
        out.append(Copy2D(c.src, c.src_offset + done, c.dst_offset + done, 1, tail, tail, tail))
    return out


def source_deltas(sources: list[Tensor], base: Tensor | None = None) -> np.ndarray:
    """Each source's first element relative to `base`'s (default: the first source's), in
    elements (one dtype). The base is what the launch passes as its source pointer: a tensor on
    the launching device, even where the sources include other GPUs' memory."""
    origin = (sources[0] if base is None else base).data_ptr()
    ptrs = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    return (ptrs - origin) // sources[0].element_size()


def resolve_fields(table: CopyTable, deltas: np.ndarray | None) -> np.ndarray:
    """The table's fields with source offsets made relative to the first source (`deltas` from
    `source_deltas`; None for a table that reads one source)."""
    if deltas is None or table.n == 0:
        return table.fields
    fields = table.fields.copy()
    fields[:, 0] += deltas[table.src_index]
    return fields


def launch_copies(table: CopyTable, fields: Tensor, tile_start: Tensor, src_base: Tensor, dst: Tensor,
                  aligned: bool, programs: int = PROGRAMS, num_warps: int = NUM_WARPS) -> None:
    """Run every copy of `table` in one launch. fields / tile_start: the table's (resolved)
    arrays on the device; src_base: the source the offsets count from; dst: the destination
    base; aligned: the table's alignment and that of the resolved offsets and both bases;
    programs: at most this many programs (thread blocks) share the tiles."""
    if table.n == 0:
        return
    vec = max(1, ALIGN_ELEMENTS_BYTES // dst.element_size())
    grid = (max(1, min(table.tiles, programs)),)
    _copy_tiles_kernel[grid](src_base, dst, fields, tile_start, table.tiles, LOG2_N=table.log2_n, BLOCK_R=table.block_r,
                                       BLOCK_C=table.block_c, ALIGNED=aligned, VEC=vec, num_warps=num_warps)


def bases_aligned(*tensors: Tensor) -> bool:
    """Whether every tensor's first element lies on the 16-byte boundary the kernel's vector
    loads assume."""
    return all(t.data_ptr() % ALIGN_ELEMENTS_BYTES == 0 for t in tensors)


def copy_reference(table: CopyTable, sources: list[Tensor], dst: Tensor) -> None:
    """The same copies in torch, one `copy_` each (the kernel's reference; any device)."""
    base = dst.storage_offset()
    for i in range(table.n):
        src_off, dst_off, rows, cols, src_stride, dst_stride = (int(x) for x in table.fields[i, :6])
        src = sources[int(table.src_index[i])]
        out = dst.as_strided((rows, cols), (dst_stride, 1), base + dst_off)
        out.copy_(src.as_strided((rows, cols), (src_stride, 1), src.storage_offset() + src_off))


__all__ = ["BLOCK_C", "BLOCK_R", "Copy2D", "CopyTable", "bases_aligned", "copy_reference", "launch_copies",
           "resolve_fields", "source_deltas"]
