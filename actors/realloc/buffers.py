"""The per-call tensor work of a reallocation: cutting views, packing, unpacking, staging.

`actors.realloc.executor` runs a compiled `RankProgram` (`actors.realloc.program`) with these. Host
time bounds a reallocation of ~150 tensors on GPU, so each step is a few list comprehensions
over precomputed specs and as few torch calls as the bytes allow:

- a source segment is one slicing of its shard (`shard[key]`, no view at all for a whole shard);
- a message buffer is packed by one `torch.cat(..., out=)` per group of segments with the same
  trailing shape (CUDA batches a cat's inputs, strided or not, into few kernels);
- a staged receive is split into its segments in one `split_with_sizes` and copied into the
  flat destination buffer by `torch._foreach_copy_` (fused on CUDA when both sides are dense);
- other copies go through `torch._foreach_copy_` too, dense pairs and strided pairs apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from actors.realloc.program import CatRun, CopyPairs, RankMessage, SrcView


def cut(src: list[torch.Tensor], views: tuple[SrcView, ...]) -> list[torch.Tensor]:
    """Each view's slice of its source shard."""
    return [src[v.index] if v.key is None else src[v.index][v.key] for v in views]


def write_runs(runs: tuple[CatRun, ...], target: torch.Tensor, src: list[torch.Tensor]) -> None:
    """Write each run's source slices back to back into the flat `target` (one cat per run)."""
    base = target.storage_offset()
    for run in runs:
        torch.cat(cut(src, run.sources), out=target.as_strided(run.shape, run.stride, base + run.offset))


def copy_pairs(pairs: tuple[CopyPairs, ...], flat: torch.Tensor, outs: list[torch.Tensor],
               src: list[torch.Tensor]) -> None:
    """Copy each pair list's source slices into their places in the flat destination buffer."""
    for p in pairs:
        dst = [outs[v.out] if v.out >= 0 else flat.as_strided(v.shape, v.stride, v.offset) for v in p.dst]
        torch._foreach_copy_(dst, cut(src, p.src))


def pack(m: RankMessage, src: list[torch.Tensor], dtype: torch.dtype,
         take: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The flat tensor to send for `m`: its only segment's view itself when that is contiguous
    and in `dtype`, else its segments packed into a buffer from `take(numel)`."""
    if m.single is not None:
        view = cut(src, (m.single,))[0]
        if view.is_contiguous() and view.dtype == dtype:
            return view.view(-1)
    buf = take(m.numel)
    write_runs(m.runs, buf, src)
    return buf


def unpack(m: RankMessage, buf: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy a staged receive into its places in the flat destination buffer (storage offset 0)."""
    pieces = buf.split_with_sizes(m.sizes)
    if m.dense:
        torch._foreach_copy_([flat.as_strided(v.shape, v.stride, v.offset) for _, v in m.dense],
                             [pieces[k] for k, _ in m.dense])
    if m.strided:
        torch._foreach_copy_([flat.as_strided(v.shape, v.stride, v.offset) for _, v in m.strided],
                             [pieces[k].view(v.shape) for k, v in m.strided])


class Staging:
    """Buffers of the point-to-point rounds' staged messages: two halves of one flat tensor, one
    per round in flight, carved in order within a round and reused two rounds later.

    Stream order makes the reuse safe: round k+2 is packed (current stream) and posted (the NCCL
    stream waits for the current one) only after round k was waited for and unpacked. Reusing
    one buffer also keeps the caching allocator out of the loop: blocks NCCL used on its stream
    are not free at once, so an allocation per message kept asking the driver for new memory.
    """

    def __init__(self, half: int, empty: Callable[[int], torch.Tensor]) -> None:
        self._half = half
        self._empty = empty
        self._buf = empty(2 * half) if half else None
        self._round = -1
        self._cursor = 0

    def next_round(self) -> None:
        self._round += 1
        self._cursor = 0

    def take(self, numel: int) -> torch.Tensor:
        if self._buf is None or self._cursor + numel > self._half:
            return self._empty(numel)  # a single row larger than a round's share
        start = (self._round % 2) * self._half + self._cursor
        self._cursor += numel
        return self._buf[start:start + numel]


__all__ = ["Staging", "copy_pairs", "cut", "pack", "unpack", "write_runs"]
