"""The configured cluster against the live Ray cluster, before any worker or placement group.

`cluster.nodes x cluster.gpus_per_node` must fit the Ray cluster this run joins: the planner's
nodes are the first Ray nodes (head first, then by IP and node id) with that many GPUs and the
CPUs their workers reserve (`RayClusterInfo.cpus_per_worker`, `cluster.resources.select_nodes`). What does not fit is a
`ConfigError` on `cluster` naming what is missing and listing the cluster's GPU nodes, so a
run never waits on a placement group that cannot be placed.

Two more mismatches fail here, in one line each:
* `cluster.virtual_gpus=true` with `cluster.nodes > 1` and no cluster to join: a local Ray is
  one node, so more nodes need a Ray cluster (`ray start` on each machine, then `RAY_ADDRESS`);
* `cluster.virtual_gpus=false` on nodes whose GPU resources have no CUDA device (a CPU-only
  host started with `--num-gpus`): the workers would fail setting their CUDA device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import ray

from app.config import ConfigError, ExperimentConfig
from cluster.resources import ClusterShortfall, RayClusterInfo, RayNode, probe_cuda, select_nodes


def check_local_start(cfg: ExperimentConfig) -> None:
    """Refuse several nodes of virtual GPUs when no Ray cluster is there to join."""
    c = cfg.cluster
    if c.virtual_gpus and c.nodes > 1 and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        raise ConfigError("cluster.nodes", c.nodes,
                          "1 for the local Ray that cluster.virtual_gpus=true starts (one node); for more nodes "
                          "start a Ray cluster (`ray start --head --num-gpus M`, then `ray start --address HEAD:PORT "
                          "--num-gpus M` on each other node) and set RAY_ADDRESS",
                          problem="no Ray cluster to join (RAY_ADDRESS is unset)")


def planner_nodes(cfg: ExperimentConfig, info: RayClusterInfo) -> RayClusterInfo:
    """`info` narrowed to the planner's nodes, in planner order; ConfigError when the Ray
    cluster cannot hold the configured one, or when its GPUs are not CUDA devices and
    cluster.virtual_gpus is false."""
    c = cfg.cluster
    # Nodes and GPUs first, then whether the GPUs are CUDA devices, then the workers' CPUs: the
    # most basic mismatch is the one reported.
    by_gpus = _select(cfg, info, cpus_per_gpu=0.0)
    if not info.virtual:
        _check_cuda(by_gpus)
    nodes = _select(cfg, info, info.cpus_per_worker)
    if not info.virtual:
        _check_cuda([n for n in nodes if n not in by_gpus])
    return replace(info, nodes=nodes, spec=replace(info.spec, nodes=c.nodes, gpus_per_node=c.gpus_per_node))


def _check_cuda(nodes: Sequence[RayNode]) -> None:
    if not nodes:
        return
    names = probe_cuda(nodes)
    no_cuda = [n for n in nodes if names[n.node_id] is None]
    if no_cuda:
        raise ConfigError("cluster.virtual_gpus", False,
                          "true on a Ray cluster whose GPU resources are not CUDA devices (the workers then run on "
                          "CPU with gloo)",
                          problem=f"torch sees no CUDA device on node(s) {'; '.join(n.describe() for n in no_cuda)}")


def _select(cfg: ExperimentConfig, info: RayClusterInfo, cpus_per_gpu: float) -> tuple[RayNode, ...]:
    c = cfg.cluster
    try:
        return select_nodes(info.nodes, c.nodes, c.gpus_per_node, cpus_per_gpu)
    except ClusterShortfall as exc:
        raise ConfigError("cluster", f"{c.nodes}x{c.gpus_per_node}", f"at most what the Ray cluster has: {exc.have}",
                          problem=f"larger than the Ray cluster: {exc.missing}") from None


__all__ = ["check_local_start", "planner_nodes"]
