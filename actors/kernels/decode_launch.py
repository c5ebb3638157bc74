"""How a decode attention launch is shaped, from the shape and the GPU alone (no lengths, so one
captured CUDA graph serves every step): whether the Triton kernels take a head_dim, the split
count of the split-K kernel (`decode_splits`, `default_splits`), the tuning class of a slot count
(`slots_class`, part of the autotuner's key) and the GPU's multiprocessor count (`sm_count`).
The kernels themselves are in actors.kernels.decode_attention."""

from __future__ import annotations

import torch

# decode_splits: split only grids under 2 programs per SM (64 sequences x 8 KV heads of 2048 slots,
# ~3.9 per SM, read at ~97% of an H200's bandwidth unsplit and ~86% split in 2), then up to ~4 per
# SM; chunks of >= 256 slots, at most 16 splits (benchmarks/decode_attention_bench.py).
SPLIT_BELOW_PER_SM = 2
PROGRAMS_PER_SM = 4
MIN_CHUNK = 256
MAX_SPLITS = 16
_SM_COUNTS: dict[int, int] = {}  # CUDA device index -> multiprocessors


def kernel_supports_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernel handles `head_dim` (tl.arange needs a power of two; the MMA a
    size of at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_splits(n_seqs: int, n_kv: int, capacity: int, n_sms: int) -> int:
    """Split count S for the split-K kernel, from the shape alone (no lengths: the choice is the
    same at every step of a captured CUDA graph). 1 when the n_seqs * n_kv programs already number
    SPLIT_BELOW_PER_SM * n_sms (e.g. 512 sequences x 8 KV heads on 132 SMs): splitting then only
    adds the partials' traffic and a second launch. Otherwise the smallest power of two with
    n_seqs * n_kv * S >= PROGRAMS_PER_SM * n_sms (enough loads in flight on every multiprocessor),
    capped so that each split's chunk of the `capacity` cache slots keeps >= MIN_CHUNK slots and
    S <= MAX_SPLITS: e.g. 16 for 8 sequences x 2 KV heads x 8192 slots."""
    programs = n_seqs * n_kv
    if programs >= SPLIT_BELOW_PER_SM * n_sms:
        return 1
    splits = 1
    while splits < MAX_SPLITS and programs * splits < PROGRAMS_PER_SM * n_sms and capacity // (2 * splits) >= MIN_CHUNK:
        splits *= 2
    return splits


def slots_class(slots: int) -> int:
    """The bit length of a slot count (>= 1), the tuning key's SLOTS_CLASS, found by comparisons
    only: when a compiled decode step traces the cache's slot count symbolically
    (actors.generation.decode_step.mark_slots_dynamic) each comparison is a range guard, so one
    trace serves every count of the class, where `int(slots)` would pin the exact count and
    recompile the step for each new one."""
    bits = 1
    while slots >= 1 << bits:
        bits += 1
    return bits


def default_splits(n_seqs: int, n_kv: int, capacity: int, device: torch.device) -> int:
    """The split count `gqa_decode_attention` takes on `device` when given neither splits nor
    block_n: `decode_splits` with the GPU's multiprocessor count on CUDA, else 1."""
    return decode_splits(n_seqs, n_kv, capacity, sm_count(device)) if device.type == "cuda" else 1


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, cached in a plain dict that torch.compile traces quietly.
    Call it once before a compiled function first reads it: a trace that fills the dict leaves a
    guard ("device not in the dict") that fails on the next call, which recompiles the whole
    function (a decode step: seconds)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


__all__ = [
    "MAX_SPLITS", "MIN_CHUNK", "PROGRAMS_PER_SM", "SPLIT_BELOW_PER_SM", "decode_splits", "default_splits",
    "kernel_supports_head_dim", "slots_class", "sm_count",
]
