"""Rows that share a prompt, run through the model with each shared prefix once.

GRPO and its kin sample n responses per prompt, and a micro-batch packed row by row holds each
prompt n times: the trunk then computes the same hidden states n times (causal attention: a
prompt token never sees what follows it). For the peer bench's 64 prompts x 8 of 128 + 512
tokens that is 17.5% of a training step's FLOPs. A compact micro-batch holds each group's
prefix once:

    stream [T_c] = [prefix of group 0 | ... | prefix of group G-1 | suffix of row 0 | ... | suffix of row B-1]

Every prefix and every suffix is a causal sequence of the packed batch; each suffix token also
attends to its group's whole prefix (`PrefixSpans`, the attention in
actors.engine.shared_prefix_attention). Positions continue from the prefix into each suffix, so
every token keeps the rotary position it has in its row.

Outputs: the head runs on the stream and then on one extra row per sequence, the hidden state of
its group's last prefix token, which predicts that row's own first suffix token (the model
appends those rows: `PrefixSpans.head_rows`). `RowMap` turns the head's per-position outputs
[T_c + B] back into the row-by-row token convention of actors.engine.model_engine ([T_rows],
entry i about token i). Gradients flow back through the same indices, so a prefix position's
gradient is the sum over its rows: the row-by-row batch's gradient, summed in another order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

from actors.engine.logprobs import next_token_targets, shift_to_token_positions
from actors.engine.packing import PackedBatch, PrefixSpans


@dataclass(frozen=True)
class RowMap:
    """How a compact micro-batch's outputs map back to its rows (device tensors).

    compact_index: int64 [T_rows], the compact position of each row token.
    first_suffix: int64 [B], the row-token index of each row's first suffix token.
    first_targets: int64 [B], that token's id (the target of the row's extra head row).
    n_compact: T_c, the stream's length (the head's extra rows follow it).
    """

    compact_index: Tensor
    first_suffix: Tensor
    first_targets: Tensor
    n_compact: int


def prefix_groups(tokens: Tensor, lengths: Sequence[int], prefix_lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, shared tokens) of each run of consecutive rows with the same prefix.

    Rows r and s share when their prefix lengths are equal and their first prefix_lengths[r]
    tokens are identical. A group shares at most each member's length - 1 tokens, so that every
    row keeps a suffix of at least one token. tokens: int64 [sum(lengths)] on the host."""
    if len(prefix_lengths) != len(lengths):
        raise ValueError(f"prefix_lengths: {len(prefix_lengths)} entries for {len(lengths)} sequences")
    starts = _row_starts(lengths)
    groups: list[tuple[int, int, int]] = []
    first = 0
    for row in range(1, len(lengths) + 1):
        p = int(prefix_lengths[first])
        same = (row < len(lengths) and int(prefix_lengths[row]) == p and p > 0
                and torch.equal(tokens[starts[row]:starts[row] + p], tokens[starts[first]:starts[first] + p]))
        if same:
            continue
        shared = min(p, *(int(lengths[r]) - 1 for r in range(first, row)))
        groups.append((first, row, max(shared, 0)))
        first = row
    return groups


def _row_prefix_lens(groups: list[tuple[int, int, int]]) -> list[int]:
    """Per row (in order), the length of its group's shared prefix."""
    return [shared for first, end, shared in groups for _ in range(first, end)]


