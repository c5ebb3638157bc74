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
    gemm_ramp_tokens: tokens' worth of FLOPs each micro-batch's pass pays on top of its own (each
        GEMM's ramp and partly filled last wave; 0 where matmuls have no waves to fill, the CPU).
    fused_elementwise: the engine fuses the blocks' norms, rotary and SwiGLU gate on this GPU
        (CUDA: torch.compile), which saves fewer activations for backward than eager kernels.
    generate_setup_s: fixed cost per layer of each generation round before its first decode step
        (the round's cache and fused QKV weights built, its decode step's CUDA graphs captured).
    host_bw: bytes/s between pinned host memory and one GPU, per direction (PCIe is full duplex:
        both directions at once each get this). Optimizer offload streams through it.
    host_mem_bytes: host RAM per GPU a plan may fill (node RAM / GPUs of the node, before the
        reserve for Ray and the worker processes: `planning.offload.host_capacity_bytes`). The
        GPUs of a node share their node's RAM: the planner checks the sum per node.
    fp8_matmul: the GPU multiplies e4m3 operands in hardware (compute capability >= 8.9), so an
        FP8 decode (sampling.fp8) runs faster there; elsewhere a config asking for one is refused
        (the CPU emulates it, for tests, and is priced as bf16).
    """

    name: str
    peak_flops: float
    hbm_bw: float
    mem_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    collective_latency_s: float = 10e-6
    kernel_overhead_s: float = 20e-6
    generate_setup_s: float = 0.0
    gemm_ramp_tokens: float = 512.0
    fused_elementwise: bool = True
    host_bw: float = 25e9
    host_mem_bytes: float = 128 * GiB
    fp8_matmul: bool = False

    def with_profile(self, path: str | Path) -> HardwareSpec:
        """Copy of this spec with the fields a measured profile JSON provides."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object, got {type(data).__name__}")
        return self.with_profile_fields(data, str(path))

    def with_profile_fields(self, data: dict[str, object], source: str = "profile") -> HardwareSpec:
        """Copy of this spec with the numeric fields of a profile's JSON object."""
        known = {k: v for k, v in data.items()
                 if k in self.__dataclass_fields__ and k not in ("name", "fused_elementwise", "fp8_matmul")}
        for key, value in known.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"profile {source}: {key}={value!r} must be a positive number")
        return replace(self, **{k: float(v) for k, v in known.items()})  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


# Host links and RAM (host_bw, host_mem_bytes): PCIe Gen4 x16 moves about 25 GB/s per direction
# with pinned memory, Gen5 x16 about 50 GB/s. Host RAM per GPU is node RAM / 8 for the vendors'
# 8-GPU servers (DGX A100: 1 TiB, DGX H100/H200: 2 TiB), except for h200-141g (see there). A
# profile (`python -m app profile`: pinned copies, physical RAM / visible GPUs) replaces both.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-80g": HardwareSpec(
        name="a100-80g", peak_flops=312e12 * 0.75, hbm_bw=2.0e12 * 0.85, mem_bytes=80 * GiB * 0.92,
        intra_node_bw=240e9, inter_node_bw=25e9, host_bw=25e9, host_mem_bytes=128 * GiB,
    ),
    # Measured on a lent H100 80GB HBM3 SXM (700 W; 2026-12-06, `python -m app profile --gpu h100-80g`):
    # bf16 matmul 787.5 TFLOP/s (the H200's rate: the same tensor cores under the same power cap),
    # HBM copy 2.97 TB/s (the H200's is 4.3), 79.2 GiB of which the profile counts 95% as usable,
    # pinned host copies 55.2 GB/s each way alone and 36.7 both at once, 125.8 GiB of RAM on a
    # one-GPU host (taken as 128 GiB as for h200-141g; a DGX H100 has 256 GiB per GPU: profile it).
    # The per-layer and per-round decode terms are the H200's; the efficiencies are fitted to first
    # plans on the H100 (planning.efficiency.PRESET_EFFICIENCY). NVLink is not measured on one GPU; 360 GB/s is
    # the H200's measured broadcast (same NVLink 4) rounded down.
    "h100-80g": HardwareSpec(
        name="h100-80g", peak_flops=787e12, hbm_bw=2.97e12, mem_bytes=79.2 * GiB * 0.95,
        intra_node_bw=360e9, inter_node_bw=50e9, host_bw=36.7e9, host_mem_bytes=128 * GiB,
        kernel_overhead_s=65e-6, generate_setup_s=9e-3, fp8_matmul=True,
    ),
    # Measured on the lent H200s: bf16 matmul 785 TFLOP/s, HBM copy 4.3 TB/s, NCCL bcast 367 GB/s.
    # kernel_overhead_s and generate_setup_s: fitted to the generate calls of 0.5B-8B models (a
    # decode step costs ~65 us per layer beyond its weight, KV and sampling traffic: a dozen small
    # kernels each with a fixed ramp, even replayed from a CUDA graph; each round ~9 ms per layer
    # before its first step; 2026-12-03, benchmarks/fit_efficiency.py, docs/benchmarks.md). The
    # default gemm_ramp_tokens (512) comes from the same runs' training calls (an 8B model's
    # 1024-token micro-batches).
    # host_bw: pinned copies 54.7 GB/s up, 55.3 down, 47.5 each way at once (2026-12-02,
    # benchmarks/offload_bench.py; the optimizer streams both ways). host_mem_bytes: the lent one-GPU H200 machine
    # has 128 GiB of RAM; a DGX H200 has 2 TiB for 8 GPUs (256 GiB each). The preset takes the
    # smaller, so a plan made with it also runs on the lent machine; profile a bigger host.
    "h200-141g": HardwareSpec(
        name="h200-141g", peak_flops=785e12, hbm_bw=4.3e12, mem_bytes=139 * GiB * 0.95,
        intra_node_bw=367e9, inter_node_bw=50e9, host_bw=47.5e9, host_mem_bytes=128 * GiB,
        kernel_overhead_s=65e-6, generate_setup_s=9e-3, fp8_matmul=True,
    ),
    # Virtual GPUs of the CPU test setup: gloo over loopback, a few GFLOP/s per worker; "device"
    # and host memory are the same RAM, so offload is a plain copy.
    "cpu": HardwareSpec(
        name="cpu", peak_flops=20e9, hbm_bw=10e9, mem_bytes=4 * GiB,
        intra_node_bw=1e9, inter_node_bw=1e9, collective_latency_s=200e-6, kernel_overhead_s=50e-6,
        host_bw=5e9, host_mem_bytes=16 * GiB, gemm_ramp_tokens=0.0, fused_elementwise=False,
    ),
}


def hardware_preset(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ValueError(f"gpu {name!r}: unknown; allowed: {', '.join(HARDWARE_PRESETS)}") from None
