"""Optimizer offload in the planner: what a trained role's optimizer state costs when a fraction
of it lives in pinned host memory.

The engine (`actors.engine.optimizer_offload`) keeps the tail fraction f of every rank's ZeRO-1
slice (fp32 master weights and Adam m, v: OPTIMIZER_BYTES_PER_PARAM per element) on the host and,
for each optimizer step, streams it through two GPU staging sets of (master, m, v) chunks of
`planning.plan.offload_chunk_elements` elements: chunk i+1 loads while chunk i is updated and
chunk i-1 is written back. So, per GPU of the train mesh:

* GPU memory: (1 - f) of the slice stays resident (the `optimizer_bytes` breakdown entry) and
  the staging sets are transient (`offload_buffer_bytes`, only when f > 0);
* host memory: f of the slice (`CallCost.host_bytes`, never added to GPU memory);
* time per optimizer step (`offload_s`): both directions overlap (PCIe is full duplex), so the
  bytes of one direction at `HardwareSpec.host_bw`, plus one chunk each way the pipeline cannot
  overlap (the first load, the last write-back), plus a launch-and-sync latency per chunk. The
  update of the host part is already in `optimizer_s` (it is the same HBM work) and is hidden
  under the copies, which are ~100x slower; counting both is pessimistic by that update.

Host memory is a plan constraint: per node, the host parts of every offloaded role's GPUs on it
must fit `host_capacity_bytes` times the node's GPUs (the node's RAM is shared). Ray's object
store and the worker processes need their part first: HOST_RESERVE_FRACTION and
HOST_RESERVE_PER_GPU_BYTES.

The search (`planning.search.search_plan`) offloads only when no plan fits without it, and then
the least that makes one fit, in steps of 1/OFFLOAD_STEPS of a role's state
(`planning.offload_search.offload_ladder`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from planning.hardware import GiB, HardwareSpec
from planning.plan import offload_chunk_elements

# Bytes of optimizer state per parameter: fp32 master weights + Adam m and v.
OPTIMIZER_BYTES_PER_PARAM = 12
# The engine's double buffering: one staging set in flight while the other is updated.
OFFLOAD_STAGING_SETS = 2
# Per chunk and direction: an async copy's launch plus the event the next stream waits on.
OFFLOAD_CHUNK_LATENCY_S = 20e-6
# Host RAM the plan leaves alone. Ray's object store takes 30% of a node's memory by default
# (`ray start --object-store-memory` changes it; call outputs live there), and every GPU's worker
# process needs a few GiB of its own (Python, torch and the CUDA context, checkpoint and rollout
# buffers; ~2-3 GiB resident measured on the H200 workers, 4 GiB leaves room).
HOST_RESERVE_FRACTION = 0.3
HOST_RESERVE_PER_GPU_BYTES = 4 * GiB
# The search offloads in steps of 1/OFFLOAD_STEPS of a role's optimizer state.
OFFLOAD_STEPS = 8
# A plan that fits without offload takes the same placements with one ladder step offloaded
# only when that is estimated at least this much faster (memory freed for larger micro-batches).
OFFLOAD_MIN_GAIN = 0.02


def check_fractions(field: str, fractions: Iterable[tuple[str, float]], trained: Iterable[str]) -> None:
    """ValueError naming `field` unless every (role, fraction) names a trained role once, with a
    fraction in (0, 1]."""
    allowed = tuple(trained)
    seen: set[str] = set()
    for role, fraction in fractions:
        if role not in allowed:
            raise ValueError(f"{field}[{role!r}]: not a trained role of the graph; "
                             f"allowed: {', '.join(allowed) or 'none'}")
        if role in seen:
            raise ValueError(f"{field}[{role!r}]: given twice")
        seen.add(role)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"{field}[{role!r}]={fraction!r}: must be a fraction in (0, 1]")


def normalized(fractions: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """(role, fraction) pairs in role order, zeros left out: the form plans and problems keep."""
    return tuple(sorted((role, float(f)) for role, f in fractions.items() if f > 0.0))


def host_elements(shard_params: float, fraction: float) -> float:
    """Elements of a rank's optimizer slice in host memory at `fraction`."""
    return math.ceil(shard_params * fraction) if fraction > 0.0 else 0.0


def staging_bytes(host: float) -> float:
    """GPU bytes of the staging sets that stream `host` elements: up to OFFLOAD_STAGING_SETS
    sets of master, m and v (fp32) chunks, each no longer than the host part."""
    if host <= 0:
        return 0.0
    chunk = offload_chunk_elements(int(host))
    chunks = math.ceil(host / chunk)
    return min(OFFLOAD_STAGING_SETS, chunks) * OPTIMIZER_BYTES_PER_PARAM * min(chunk, host)


