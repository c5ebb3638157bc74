"""The link between two Ray nodes, measured: what the planner's `inter_node_bw` stands for.

`measure_inter_node` starts one `LinkProbe` actor on each of the first two GPU nodes of the Ray
cluster this process is connected to (one GPU each, pinned like the training workers), joins
them in a world of two (NCCL on CUDA devices, gloo on virtual GPUs) and times, as the slowest
rank sees it, the broadcast of `nbytes` from node 0 to node 1 and a 4-byte all-reduce (the fixed
cost of a message). The link rate is the broadcast's bytes over its time less that fixed cost,
the same reading `python -m app profile` makes of the intra-node broadcast.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from cluster.collective import rendezvous
from cluster.placement import create_workers
from cluster.resources import gpu_nodes, select_nodes
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec

PROBE_TIMEOUT_S = 300.0


class LinkProbe:
    """One end of the link: a process holding one GPU (or a virtual one, on CPU)."""

    def __init__(self, device: str) -> None:
        torch.set_num_threads(1)
        self.device = torch.device(device)

    def time_link(self, nbytes: int, warmup: int, reps: int) -> tuple[float, float]:
        """(median seconds of a broadcast of `nbytes` from rank 0, of a 4-byte all-reduce), the
        slowest rank's (a broadcast's root can finish before its receiver)."""
        big = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        small = torch.ones(1, dtype=torch.float32, device=self.device)
        seconds = torch.tensor([self._median(lambda: dist.broadcast(big, src=0), warmup, reps),
                                self._median(lambda: dist.all_reduce(small), warmup, 10 * reps)],
                               dtype=torch.float64, device=self.device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        broadcast_s, small_s = seconds.tolist()
        return broadcast_s, small_s

    def _median(self, fn: object, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()  # type: ignore[operator]
        dist.barrier()
        times = []
        for _ in range(reps):
            self._sync()
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class InterNodeTiming:
    """The broadcast of `nbytes` between two nodes and the fixed cost of a message, in seconds."""

    nodes: tuple[str, str]  # "ip (node id prefix)" of each end
    backend: str
    nbytes: int
    broadcast_s: float
    small_allreduce_s: float

    @property
    def bandwidth(self) -> float:
        """Bytes/s once the fixed cost is paid: `inter_node_bw` of the hardware profile."""
        return self.nbytes / max(self.broadcast_s - self.small_allreduce_s, 1e-9)


def measure_inter_node(nbytes: int, virtual: bool, warmup: int = 1, reps: int = 3,
                       timeout_s: float = PROBE_TIMEOUT_S) -> InterNodeTiming:
    """Time the link between the first two GPU nodes of the connected Ray cluster.

    virtual: the nodes' GPUs are virtual (gloo on CPU) rather than CUDA devices (NCCL).
    Raises `ClusterShortfall` when fewer than two nodes hold a GPU.
    """
    nodes = select_nodes(gpu_nodes(ray.nodes()), 2, 1, 0.0 if virtual else 1.0)
    spec = ClusterSpec(2, 1, hardware_preset("cpu"))
    backend, device = ("gloo", "cpu") if virtual else ("nccl", "cuda:0")
    probes = create_workers(LinkProbe, spec, {"device": device}, cpus_per_worker=0.0 if virtual else 1.0,
                            name_prefix="link-probe", ready_timeout_s=timeout_s, nodes=nodes)
    try:
        rendezvous(probes, backend, timeout_s)
        timings = probes.get(probes.call("time_link", nbytes, warmup, reps), timeout_s)
    finally:
        probes.shutdown()
    broadcast_s, small_s = timings[0]
    ends = (f"{nodes[0].ip} ({nodes[0].node_id[:8]})", f"{nodes[1].ip} ({nodes[1].node_id[:8]})")
    return InterNodeTiming(ends, backend, max(1, nbytes // 4) * 4, broadcast_s, small_s)


__all__ = ["PROBE_TIMEOUT_S", "InterNodeTiming", "LinkProbe", "measure_inter_node"]
