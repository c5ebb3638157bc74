"""Packed variable-length batches: many sequences in one 1-D token tensor, no padding.

A batch of B sequences with lengths l_0..l_{B-1} is stored as one tensor of T = sum(l_i) tokens
(sequence after sequence) plus `cu_seqlens` = [0, l_0, l_0+l_1, ..., T] (int32, the layout that
flash-attention and `torch.nn.attention.varlen` take) and per-token `positions` that restart at 0
at every sequence start (for rotary embeddings). Every engine component (model, attention,
logprobs, pipeline, generation) takes a `PackedBatch` next to its token / hidden tensor.

A batch whose rows share prompts may hold each shared prefix once (`PrefixSpans`, built by
actors.engine.shared_prefix): its sequences are then the prefixes and the rows' suffixes, and
each suffix also attends to its group's prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PrefixSpans:
    """Where a compact stream's shared prefixes and their rows' suffixes lie (device tensors).

    The prefixes of the G groups fill positions [0, n_prefix_tokens), the suffixes follow.
    cu_prefix: int32 [G+1], group g's prefix is [cu_prefix[g], cu_prefix[g+1]).
    cu_suffix: int32 [G+1], group g's rows' suffixes (consecutive) are n_prefix_tokens +
        [cu_suffix[g], cu_suffix[g+1]); each of those tokens also attends to the whole prefix.
    max_prefix / max_group_suffix: the longest of each (kernels size their tiles by them).
    head_rows: int64 [B], per row the compact position of its group's last prefix token: the head
        runs on the stream and then on these rows again (each predicts its row's first suffix token).
    history: int64 [T_k], the keys each of the stream's sequences attends to, as compact positions,
        one sequence after another: a prefix its own tokens, a suffix its group's prefix and then
        its own tokens (T_k = the prefixes plus the rows whole). cu_history: int32 [G+B+1] their
        bounds; max_history the longest. Attention gathers K/V by `history` and runs causal,
        aligned at the bottom right (actors.engine.attention.attention_over_history).
    history_order: int64 [T_k], `history`'s entries stably sorted by the compact position they
        hold: first every occurrence of each prefix token (T_k - (T_c - n_prefix_tokens) of them),
        then the single occurrence of each suffix token in stream order. The gather's backward
        sums the first part and copies the second (shared_prefix_attention).
    history_sorted: int64 [T_k], history[history_order]: the compact position each of those
        entries holds (made with the order, on the host, so no layer's backward gathers it).
    """

    n_prefix_tokens: int
    cu_prefix: Tensor
    cu_suffix: Tensor
    max_prefix: int
    max_group_suffix: int
    head_rows: Tensor
    history: Tensor
    cu_history: Tensor
    max_history: int
    history_order: Tensor
    history_sorted: Tensor

    def to(self, device: torch.device | str) -> PrefixSpans:
        return PrefixSpans(self.n_prefix_tokens, self.cu_prefix.to(device), self.cu_suffix.to(device),
                           self.max_prefix, self.max_group_suffix, self.head_rows.to(device),
                           self.history.to(device), self.cu_history.to(device), self.max_history,
                           self.history_order.to(device), self.history_sorted.to(device))


@dataclass(frozen=True)
class PackedBatch:
    """Sequence boundaries of a packed batch.

    cu_seqlens: int32 [B+1], cumulative lengths starting at 0.
    positions: int64 [T], position of each token inside its own sequence.
    max_seqlen: the longest sequence (kernels size their tiles by it).
    shared_prefix: set when the sequences are shared prefixes and suffixes (`PrefixSpans`); the
        positions then continue from a prefix into its suffixes.
    """

    cu_seqlens: Tensor
    positions: Tensor
    max_seqlen: int
    shared_prefix: PrefixSpans | None = None

    @staticmethod
    def from_lengths(lengths: list[int], device: torch.device | str | None = None) -> PackedBatch:
        """Build the boundaries of sequences with these lengths (each at least 1)."""
        if len(lengths) == 0:
            raise ValueError("lengths: empty; a packed batch needs at least one sequence")
        bad = [n for n in lengths if int(n) < 1]
        if bad:
            raise ValueError(f"lengths: {bad} not allowed; every sequence length must be >= 1")
        lens = torch.tensor([int(n) for n in lengths], dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens, 0)
        total = int(cu[-1])
        # positions[t] = t - start of t's sequence: subtract each sequence's start, repeated per token.
        starts = torch.repeat_interleave(cu[:-1], lens)
        positions = torch.arange(total, dtype=torch.int64) - starts
        return PackedBatch(
            cu_seqlens=cu.to(device=device, dtype=torch.int32),
            positions=positions.to(device=device),
            max_seqlen=int(lens.max()),
        )

    @property
    def n_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def n_tokens(self) -> int:
        return self.positions.numel()

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def lengths(self) -> list[int]:
        """Per-sequence lengths (copies to host on GPU)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def seq_ids(self) -> Tensor:
        """int64 [T]: index of the sequence each token belongs to (no host sync)."""
        # A token's sequence = number of sequence ends at or before it.
        token_idx = torch.arange(self.n_tokens, device=self.device, dtype=torch.int32)
        return torch.searchsorted(self.cu_seqlens[1:].contiguous(), token_idx, right=True).to(torch.int64)

    def last_token_indices(self) -> Tensor:
        """int64 [B]: index in the packed tensor of each sequence's last token."""
        return self.cu_seqlens[1:].to(torch.int64) - 1

    def to(self, device: torch.device | str) -> PackedBatch:
        spans = None if self.shared_prefix is None else self.shared_prefix.to(device)
        return PackedBatch(self.cu_seqlens.to(device), self.positions.to(device), self.max_seqlen, spans)

    def select(self, seq_indices: list[int]) -> PackedBatch:
        """Boundaries of the sub-batch made of these sequences, in this order."""
        lens = self.lengths()
        return PackedBatch.from_lengths([lens[i] for i in seq_indices], self.device)


def pack_sequences(seqs: list[Tensor], device: torch.device | str | None = None) -> tuple[Tensor, PackedBatch]:
    """Concatenate sequences along dim 0 (each [l_i, ...]) into [T, ...] plus their boundaries."""
    if not seqs:
        raise ValueError("seqs: empty; need at least one sequence to pack")
    device = device if device is not None else seqs[0].device
    packed = torch.cat([s.to(device) for s in seqs], dim=0)
    return packed, PackedBatch.from_lengths([s.shape[0] for s in seqs], device)


def unpack_sequences(packed: Tensor, batch: PackedBatch) -> list[Tensor]:
    """Split a packed tensor [T, ...] back into per-sequence views [l_i, ...]."""
    if packed.shape[0] != batch.n_tokens:
        raise ValueError(f"packed: {packed.shape[0]} rows, but the batch holds {batch.n_tokens} tokens")
    return list(torch.split(packed, batch.lengths(), dim=0))


__all__ = ["PackedBatch", "PrefixSpans", "pack_sequences", "unpack_sequences"]
