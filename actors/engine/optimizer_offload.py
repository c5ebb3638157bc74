"""Optimizer state in host memory: the tail of a rank's optimizer slice, streamed through the GPU.

`ShardedAdamW` (actors.engine.optimizer) keeps three fp32 vectors over its slice of S elements:
the master weights and Adam's m and v. With a host fraction f (the plan's
`ExecutionPlan.optimizer_offload`), elements [0, split) stay on the device and the tail
[split, S) lives here, in one flat host buffer [3, S - split] page-locked with cudaHostRegister
(pinned memory from torch's caching host allocator is rounded up to a power of two: 24 GiB of state
would pin 32). For each optimizer step `ChunkStreamer.run` moves the tail through two device
staging sets of `planning.plan.offload_chunk_elements` elements (16 Mi, fewer for a small part):

    h2d stream:      load chunk 0 | load chunk 1 | load chunk 2 (waits for set 0's write-back) ...
    compute stream:                 update chunk 0 | update chunk 1 | ...
    d2h stream:                                     write back chunk 0 | write back chunk 1 | ...

so the copies in both directions (PCIe is full duplex) overlap the update of the chunk between
them. The update runs the same elementwise kernels on the same values as the all-device path, so
the result is the same bit for bit (tests/actors/engine/test_optimizer_offload.py checks it); the
split is aligned to ALIGN elements so every chunk starts where a vector kernel's lanes would.

On a machine without CUDA the "device" is host memory too: the same chunk loop runs with plain
copies, which is what the CPU tests exercise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from planning.plan import OFFLOAD_ALIGN, OFFLOAD_CHUNK_ELEMENTS

# What ShardedAdamW keeps per element of its slice (each a fp32 [S] tensor of the same name).
OPTIMIZER_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
# The device/host boundary and every chunk start are multiples of this many elements.
ALIGN = OFFLOAD_ALIGN


def device_elements(slice_size: int, host_fraction: float) -> int:
    """Elements of an [S] slice kept on the device when `host_fraction` of it goes to the host:
    at least that fraction is moved (the boundary rounds down to ALIGN)."""
    if not 0.0 <= host_fraction <= 1.0:
        raise ValueError(f"host_fraction={host_fraction}: must be in [0, 1]")
    if host_fraction == 0.0:
        return slice_size
    split = max(0, slice_size - math.ceil(slice_size * host_fraction))
    return split - split % ALIGN


class HostState:
    """The host part of the optimizer state: fp32 [n] per key, views of one [3, n] buffer."""

    def __init__(self, n: int, pin: bool) -> None:
        self.n = n
        self.buffer = torch.zeros((len(OPTIMIZER_STATE_KEYS), n), dtype=torch.float32)
        self.parts = {key: self.buffer[i] for i, key in enumerate(OPTIMIZER_STATE_KEYS)}
        self.registered = False
        if pin and n:
            # Page-lock the buffer in place (no copy, no rounding); async copies need it.
            code = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes / 2**30:.1f} GiB of optimizer state failed "
                                   f"(error {int(code)}): the host may not have that much lockable memory")
            self.registered = True

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def close(self) -> None:
        """Unlock the buffer (before it is freed)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False

    def __del__(self) -> None:
        self.close()


ChunkFn = Callable[[dict[str, Tensor], int, int], None]


class ChunkStreamer:
    """Runs `fn(staged, a, b)` over host elements [a, b) chunk by chunk on `device`: `staged` maps
    each state key to a device tensor [b - a] holding those elements; what `fn` leaves there is
    written back to the host. See the module docstring for the overlap."""

    def __init__(self, host: HostState, device: torch.device, chunk_elements: int = OFFLOAD_CHUNK_ELEMENTS) -> None:
        if chunk_elements < ALIGN or chunk_elements % ALIGN:
            raise ValueError(f"chunk_elements={chunk_elements}: must be a positive multiple of {ALIGN}")
        self.host, self.device, self.chunk = host, device, chunk_elements

    def ranges(self) -> list[tuple[int, int]]:
        return [(a, min(self.host.n, a + self.chunk)) for a in range(0, self.host.n, self.chunk)]

    def _staging(self, sets: int) -> list[dict[str, Tensor]]:
        size = min(self.chunk, self.host.n)
        return [{key: torch.empty(size, dtype=torch.float32, device=self.device) for key in OPTIMIZER_STATE_KEYS}
                for _ in range(sets)]

    def run(self, fn: ChunkFn) -> None:
        if self.host.n == 0:
            return
        if self.device.type != "cuda":
            staged = self._staging(1)[0]
            for a, b in self.ranges():
                views = {key: staged[key][: b - a] for key in OPTIMIZER_STATE_KEYS}
                for key, view in views.items():
                    view.copy_(self.host.parts[key][a:b])
                fn(views, a, b)
                for key, view in views.items():
                    self.host.parts[key][a:b].copy_(view)
            return
        self._run_cuda(fn)

    def _run_cuda(self, fn: ChunkFn) -> None:
        ranges = self.ranges()
        sets = self._staging(min(2, len(ranges)))
        compute = torch.cuda.current_stream(self.device)
        h2d, d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        h2d.wait_stream(compute)  # the staging buffers and the gradient come from the compute stream
        freed: list[torch.cuda.Event | None] = [None] * len(sets)  # each set's last write-back done
        for i, (a, b) in enumerate(ranges):
            s = i % len(sets)
            views = {key: sets[s][key][: b - a] for key in OPTIMIZER_STATE_KEYS}
            with torch.cuda.stream(h2d):
                if freed[s] is not None:
                    h2d.wait_event(freed[s])
                for key, view in views.items():
                    view.copy_(self.host.parts[key][a:b], non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(h2d)
            compute.wait_event(loaded)
            fn(views, a, b)
            updated = torch.cuda.Event()
            updated.record(compute)
            with torch.cuda.stream(d2h):
                d2h.wait_event(updated)
                for key, view in views.items():
                    self.host.parts[key][a:b].copy_(view, non_blocking=True)
                freed[s] = torch.cuda.Event()
                freed[s].record(d2h)
        # The host holds the new state only once the last write-back ran; the staging buffers
        # return to the allocator after that (every use of them is then complete).
        d2h.synchronize()


__all__ = ["ALIGN", "OPTIMIZER_STATE_KEYS", "ChunkStreamer", "HostState", "device_elements"]
