"""Appending packed tokens to some sequences of a filled `HeadMajorKVCache`: the observation
prefill of multi-turn rollouts (actors.generation.multiturn), which extends each trajectory's
cache at its current length instead of re-prefilling its history.

`CacheExtension` is what the model's forward gets as its cache for such a pass; `extension_batch`
packs the new tokens with absolute positions; `attend_rows_in_place` attends them over the rows'
cached slots without gathering them (CUDA, fp16/bf16).
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.engine import PackedBatch, attention_over_history, pack_sequences
from actors.generation.kv_cache import HeadMajorKVCache


class CacheExtension:
    """A forward that appends packed tokens to some sequences of a `HeadMajorKVCache` at their
    current lengths: a multi-turn trajectory's observation ids, prefilled after everything it has
    cached (no re-prefill of its history).

    The model sees it as a cache before its prefill (`prefilled` False), so it takes positions
    from the batch (`extension_batch` makes them absolute: start + offset) and calls `prefill`,
    which writes the new K/V at those slots and attends over the sequence's cached slots plus the
    new tokens causally; `advance` then adds each sequence's new tokens to the cache's lengths.

    rows: int64 [b] the cache rows extended, in the batch's sequence order; starts: int64 [b]
    their lengths before the extension; new_lengths: int64 [b] the tokens each gets; span: the
    longest row after it (a host int). On CUDA in fp16/bf16, attention reads each row's history in
    place: FlashAttention's varlen kernel takes a key tensor with any token and head strides and,
    with `seqused_k`, a start and a length per sequence, so a strided view of the head-major cache
    (row r's tokens starting at element r * Hkv * L * D, token stride D, head stride L * D) serves
    as the packed keys without a copy. Elsewhere (CPU, float32, or a build whose kernel refuses the
    view) each row's history is gathered token-major once per layer for `attention_over_history`.
    """

    prefilled = False

    def __init__(self, cache: HeadMajorKVCache, rows: Tensor, starts: Tensor, span: int, new_lengths: Tensor) -> None:
        self.cache, self.rows, self.starts, self.span = cache, rows, starts, span
        key_lengths = starts + new_lengths
        self.key_lengths = key_lengths
        self._gather: tuple[Tensor, Tensor, Tensor] | None = None  # built by the first layer that gathers
        # For the in-place read: where each row starts in the cache viewed as tokens of stride D
        # (int32 [b+1]; the last entry closes the last row) and its key count int32 [b].
        slab = cache.max_len * next(iter(cache.k.values())).shape[1] if cache.k else 0
        self.row_starts = torch.zeros(len(rows) + 1, dtype=torch.int32, device=rows.device)
        self.row_starts[:-1] = (rows * slab).to(torch.int32)
        self.row_starts[-1] = self.row_starts[-2] + key_lengths[-1].to(torch.int32) if len(rows) else 0
        self.key_counts = key_lengths.to(torch.int32)
        self.in_place = True  # cleared for the call when the kernel refuses the strided view

    def fused_qkv(self, layer: int) -> None:
        return None  # the [q; k; v] concatenation serves decode steps only

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, backend: str,
                sliding_window: int | None, kv_index: Tensor | None) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the packed new tokens -> attention output [T, Hq, D]."""
        seq, pos = batch.seq_ids(), batch.positions  # [T] each; positions are absolute slots
        cache_k, cache_v = self.cache.k[layer], self.cache.v[layer]
        cache_k[self.rows[seq], :, pos] = k.to(cache_k.dtype)
        cache_v[self.rows[seq], :, pos] = v.to(cache_v.dtype)
        if self.in_place and kv_index is None and q.is_cuda and q.dtype == cache_k.dtype \
                and q.dtype in (torch.float16, torch.bfloat16):
            out = attend_rows_in_place(q, cache_k, cache_v, batch.cu_seqlens, self.row_starts, self.key_counts,
                                       batch.max_seqlen, self.span, sliding_window)
            if out is not None:
                return out
            self.in_place = False
        # Each row's history, new tokens included, packed token-major: [T_k, Hkv, D].
        cu_k, key_rows, key_slots = self.gather_index()
        keys = cache_k[key_rows, :, key_slots].to(q.dtype)
        values = cache_v[key_rows, :, key_slots].to(q.dtype)
        return attention_over_history(q, keys, values, batch.cu_seqlens, cu_k, batch.max_seqlen, self.span,
                                      sliding_window, kv_index)

    def gather_index(self) -> tuple[Tensor, Tensor, Tensor]:
        """Where each row's keys come from, built once and shared by the layers (the in-place
        path never needs it, nor its host sync): cu_k int32 [b+1], key_rows / key_slots int64
        [T_k] (cache row and slot of every history token)."""
        if self._gather is None:
            lengths, rows = self.key_lengths, self.rows
            cu_k = torch.zeros(len(rows) + 1, dtype=torch.int32, device=rows.device)
            cu_k[1:] = torch.cumsum(lengths, 0).to(torch.int32)
            total = int(cu_k[-1])
            key_rows = torch.repeat_interleave(rows, lengths, output_size=total)
            first = torch.repeat_interleave(cu_k[:-1].long(), lengths, output_size=total)
            self._gather = (cu_k, key_rows, torch.arange(total, device=rows.device) - first)
        return self._gather

    def advance(self, batch: PackedBatch) -> None:
        added = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).to(torch.int64)
        self.cache.lengths[self.rows] += added
        self.cache.step_masks.clear()  # the lengths moved