def offload_step_s(host: float, host_bw: float) -> float:
    """Seconds one optimizer step spends streaming `host` elements through the GPU (see the
    module docstring): one direction's bytes, one unoverlapped chunk, a latency per chunk."""
    if host <= 0:
        return 0.0
    chunk = offload_chunk_elements(int(host))
    chunks = math.ceil(host / chunk)
    moved = OPTIMIZER_BYTES_PER_PARAM * (host + min(chunk, host))
    return moved / host_bw + 2 * chunks * OFFLOAD_CHUNK_LATENCY_S


def optimizer_parts(shard_params: float, fraction: float, host_bw: float, steps: int) -> tuple[dict[str, float], float]:
    """The optimizer's breakdown entries of a train call (`optimizer_bytes` on the GPU, and with
    offload `offload_buffer_bytes` and `offload_s` for `steps` optimizer steps) and the host
    bytes per GPU, for a rank slice of `shard_params` elements with `fraction` on the host."""
    host = host_elements(shard_params, fraction)
    parts = {"optimizer_bytes": OPTIMIZER_BYTES_PER_PARAM * (shard_params - host)}
    if host > 0:
        parts["offload_buffer_bytes"] = staging_bytes(host)
        parts["offload_s"] = steps * offload_step_s(host, host_bw)
    return parts, OPTIMIZER_BYTES_PER_PARAM * host


def host_capacity_bytes(hw: HardwareSpec) -> float:
    """Host bytes per GPU a plan may fill with optimizer state: `host_mem_bytes` less Ray's
    object store share and the worker process's own memory (never below 0)."""
    return max(0.0, hw.host_mem_bytes * (1.0 - HOST_RESERVE_FRACTION) - HOST_RESERVE_PER_GPU_BYTES)


def describe_capacity(hw: HardwareSpec) -> str:
    """'81.6 GiB usable per GPU (h200-141g: host_mem_bytes 128 GiB, less 30% for Ray's object
    store and 4 GiB per worker)' for error messages."""
    return (f"{host_capacity_bytes(hw) / GiB:.1f} GiB usable per GPU ({hw.name}: host_mem_bytes "
            f"{hw.host_mem_bytes / GiB:.0f} GiB, less {HOST_RESERVE_FRACTION:.0%} for Ray's object store and "
            f"{HOST_RESERVE_PER_GPU_BYTES / GiB:.0f} GiB per worker)")


def node_host_excess(terms: list[tuple[int, int, float, str]], gpus_per_node: int,
                     hw: HardwareSpec) -> tuple[float, str]:
    """(bytes by which the fullest node's host memory overflows, <= 0 when every node fits; the
    reason naming that node, its roles, GiB needed and GiB available, or ''). terms: per
    offloaded role, (lo, hi, host bytes per GPU, role) of its train mesh [lo, hi)."""
    capacity = host_capacity_bytes(hw) * gpus_per_node
    worst, reason = -math.inf, ""
    for node in sorted({g // gpus_per_node for lo, hi, _, _ in terms for g in range(lo, hi)}):
        first, last = node * gpus_per_node, (node + 1) * gpus_per_node
        need: dict[str, float] = {}
        for lo, hi, per_gpu, role in terms:
            gpus = max(0, min(hi, last) - max(lo, first))
            if gpus and per_gpu > 0:
                need[role] = need.get(role, 0.0) + gpus * per_gpu
        total = sum(need.values())
        if total - capacity > worst:
            worst = total - capacity
            roles = ", ".join(f"{role} {b / GiB:.1f} GiB" for role, b in need.items())
            reason = (f"the optimizer state offloaded to node {node} needs {total / GiB:.1f} GiB "
                      f"({roles}), the node has {capacity / GiB:.1f} GiB for it: {describe_capacity(hw)}")
    return worst, reason if worst > 0 else ""


def describe_fractions(fractions: Mapping[str, float] | Iterable[tuple[str, float]]) -> str:
    """'actor 5/8, critic 1/8' (eighths when exact, else a percentage); 'none' when empty."""
    items = dict(fractions).items()
    return ", ".join(f"{role} {fraction_text(f)}" for role, f in items) or "none"


def fraction_text(f: float) -> str:
    """'5/8', 'all' or '12.5%' (eighths when exact, as the search chooses them)."""
    eighths = f * OFFLOAD_STEPS
    if abs(eighths - round(eighths)) < 1e-9:
        return "all" if round(eighths) == OFFLOAD_STEPS else f"{round(eighths)}/{OFFLOAD_STEPS}"
    return f"{f:.1%}"
