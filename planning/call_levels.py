"""A call's memory levels as executions (`planning.cost.call_cost_levels`): how many micro-batches
(training, inference) or generation rounds each level runs per dp replica, the token budget or
round count the plan records for it, and back.

    level_splits(mfc, layout, seqs)          # [first, 2 x first, ...] up to one sequence each
    level_execution(mfc, seqs, split)        # CallExecution(micro_batch_tokens=...) or (gen_rounds=...)
    split_of(mfc, seqs, execution)           # the split an execution gives (its inverse, rounded)
"""

from __future__ import annotations

import math

from planning.dataflow import MFC
from planning.layout import Layout
from planning.plan import CallExecution

# Largest micro-batch (tokens per data-parallel replica) before memory forces a smaller one.
# Larger ones buy nothing measurable: the peer bench's training call (issue 27, fifth step in
# docs/benchmarks.md) took 4.74-4.82 s at 10 x 32,768 tokens against 4.73-4.81 s at 20 x 16,384,
# and peaked 28 GiB higher.
MAX_MICRO_TOKENS = 16384
# The cap for inference calls (one forward, no activations kept for a backward, so a larger
# micro-batch costs only its transient memory). A small model's forward in micro-batches of 16,384
# tokens leaves the GPU waiting on the host between its short kernels: the 0.5B GRPO shape's
# forward (64 x 8 rows of 256 + 512 tokens) took 0.838 s in 24 micro-batches, GPU idle 473 ms,
# and 0.719 s in 12 of 32,768 tokens, idle 47 ms (issue 27, twelfth step in docs/benchmarks.md);
# the cost model's per-micro-batch terms price the same 15%. In one later call (thirteenth step):
# 0.725 s in 12 of 32,768 and 0.668 s in 6 of 65,536. Each level still has to fit memory, which
# the plan checks; a call without a plan keeps MAX_MICRO_TOKENS (actors.worker.execution).
MAX_INFERENCE_MICRO_TOKENS = 65536


def split_of(mfc: MFC, seqs: int, execution: CallExecution) -> int:
    """Micro-batches (or rounds) per replica that `execution` gives a replica of `seqs`
    sequences of `mfc` (at least 1, at most one sequence each)."""
    if mfc.kind == "generate":
        assert execution.gen_rounds is not None
        return max(1, min(seqs, execution.gen_rounds))
    assert execution.micro_batch_tokens is not None
    return max(1, min(seqs, math.ceil(seqs * mfc.batch.seq_len / execution.micro_batch_tokens)))


def level_execution(mfc: MFC, seqs: int, split: int) -> CallExecution:
    """The execution of a level: its rounds, or its micro-batches' token budget."""
    if mfc.kind == "generate":
        return CallExecution(gen_rounds=split)
    return CallExecution(micro_batch_tokens=math.ceil(seqs * mfc.batch.seq_len / split))


def level_splits(mfc: MFC, layout: Layout, seqs: int) -> list[int]:
    """Micro-batch counts (train, inference) or generation rounds to consider, doubling."""
    if mfc.kind == "generate":
        first = 1
    else:
        tokens = seqs * mfc.batch.seq_len
        cap = MAX_MICRO_TOKENS if mfc.kind == "train" else MAX_INFERENCE_MICRO_TOKENS
        first = min(seqs, max(2 * layout.pp if layout.pp > 1 else 1, math.ceil(tokens / cap)))
    out = [first]
    while out[-1] < seqs:
        out.append(min(seqs, 2 * out[-1]))
    return out


__all__ = ["MAX_INFERENCE_MICRO_TOKENS", "MAX_MICRO_TOKENS", "level_execution", "level_splits", "split_of"]
