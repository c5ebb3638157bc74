"""The prefill of a generation call: the forward over the packed prompts that fills the KV cache
and gives each row's first logits, run once per distinct prompt.

Why once: GRPO-style calls sample several responses per prompt, so their rows repeat each prompt
(the peer bench: 64 prompts x 8 rows). The repeated rows' prompt K/V are identical, and a
forward over all 512 rows' prompt tokens does 8x the matmul work of one over the 64 prompts.
Rows that hold the same prompt tensor object as an earlier row (what a worker hands over for the
samples of one prompt; equal but separate tensors are prefilled separately) share one forward:
`SharedPrefill` runs the model over the distinct prompts, writes each one's K/V into the cache
rows of every row that repeats it, and the rows take their prompt's last-token logits. Every row
keeps its own cache row (its appended tokens go there). The Triton decode attention attends
each group's queries to its prompt once (`HeadMajorKVCache.prefix_groups`: the rows of each
prompt, in chunks that fit one tile; actors.kernels.prefix_attention), and otherwise reads the
prompt's slots from the group's first row (`prefix_rows`), sharing one copy through L2. The
samples differ through each row's own random draws.

    logits = prefill(model, prompts, tokens, batch, cache)   # [B, V_local], cache prefilled
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from actors.engine import PackedBatch, pack_sequences, packed_attention
from actors.generation.kv_cache import MAX_PREFIX_TILE, HeadMajorKVCache


def prompt_sources(prompts: list[Tensor]) -> list[int]:
    """Per row, the index of its prompt among the distinct prompt tensors (by object, numbered
    in order of first appearance)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(prompt), len(first)) for prompt in prompts]


def prefill(model: nn.Module, prompts: list[Tensor], tokens: Tensor, batch: PackedBatch,
            cache: HeadMajorKVCache) -> Tensor:
    """Prefill `cache` with every row's prompt (`tokens` / `batch`: all rows packed, as
    `prepare_cache` made them); returns logits [B, V_local] of each row's last prompt token.
    Rows repeating a prompt object share its forward (module docstring)."""
    # Distinct prompt objects in order of first appearance: `prompt_sources`' numbering.
    distinct = list({id(prompt): prompt for prompt in prompts}.values())
    if len(distinct) == len(prompts):
        return model(tokens, batch, cache, head_indices=batch.last_token_indices())
    distinct_tokens, distinct_batch = pack_sequences([p.to(torch.int64) for p in distinct], tokens.device)
    shared = SharedPrefill(cache, batch, distinct_batch, prompt_sources(prompts))
    logits = model(distinct_tokens, distinct_batch, shared, head_indices=distinct_batch.last_token_indices())
    return logits[shared.source]  # [U, V_local] -> [B, V_local]


class SharedPrefill:
    """A forward over the distinct prompts that fills the cache rows of all rows (the model sees
    a cache before its prefill: it calls `prefill` per layer, then `advance`).

    rows_batch: every row's prompt, packed (B sequences); distinct_batch: the distinct prompts
    (U sequences), what the forward runs over; sources: row b's prompt in it (`prompt_sources`).
    """

    prefilled = False

    def __init__(self, cache: HeadMajorKVCache, rows_batch: PackedBatch, distinct_batch: PackedBatch,
                 sources: list[int]) -> None:
        if rows_batch.n_seqs != cache.n_seqs:
            raise ValueError(f"prefill: batch has {rows_batch.n_seqs} sequences, cache holds {cache.n_seqs}")
        if rows_batch.max_seqlen > cache.max_len:
            raise ValueError(f"prefill: prompt of {rows_batch.max_seqlen} tokens exceeds cache max_len={cache.max_len}")
        self.cache, self.rows_batch = cache, rows_batch
        device = cache.lengths.device
        self.source = torch.tensor(sources, dtype=torch.int64, device=device)  # int64 [B]
        # Cache row and slot of every row token, and the distinct token it copies: the start of
        # its row's prompt in the distinct packing plus its position. All int64 [T_rows].
        self.seq, self.pos = rows_batch.seq_ids(), rows_batch.positions
        starts = distinct_batch.cu_seqlens[:-1].to(torch.int64)
        self.token_source = starts[self.source][self.seq] + self.pos
        # Each prompt's rows; its first row holds the copy the group's decode attention reads
        # (HeadMajorKVCache.prefix_rows): int64 [B].
        self.members = group_members(sources)
        first_row = [rows[0] for rows in self.members]
        self.prefix_rows = torch.tensor([first_row[prompt] for prompt in sources], dtype=torch.int64, device=device)
        self.query_group = 1  # query heads per KV head, seen in the first layer's prefill

    def fused_qkv(self, layer: int) -> None:
        return None  # the [q; k; v] concatenation serves decode steps only

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, backend: str,
                sliding_window: int | None, kv_index: Tensor | None) -> Tensor:
        """q [T_u, Hq, D], k/v [T_u, Hkv, D] of the distinct prompts -> their attention output."""
        self.query_group = max(self.query_group, q.shape[1] // k.shape[1])
        cache_k, cache_v = self.cache.k[layer], self.cache.v[layer]
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T_rows, Hkv, D].
        cache_k[self.seq, :, self.pos] = k[self.token_source].to(cache_k.dtype)
        cache_v[self.seq, :, self.pos] = v[self.token_source].to(cache_v.dtype)
        return packed_attention(q, k, v, batch, backend, sliding_window, kv_index)

    def advance(self, batch: PackedBatch) -> None:
        self.cache.advance(self.rows_batch)  # every row's prompt length; the cache is now prefilled
        self.cache.prefix_rows.copy_(self.prefix_rows)  # in place: captured graphs read these buffers
        self.cache.prefix_lengths.copy_(self.cache.lengths)
        self.cache.prefix_chunk_rows = MAX_PREFIX_TILE // self.query_group
        self.cache.prefix_groups = group_table(self.members, self.cache.prefix_chunk_rows, self.cache.lengths.device)


def group_members(source: list[int]) -> list[list[int]]:
    """The rows of each prompt, in order of first appearance (`prompt_sources` numbering)."""
    members: dict[int, list[int]] = {}
    for row, prompt in enumerate(source):
        members.setdefault(prompt, []).append(row)
    return list(members.values())


def group_table(members: list[list[int]], max_rows: int, device: torch.device) -> Tensor | None:
    """HeadMajorKVCache.prefix_groups: int64 [G, R], each prompt's rows in chunks of at most
    `max_rows` (a chunk reads the prompt from its own first row: every row holds a copy), -1
    padding short chunks; None when no chunk has two rows (nothing to share). Every row is in
    a chunk: the decode kernel then takes every row's prompt part from the table's partials."""
    size = max(1, max_rows)
    chunks = [rows[i:i + size] for rows in members for i in range(0, len(rows), size)]
    if all(len(chunk) == 1 for chunk in chunks):
        return None
    width = max(len(chunk) for chunk in chunks)
    return torch.tensor([chunk + [-1] * (width - len(chunk)) for chunk in chunks], dtype=torch.int64, device=device)


__all__ = ["SharedPrefill", "group_members", "group_table", "prefill", "prompt_sources"]
