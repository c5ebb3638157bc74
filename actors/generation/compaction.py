"""Dropping finished rows from the decode step: the step shrinks to the rows still generating.

Why: a decode step costs the same for a row that has emitted EOS as for one still generating
(the static-shape step keeps every row's slot), and at a few hundred rows its projections are
compute-bound, so their time falls with the row count. When responses end at different lengths
(the usual case: an EOS-terminated task), the last steps of a call run a few long responses in a
batch sized for all of them. Each time the live rows fall to `GenerationConfig.compact_fraction`
of the step's rows, the loop moves the live rows' cache to the front (`keep_cache_rows`) and
continues with a step over those rows alone (a new CUDA graph; under torch.compile every size
reuses the first compile, traced with the row count symbolic: `rows_dynamic`).

Nothing a row computes changes: its cache, position, random draws (by its global row,
`RowCompactor.active`) and recorded outputs are its own. Row-wise results can differ in the last
bits where a kernel picks another algorithm for another row count (cuBLAS), as between any two
batch sizes.

    compactor = RowCompactor(n_rows, config)
    if compactor.due(live_rows, steps_left):
        keep = compactor.compact(recorder.finished, cache)   # int64 [n] of the step's rows, or None

The serial loop (`actors.generation.loop`), the multi-turn loop (`actors.generation.multiturn`,
where a trajectory is finished once its environment ended it; paused ones keep their rows) and
the pipelined loop (`actors.generation.pipelined`: one compactor per micro-batch, its last stage
decides and every stage drops the same rows) use it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.generation.decoding import GenerationConfig
from actors.generation.kv_cache import HeadMajorKVCache

# A compaction costs a host sync and the cache rows' copy: not worth it for a call's last steps.
MIN_STEPS_LEFT = 16
# With CUDA graphs it also captures the smaller step's graph (~30 ms on an H100 with
# torch.compile), while a dropped row saves ~5-7 us per decode step it would have run: a
# compaction must drop at least this many row-steps (rows dropped x steps left, an upper bound
# on the saving) to pay (docs/benchmarks.md, issue 27, twenty-fourth step).
MIN_ROW_STEPS_CAPTURED = 4096


def keep_cache_rows(cache: HeadMajorKVCache, keep: Tensor) -> None:
    """Keep only the cache rows `keep` (int64 [n], increasing, on the cache's device): row i of the
    cache becomes old row keep[i], with its K/V (the written slots), length and shared-prompt
    links (the shared-prompt table keeps its shape: `remap_group_table`). The buffers stay where
    they are (the cache is their first n rows), so the memory is not returned; the per-row index
    tensors are new, so graphs captured before must be dropped."""
    n = keep.numel()
    if n == 0 or n > cache.n_seqs:
        raise ValueError(f"keep_cache_rows: {n} rows of a cache of {cache.n_seqs}; need 1..n_seqs")
    used = int(cache.lengths.max())  # slots [0, used) hold K/V; the next step writes at lengths[b]
    for store in (cache.k, cache.v):
        for layer, buf in store.items():
            # Advanced indexing copies the picked rows out first, so rows moving down never
            # overwrite a row still to be read. One-byte caches (e4m3) go through uint8.
            raw = buf.view(torch.uint8) if buf.element_size() == 1 else buf
            raw[:n, :, :used] = raw[keep, :, :used]
            store[layer] = buf[:n]
    groups = cache.prefix_rows[keep].tolist()  # a kept row's group: its old prompt row
    first: dict[int, int] = {}
    for row, group in enumerate(groups):
        first.setdefault(group, row)
    device = cache.lengths.device
    # Every row holds its own copy of its prompt (SharedPrefill), so a group's first kept row can
    # serve the others whether or not the old first row was kept.
    cache.prefix_rows = torch.tensor([first[group] for group in groups], dtype=torch.int64, device=device)
    cache.prefix_lengths = cache.prefix_lengths[keep]
    if cache.prefix_groups is not None:
        cache.prefix_groups = remap_group_table(cache.prefix_groups, keep, cache.n_seqs)
    cache.lengths = cache.lengths[keep]
    cache.step_increment = cache.step_increment[keep]
    cache.rows = torch.arange(n, device=device)
    cache.step_masks.clear()
    cache.n_seqs = n


def remap_group_table(table: Tensor, keep: Tensor, n_rows: int) -> Tensor:
    """The shared-prompt table (int64 [G, R], rows of each chunk of a prompt's rows, -1 padded)
    over the kept rows (keep: int64 [n] of the old `n_rows`): each chunk's kept rows renumbered and
    moved to its front, the rest -1, in the same [G, R] shape. The shape stays so that a compiled
    decode step does not recompile for every compaction (the prompt kernel's grid and tile come
    from it); a chunk left empty is all -1 and skipped by the kernel."""
    new_index = torch.full((n_rows,), -1, dtype=torch.int64, device=table.device)
    new_index[keep] = torch.arange(keep.numel(), device=table.device)
    mapped = torch.where(table >= 0, new_index[table.clamp(min=0)], -1)
    order = torch.argsort((mapped < 0).to(torch.int32), dim=1, stable=True)  # kept rows first, in order
    return mapped.gather(1, order)


def min_row_steps(config: GenerationConfig) -> int:
    """The fewest row-steps a compaction must drop: `config.compact_min_row_steps`, or where that
    is None, MIN_ROW_STEPS_CAPTURED when steps are CUDA graphs (each compaction captures one) and
    0 otherwise (eager steps: the rows' copy is all it costs)."""
    if config.compact_min_row_steps is not None:
        return config.compact_min_row_steps
    return MIN_ROW_STEPS_CAPTURED if config.use_cuda_graph else 0


def rows_dynamic(config: GenerationConfig, rows_may_end: bool, step_row_counts: tuple[int, ...] = ()) -> bool:
    """Whether the decode step's first compile traces the row count symbolically
    (`actors.generation.decode_step.mark_rows_dynamic`): `config.compile_dynamic_rows`, or where
    that is None, when the step will see more than one row count: the call may compact (rows can
    end early, `rows_may_end`: a stop token, or trajectories an environment ends, and
    compact_fraction > 0), or its steps start at different counts (`step_row_counts`: a pipeline's
    unequal micro-batches, which share one compiled model). A call whose steps keep one row count
    keeps the static compile."""
    if config.compile_dynamic_rows is not None:
        return config.compile_dynamic_rows
    compacts = rows_may_end and config.compact_fraction > 0.0
    return compacts or len(set(step_row_counts)) > 1


class RowCompactor:
    """Which global rows the decode step holds (`active`: int64 [n] in step order, None while it
    holds all of them), and when to drop the finished ones (module docstring)."""

    def __init__(self, n_rows: int, config: GenerationConfig) -> None:
        self.n_step_rows = n_rows
        self.fraction = config.compact_fraction
        self.min_row_steps = min_row_steps(config)
        self.active: Tensor | None = None
        self.compactions = 0

    def due(self, live_rows: int | None, steps_left: int) -> bool:
        """Whether to compact now, with `live_rows` of the call's rows still generating (as last
        read from the device; None: not known yet) and at most `steps_left` decode steps to go:
        once the live rows are at most the fraction of the step's, with enough steps left, and
        dropping the others saves at least `min_row_steps` row-steps."""
        if live_rows is None or self.fraction <= 0.0:
            return False
        dropped_row_steps = (self.n_step_rows - live_rows) * steps_left
        return (0 < live_rows <= self.fraction * self.n_step_rows and steps_left >= MIN_STEPS_LEFT
                and dropped_row_steps >= self.min_row_steps)

    def compact(self, finished: Tensor, cache: HeadMajorKVCache) -> Tensor | None:
        """Drop the step's finished rows from `cache` (finished: bool [n_rows_total], by global
        row). Returns the kept step rows (int64 [n], to pick the next input with), or None when
        none is live (the call is done). Reads the flags on the host."""
        step_finished = finished if self.active is None else finished[self.active]
        keep = torch.nonzero(~step_finished).squeeze(1)
        if keep.numel() == 0:
            return None
        self.drop(keep, cache)
        return keep

    def drop(self, keep: Tensor, cache: HeadMajorKVCache) -> None:
        """Keep only the step rows `keep` (int64 [n], increasing, on the cache's device), decided
        elsewhere (the pipelined loop's last stage decides for every stage)."""
        keep_cache_rows(cache, keep)
        self.active = keep if self.active is None else self.active[keep]
        self.n_step_rows = keep.numel()
        self.compactions += 1


__all__ = ["MIN_ROW_STEPS_CAPTURED", "MIN_STEPS_LEFT", "RowCompactor", "keep_cache_rows", "min_row_steps",
           "remap_group_table", "rows_dynamic"]
