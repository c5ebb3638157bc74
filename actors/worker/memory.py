"""Measured GPU memory of one call: the peak allocated and reserved bytes since the call began.

A `MemoryProbe` is reset right before a call and read right after it (`actors.worker.calls.timed`),
so each call's metadata carries its own peak on this rank, next to the plan's estimate. On CUDA
that is the caching allocator's `max_memory_allocated` / `max_memory_reserved` (the peak
statistics reset per call); where the device cannot tell (CPU) the peak is None. The worker
takes any object with `reset()` and `peak()`, so tests can give it a probe that reports numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class MemoryPeak:
    """Peak bytes of one call on one rank: tensors allocated, and held by the allocator."""

    allocated_bytes: int
    reserved_bytes: int


class MemoryProbe(Protocol):
    """What `timed` needs of a memory probe."""

    def reset(self) -> None:
        """Start a new peak (called right before a call)."""

    def peak(self) -> MemoryPeak | None:
        """The peak since `reset`, or None when the device cannot tell."""


class CudaMemoryProbe:
    """The CUDA caching allocator's peak statistics of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> MemoryPeak:
        return MemoryPeak(int(torch.cuda.max_memory_allocated(self.device)),
                          int(torch.cuda.max_memory_reserved(self.device)))


class NoMemoryProbe:
    """A device without memory statistics (CPU): every peak is None."""

    def reset(self) -> None:
        return None

    def peak(self) -> MemoryPeak | None:
        return None


def memory_probe_for(device: torch.device) -> MemoryProbe:
    """The probe of `device`: the allocator's statistics on CUDA, none elsewhere."""
    return CudaMemoryProbe(device) if device.type == "cuda" else NoMemoryProbe()


__all__ = ["CudaMemoryProbe", "MemoryPeak", "MemoryProbe", "NoMemoryProbe", "memory_probe_for"]
