"""Hand-written Triton kernels, each an optional fast path for CUDA beside a plain-torch twin.

Imports nothing of actors/ but its own modules (the bottom layer).
  switch            when the kernels run: `triton_on(device)`, and Triton's interpreter for CPU tests
  decode_attention  one decode step's attention: append K/V, attend over each sequence's length
  decode_launch     that attention's launch shape: split count, tuning class, head dims it takes
  prefix_attention  a shared prompt's part of that attention, once per group of rows
  online_softmax    the block loop and merge those kernels share (Triton device functions)
  fused_logprobs    token log-probabilities over (vocab-parallel) logits in one pass per row
  fused_sampling    greedy and untruncated temperature sampling of one token per row
  segment_copy      many strided 2-D copies in one launch (reallocation packing and unpacking)
"""

from __future__ import annotations

from actors.kernels.decode_attention import gqa_decode_attention
from actors.kernels.decode_launch import default_splits, kernel_supports_head_dim, sm_count
from actors.kernels.fused_logprobs import logprob_grad, logprob_row_stats
from actors.kernels.fused_sampling import sample_rows, sample_rows_reference
from actors.kernels.prefix_attention import prefix_partials
from actors.kernels.segment_copy import (
    PROGRAMS,
    Copy2D,
    CopyTable,
    bases_aligned,
    launch_copies,
    resolve_fields,
    source_deltas,
)
from actors.kernels.switch import e4m3_native, triton_on, triton_reads_e4m3, triton_runs

__all__ = [
    # switch.py
    "e4m3_native", "triton_on", "triton_reads_e4m3", "triton_runs",
    # decode_attention.py
    "gqa_decode_attention",
    # decode_launch.py
    "default_splits", "kernel_supports_head_dim", "sm_count",
    # fused_logprobs.py
    "logprob_grad", "logprob_row_stats",
    # fused_sampling.py
    "sample_rows", "sample_rows_reference",
    # prefix_attention.py
    "prefix_partials",
    # segment_copy.py
    "Copy2D", "CopyTable", "PROGRAMS", "bases_aligned", "launch_copies", "resolve_fields", "source_deltas",
]
