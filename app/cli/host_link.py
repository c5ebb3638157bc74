"""The host side of `python -m app profile`: the pinned host <-> GPU copy rate and the host RAM
per GPU, the two figures optimizer offload is planned with (`HardwareSpec.host_bw`,
`HardwareSpec.host_mem_bytes`; `planning.offload`).

host_bw is the rate of each direction while both run at once (a pinned copy of HOST_COPY_BYTES,
QUICK_HOST_COPY_BYTES with --quick, up on one stream and another down on a second, timed after
warm-up): the optimizer streams both directions at once, and the link shares itself between
them (on the lent H200: 54.7 and 55.3 GB/s alone, 47.5 GB/s each way at once). host_mem_bytes is this machine's RAM (the smaller of the
physical memory and a cgroup limit, as a container sees it) divided by the visible GPUs. On CPU
neither is measured: "device" and host are the same RAM and the preset's figures stay.
torch is imported inside the functions, so `python -m app plan` never loads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

HOST_COPY_BYTES = 256 * 2**20
QUICK_HOST_COPY_BYTES = 64 * 2**20
# cgroup v2 and v1 memory limits; a value this large or "max" means no limit.
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def measure_host_link(device: str, quick: bool, warmup: int, reps: int) -> dict[str, Any] | None:
    """{'h2d_bw', 'd2h_bw', 'host_bw', 'bytes', 'host_mem_bytes', 'gpus'} on CUDA; None on CPU."""
    if device != "cuda":
        return None
    import torch

    nbytes = QUICK_HOST_COPY_BYTES if quick else HOST_COPY_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_up = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / _copy_seconds(dev, host, warmup, reps)
    d2h = nbytes / _copy_seconds(host, dev, warmup, reps)
    both = nbytes / _duplex_seconds((dev_up, host), (host_down, dev), warmup, reps)
    gpus = max(1, torch.cuda.device_count())
    return {"h2d_bw": h2d, "d2h_bw": d2h, "host_bw": min(both, h2d, d2h), "bytes": nbytes,
            "host_mem_bytes": host_ram_bytes() / gpus, "gpus": gpus}


def _copy_seconds(dst: Any, src: Any, warmup: int, reps: int) -> float:
    """Mean seconds of one asynchronous copy src -> dst, by CUDA events around `reps` copies."""
    import torch

    for _ in range(max(1, warmup)):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(max(1, reps)):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / max(1, reps)


def _duplex_seconds(up: tuple[Any, Any], down: tuple[Any, Any], warmup: int, reps: int) -> float:
    """Mean seconds of one upload (dst, src) and one download (dst, src) run at once on two streams."""
    import torch

    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        up[0].copy_(up[1], non_blocking=True)
        with torch.cuda.stream(side):
            down[0].copy_(down[1], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    for _ in range(max(1, warmup)):
        both()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(max(1, reps)):
        both()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / max(1, reps)


def host_ram_bytes() -> float:
    """This machine's RAM as its processes see it: physical memory, or a smaller cgroup limit."""
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for name in CGROUP_LIMIT_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return float(text)
    return physical


__all__ = ["HOST_COPY_BYTES", "host_ram_bytes", "measure_host_link"]