def _row_starts(lengths: Sequence[int]) -> list[int]:
    """[0, l_0, l_0 + l_1, ..., T]: where each row starts in the packed tokens."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + int(n))
    return starts


def _arange_from(start: int, n: int) -> Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def shared_layout(tokens: Tensor, lengths: Sequence[int], prefix_lengths: Sequence[int],
                  device: torch.device | str) -> tuple[Tensor, PackedBatch, RowMap] | None:
    """The compact stream (ids int64 [T_c]), its packed batch and row map on `device`, or None
    where sharing saves nothing (no group of two rows) or cannot apply (a group with no prefix).
    tokens: int64 [T_rows], the rows packed one after another; prefix_lengths: per row, how many
    leading tokens may be shared (its prompt)."""
    groups = prefix_groups(tokens, lengths, prefix_lengths)
    if all(end - first < 2 for first, end, _ in groups) or any(shared < 1 for _, _, shared in groups):
        return None
    row_starts = _row_starts(lengths)
    n_prefix = sum(shared for _, _, shared in groups)
    prefix_pos, suffix_pos = 0, n_prefix  # next free compact position of each region
    ids, positions, index, first_suffix, head_rows = [], [], [], [], []
    cu_prefix, cu_suffix, prefix_lens, suffix_lens = [0], [0], [], []
    suffix_ids, suffix_positions = [], []
    for first, end, shared in groups:
        start = row_starts[first]
        ids.append(tokens[start:start + shared])
        positions.append(torch.arange(shared, dtype=torch.int64))
        prefix_lens.append(shared)
        prefix_index = _arange_from(prefix_pos, shared)
        for row in range(first, end):
            n_suffix = int(lengths[row]) - shared
            suffix_ids.append(tokens[row_starts[row] + shared:row_starts[row + 1]])
            suffix_positions.append(_arange_from(shared, n_suffix))
            suffix_lens.append(n_suffix)
            # A row in compact positions: its group's prefix, then its own suffix.
            index += [prefix_index, _arange_from(suffix_pos, n_suffix)]
            first_suffix.append(row_starts[row] + shared)
            head_rows.append(prefix_pos + shared - 1)
            suffix_pos += n_suffix
        prefix_pos += shared
        cu_prefix.append(prefix_pos)
        cu_suffix.append(suffix_pos - n_prefix)
    compact = torch.cat(ids + suffix_ids).to(device=device, dtype=torch.int64)
    seg_lengths = prefix_lens + suffix_lens  # the stream's sequences: every prefix, then every suffix
    cu = torch.zeros(len(seg_lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seg_lengths, dtype=torch.int64), 0)
    group_suffix = [b - a for a, b in zip(cu_suffix[:-1], cu_suffix[1:])]
    # Keys of each sequence of the stream: a prefix its own tokens, a suffix its row whole.
    history_lens = prefix_lens + [a + b for a, b in zip(suffix_lens, _row_prefix_lens(groups))]
    history = torch.cat([_arange_from(a, b - a) for a, b in pairwise(cu_prefix)] + index)
    cu_history = torch.zeros(len(history_lens) + 1, dtype=torch.int32)
    cu_history[1:] = torch.cumsum(torch.tensor(history_lens, dtype=torch.int32), 0)
    history_sorted, history_order = torch.sort(history, stable=True)  # the gather backward's order
    spans = PrefixSpans(n_prefix, torch.tensor(cu_prefix, dtype=torch.int32, device=device),
                        torch.tensor(cu_suffix, dtype=torch.int32, device=device), max(prefix_lens),
                        max(group_suffix), torch.tensor(head_rows, dtype=torch.int64, device=device),
                        history.to(device), cu_history.to(device), max(history_lens),
                        history_order.to(device), history_sorted.to(device))
    packed = PackedBatch(cu.to(device=device, dtype=torch.int32), torch.cat(positions + suffix_positions).to(device),
                         max(seg_lengths), spans)
    first_index = torch.tensor(first_suffix, dtype=torch.int64)
    rows = RowMap(torch.cat(index).to(device), first_index.to(device), tokens[first_index].to(device=device,
                  dtype=torch.int64), int(compact.numel()))
    return compact, packed, rows


def head_targets(tokens: Tensor, packed: PackedBatch, rows: RowMap) -> Tensor:
    """int64 [T_c + B]: the token each head position predicts (inside its sequence of the
    stream, then each row's first suffix token for the extra rows). A sequence's last position
    predicts nothing (target 0; its output is dropped)."""
    targets, _ = next_token_targets(tokens, packed.cu_seqlens)
    return torch.cat([targets, rows.first_targets])


def rows_per_token(per_position: Tensor, packed: PackedBatch, rows: RowMap) -> Tensor:
    """Head outputs about the next token, [T_c + B] -> [T_rows] in the token convention (entry i
    about row token i, 0 at each row's first token): a row's first suffix token takes its extra
    row, every other token the position before it in its sequence of the stream."""
    n = rows.n_compact
    if per_position.shape[0] != n + rows.first_suffix.numel():
        raise ValueError(f"per_position: {per_position.shape[0]} rows; the head gives T_c + B = "
                         f"{n} + {rows.first_suffix.numel()}")
    shifted = shift_to_token_positions(per_position[:n], packed.cu_seqlens)
    return shifted[rows.compact_index].index_copy(0, rows.first_suffix, per_position[n:])


def rows_at_positions(per_position: Tensor, rows: RowMap) -> Tensor:
    """Head outputs about the position itself (a reward model's scores), [T_c + B] -> [T_rows]."""
    return per_position[:rows.n_compact][rows.compact_index]


__all__ = ["RowMap", "head_targets", "prefix_groups", "rows_at_positions", "rows_per_token", "shared_layout"]