def attend_rows_in_place(q: Tensor, cache_k: Tensor, cache_v: Tensor, cu_q: Tensor, row_starts: Tensor,
                         key_counts: Tensor, max_q: int, max_k: int, sliding_window: int | None) -> Tensor | None:
    """Causal attention of packed new tokens q [T_q, Hq, D] over their rows of a head-major cache
    [B, Hkv, L, D] (new tokens already written), read in place; None when this build's
    FlashAttention op refuses the arguments (the caller gathers then).

    The cache is viewed as tokens of stride D: token t, head h at element t * D + h * L * D, so row
    r's slot j is token r * Hkv * L + j (`row_starts`), and `key_counts` (seqused_k) says how many
    of its tokens are keys; queries align with the last keys (bottom-right causal). Distinct
    (token, head) pairs of the view may alias the same element; only each row's own slots are read.
    """
    n_seqs, n_kv, max_len, head_dim = cache_k.shape
    tokens = n_seqs * n_kv * max_len - (n_kv - 1) * max_len  # the last row's head 0 ends the view
    shape, strides = (tokens, n_kv, head_dim), (head_dim, max_len * head_dim, 1)
    keys, values = cache_k.as_strided(shape, strides), cache_v.as_strided(shape, strides)
    left = sliding_window - 1 if sliding_window is not None else None
    try:
        out = torch.ops.aten._flash_attention_forward(
            q, keys, values, cu_q, row_starts, max_q, max_k, 0.0, True, False, scale=head_dim**-0.5,
            window_size_left=left, window_size_right=0, seqused_k=key_counts)
    except (RuntimeError, TypeError):
        return None
    return out[0]


def extension_batch(new_ids: list[Tensor], starts: list[int], device: torch.device) -> tuple[Tensor, PackedBatch]:
    """Packed new tokens of some sequences and their boundaries, positions starting at each
    sequence's current length (`starts`) rather than 0."""
    tokens, batch = pack_sequences([ids.to(torch.int64) for ids in new_ids], device)
    lengths = torch.tensor([ids.numel() for ids in new_ids], dtype=torch.int64)
    shift = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), lengths).to(device)
    return tokens, PackedBatch(batch.cu_seqlens, batch.positions + shift, batch.max_seqlen)


__all__ = ["CacheExtension", "attend_rows_in_place", "extension_batch"]
