"""Packed variable-length batches: many sequences in one 1-D token tensor, no padding.

A batch of B sequences with lengths l_0..l_{B-1} is stored as one tensor of T = sum(l_i) tokens
(sequence after sequence) plus `cu_seqlens` = [0, l_0, l_0+l_1, ..., T] (int32, the layout that
flash-attention and `torch.nn.attention.varlen` take) and per-token `positions` that restart at 0
at every sequence start (for rotary embeddings). Every engine component (model, attention,
logprobs, pipeline, generation) takes a `PackedBatch` next to its token / hidden tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedBatch:
    """Sequence boundaries of a packed batch.

    cu_seqlens: int32 [B+1], cumulative lengths starting at 0.
    positions: int64 [T], position of each token inside its own sequence.
    max_seqlen: the longest sequence (kernels size their tiles by it).
    """

    cu_seqlens: Tensor
    positions: Tensor
    max_seqlen: int

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
        return PackedBatch(self.cu_seqlens.to(device), self.positions.to(device), self.max_seqlen)

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


__all__ = ["PackedBatch", "pack_sequences", "unpack_sequences"]
