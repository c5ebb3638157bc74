"""GPU and interconnect descriptions the cost model reasons with.

Figures are per GPU. Presets carry vendor peaks scaled by efficiencies typical of large bf16
GEMMs and NCCL collectives; a measured profile (`python -m app profile`, JSON) overrides them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One GPU model and the links between GPUs.

    peak_flops: dense bf16 FLOP/s reachable by large matmuls.
    hbm_bw: bytes/s of device memory reachable by streaming kernels.
    mem_bytes: usable device memory.
    intra_node_bw: bytes/s one GPU sends to another GPU of its node (NVLink), per direction.
    inter_node_bw: bytes/s one GPU sends to a GPU of another node (its NIC share).
    collective_latency_s: fixed cost of one collective or p2p message.
    kernel_overhead_s: fixed cost per layer per step (launches, small kernels).
    """

    name: str
    peak_flops: float
    hbm_bw: float
    mem_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    collective_latency_s: float = 10e-6
    kernel_overhead_s: float = 20e-6

    def with_profile(self, path: str | Path) -> HardwareSpec:
        """Copy of this spec with the fields a measured profile JSON provides."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object, got {type(data).__name__}")
        known = {k: v for k, v in data.items() if k in self.__dataclass_fields__ and k != "name"}
        for key, value in known.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"profile {path}: {key}={value!r} must be a positive number")
        return replace(self, **{k: float(v) for k, v in known.items()})

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-80g": HardwareSpec(
        name="a100-80g", peak_flops=312e12 * 0.75, hbm_bw=2.0e12 * 0.85, mem_bytes=80 * GiB * 0.92,
        intra_node_bw=240e9, inter_node_bw=25e9,
    ),
    "h100-80g": HardwareSpec(
        name="h100-80g", peak_flops=989e12 * 0.75, hbm_bw=3.35e12 * 0.85, mem_bytes=80 * GiB * 0.92,
        intra_node_bw=360e9, inter_node_bw=50e9,
    ),
    # Measured on the lent H200s: bf16 matmul 785 TFLOP/s, HBM copy 4.3 TB/s, NCCL bcast 367 GB/s.
    "h200-141g": HardwareSpec(
        name="h200-141g", peak_flops=785e12, hbm_bw=4.3e12, mem_bytes=139 * GiB * 0.95,
        intra_node_bw=367e9, inter_node_bw=50e9,
    ),
    # Virtual GPUs of the CPU test setup: gloo over loopback, a few GFLOP/s per worker.
    "cpu": HardwareSpec(
        name="cpu", peak_flops=20e9, hbm_bw=10e9, mem_bytes=4 * GiB,
        intra_node_bw=1e9, inter_node_bw=1e9, collective_latency_s=200e-6, kernel_overhead_s=50e-6,
    ),
}


def hardware_preset(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ValueError(f"gpu {name!r}: unknown; allowed: {', '.join(HARDWARE_PRESETS)}") from None
