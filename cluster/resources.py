"""Connect to Ray (or start a local instance) and describe its GPUs as a `ClusterSpec`.

The planner reasons about N nodes x M identical GPUs, numbered globally `node * M + local`.
This module turns the live Ray cluster into that picture: it connects to `RAY_ADDRESS` (or an
explicit address), or starts a local Ray instance; it lists the alive nodes that hold GPUs in a
deterministic order (head first, then by IP and node id) and picks a `HardwareSpec` preset for
the cost model. `select_nodes` checks a wanted N x M against the live nodes before anything is
reserved: the first N nodes with M GPUs (and the CPUs the workers reserve) become planner nodes
0..N-1, and a shortfall is a `ClusterShortfall` naming what is missing and what the cluster has.
`probe_cuda` asks each chosen node whether torch sees a CUDA device there, so GPU resources
without CUDA (a CPU-only host started with `--num-gpus`) fail before any worker starts.

Virtual GPUs (CPU workers with gloo, hardware preset "cpu"): `virtual_gpus=N` without an address
starts a local Ray whose one node advertises N "GPU" resources (the tests and the quick start);
with an address (or an initialised Ray) every node's GPU resources of that cluster are virtual
GPUs, so a multi-node CPU cluster (`ray start --num-gpus 2` on each machine) runs the same way.
A job that asks for virtual GPUs on a Ray cluster advertising none (`ray start --head` with
default settings on a machine without GPUs, then `ray job submit`) gets N CPU slots of one node
instead: each virtual GPU is a bundle of `VIRTUAL_SLOT_CPU` CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from planning.hardware import HARDWARE_PRESETS, hardware_preset
from planning.layout import ClusterSpec

# Substrings of torch.cuda.get_device_name() -> hardware preset; checked in order.
GPU_NAME_TO_PRESET: tuple[tuple[str, str], ...] = (
    ("H200", "h200-141g"),
    ("H100", "h100-80g"),
    ("A100", "a100-80g"),
)
DEFAULT_GPU_PRESET = "h100-80g"
VIRTUAL_GPU_PRESET = "cpu"
HEAD_NODE_RESOURCE = "node:__internal_head__"
# The CPU share standing for one virtual GPU on a cluster without GPU resources: small, so a
# default 2-CPU node holds the tiny experiment's 4 workers (they compute on shared cores anyway).
VIRTUAL_SLOT_CPU = 0.01
# The directory holding the planning/, actors/, cluster/ and app/ packages.
PACKAGES_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RayStartOptions:
    """How to reach Ray.

    address: a Ray address to connect to; None means `RAY_ADDRESS` if set, else start locally.
    virtual_gpus: > 0 runs the workers on CPU (gloo) on "GPU" resources: a local Ray is started
        advertising this many; with an address, the cluster's own GPU resources are used.
    num_cpus: CPUs of a locally started instance (None: Ray's default, all cores).
    include_dashboard: start the dashboard of a local instance (False on the GPU test machine).
    hardware: a HardwareSpec preset name forcing the cost model's hardware; None detects it.
    """

    address: str | None = None
    virtual_gpus: int = 0
    num_cpus: int | None = None
    include_dashboard: bool = True
    hardware: str | None = None

    def __post_init__(self) -> None:
        # bool is an int in Python: reject it so `True` is not silently read as one GPU.
        if isinstance(self.virtual_gpus, bool) or not isinstance(self.virtual_gpus, int) or self.virtual_gpus < 0:
            raise ValueError(
                f"cluster.virtual_gpus={self.virtual_gpus!r}: must be the number of virtual GPUs (an integer >= 0)"
            )
        if self.num_cpus is not None and (not isinstance(self.num_cpus, int) or self.num_cpus < 1):
            raise ValueError(f"cluster.num_cpus={self.num_cpus!r}: must be a positive integer or None")
        if self.hardware is not None and self.hardware not in HARDWARE_PRESETS:
            raise ValueError(
                f"cluster.hardware={self.hardware!r}: unknown; allowed: {', '.join(HARDWARE_PRESETS)}"
            )

    @property
    def virtual(self) -> bool:
        return self.virtual_gpus > 0


@dataclass(frozen=True, slots=True)
class RayNode:
    """One alive Ray node that holds GPUs."""

    node_id: str
    ip: str
    n_gpus: int
    n_cpus: float
    is_head: bool

    def describe(self) -> str:
        """e.g. '192.0.2.2 (b23d1759, head): 2 GPUs, 1 CPUs'."""
        head = ", head" if self.is_head else ""
        return f"{self.ip} ({self.node_id[:8]}{head}): {self.n_gpus} GPUs, {self.n_cpus:g} CPUs"


class ClusterShortfall(ValueError):
    """The Ray cluster cannot hold the wanted nodes x GPUs. `missing` says what is short, `have`
    lists the cluster's GPU nodes; both are single lines."""

    def __init__(self, missing: str, have: str) -> None:
        self.missing = missing
        self.have = have
        super().__init__(f"the Ray cluster is too small: {missing}; it has {have}")


@dataclass(frozen=True)
class RayClusterInfo:
    """The Ray cluster as the planner and the placement code see it.

    `nodes`: every alive node holding GPUs, in cluster order (`gpu_nodes`). `spec` is the largest
    N x M description covering all of them (M = the smallest GPU count); a run picks its planner
    nodes with `select_nodes`.
    cpu_slots: the virtual GPUs are CPU slots (`VIRTUAL_SLOT_CPU` each) because no node of the
    cluster advertises a GPU.
    """

    spec: ClusterSpec
    nodes: tuple[RayNode, ...]
    virtual: bool
    cpu_slots: bool = False

    @property
    def gpus_per_worker(self) -> float:
        """The GPU resource each worker (and its placement bundle) reserves."""
        return 0.0 if self.cpu_slots else 1.0

    @property
    def cpus_per_worker(self) -> float:
        """The CPU resource each worker reserves: one core beside a real GPU; none beside a
        virtual one (a CPU box has too few cores for one per worker); a sliver for a CPU slot."""
        if self.cpu_slots:
            return VIRTUAL_SLOT_CPU
        return 0.0 if self.virtual else 1.0

    @property
    def backend(self) -> str:
        """torch.distributed backend of the workers: gloo on virtual GPUs, nccl on real ones."""
        return "gloo" if self.virtual else "nccl"

    @property
    def device(self) -> str:
        """Device a worker computes on. Ray sets CUDA_VISIBLE_DEVICES, so a real GPU is cuda:0."""
        return "cpu" if self.virtual else "cuda:0"


def connect(options: RayStartOptions) -> RayClusterInfo:
    """Connect to (or start) Ray as `options` say, then describe it.

    If Ray is already initialised in this process (e.g. by a test fixture) it is reused.
    """
    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(options, os.environ.get("RAY_ADDRESS")))
    return describe_cluster(virtual=options.virtual, hardware=options.hardware, virtual_gpus=options.virtual_gpus)


def ray_init_kwargs(options: RayStartOptions, env_address: str | None) -> dict[str, Any]:
    """Arguments for `ray.init` (pure, so the choice is testable without starting Ray).

    With an address, Ray is joined as it is (virtual GPUs then use the cluster's GPU resources).
    """
    address = options.address or env_address
    if address:
        return {"address": address}
    kwargs: dict[str, Any] = {
        # A new instance even when `ray start` runs a cluster on this machine (a plain ray.init()
        # would join the one last started, and refuse num_gpus there): without RAY_ADDRESS, local.
        "address": "local",
        "include_dashboard": options.include_dashboard,
        # The dashboard only listens on loopback: a local instance is not a service.
        "dashboard_host": "127.0.0.1",
    }
    if options.num_cpus is not None:
        kwargs["num_cpus"] = options.num_cpus
    # Workers of a local instance must import our packages even when they are not installed:
    # put the directory holding them first on the workers' PYTHONPATH.
    search_path = [str(PACKAGES_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(search_path)}}
    if options.virtual:
        kwargs["num_gpus"] = options.virtual_gpus
    return kwargs


def describe_cluster(virtual: bool, hardware: str | None = None, virtual_gpus: int = 0) -> RayClusterInfo:
    """`RayClusterInfo` of the Ray cluster this process is connected to.

    virtual_gpus: how many virtual GPUs a cluster without any GPU resource should provide as
    CPU slots of its head node (0: such a cluster is an error, as without virtual GPUs).
    """
    records = ray.nodes()
    if virtual and virtual_gpus > 0 and not any(_advertises_gpus(r) for r in records):
        node = cpu_slot_node(records, virtual_gpus)
        preset = hardware_preset(hardware or VIRTUAL_GPU_PRESET)
        spec = ClusterSpec(nodes=1, gpus_per_node=virtual_gpus, hardware=preset)
        return RayClusterInfo(spec=spec, nodes=(node,), virtual=True, cpu_slots=True)
    nodes = gpu_nodes(records)
    preset = hardware or (VIRTUAL_GPU_PRESET if virtual else detect_hardware_preset())
    spec = ClusterSpec(nodes=len(nodes), gpus_per_node=min(n.n_gpus for n in nodes), hardware=hardware_preset(preset))
    return RayClusterInfo(spec=spec, nodes=nodes, virtual=virtual)


def select_nodes(nodes: Sequence[RayNode], want_nodes: int, gpus_per_node: int,
                 cpus_per_gpu: float = 0.0) -> tuple[RayNode, ...]:
    """Planner nodes 0..want_nodes-1: the first nodes (in `nodes`' order) holding at least
    `gpus_per_node` GPUs and the `gpus_per_node * cpus_per_gpu` CPUs their workers reserve.

    Pure (no Ray): checks the cluster's totals, so a shortfall is known before any placement
    group waits for resources. Raises `ClusterShortfall` naming what is missing.
    """
    cpus = gpus_per_node * cpus_per_gpu
    have = f"{len(nodes)} GPU node(s): " + "; ".join(n.describe() for n in nodes) if nodes else "no GPU node"
    enough_gpus = [n for n in nodes if n.n_gpus >= gpus_per_node]
    fit = [n for n in enough_gpus if n.n_cpus >= cpus]
    if len(fit) >= want_nodes:
        return tuple(fit[:want_nodes])
    want = f"cluster.nodes={want_nodes} nodes of cluster.gpus_per_node={gpus_per_node} GPUs"
    if not enough_gpus:
        most = max((n.n_gpus for n in nodes), default=0)
        missing = f"{want}, but no node holds {gpus_per_node} GPUs (the most on one node: {most})"
    elif len(enough_gpus) < want_nodes:
        missing = f"{want}, but only {len(enough_gpus)} node(s) hold {gpus_per_node} GPUs"
    else:
        short = [n for n in enough_gpus if n.n_cpus < cpus]
        missing = (f"{want} with {cpus:g} CPUs each for their workers ({cpus_per_gpu:g} per GPU), but only {len(fit)} "
                   f"node(s) have them; short of CPUs: {', '.join(f'{n.ip} ({n.node_id[:8]})' for n in short)}")
    raise ClusterShortfall(missing, have)


def probe_cuda(nodes: Sequence[RayNode], timeout_s: float = 120.0) -> dict[str, str | None]:
    """node id -> CUDA device name seen on that node by a task holding one of its GPUs (None:
    torch sees no CUDA device there). One short-lived process per node (`max_calls=1`: it exits
    afterwards, so no CUDA context stays behind on the GPU)."""
    task = ray.remote(num_gpus=1, num_cpus=0, max_calls=1)(_cuda_device_name)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote()
            for n in nodes]
    return dict(zip((n.node_id for n in nodes), ray.get(refs, timeout=timeout_s)))


def _advertises_gpus(record: dict[str, Any]) -> bool:
    return bool(record.get("Alive", False)) and record.get("Resources", {}).get("GPU", 0) > 0


def node_order(ray_nodes: list[dict[str, Any]]) -> list[str]:
    """Ids of the alive nodes in planner order: head first, then by IP, then by id."""
    alive = [r for r in ray_nodes if r.get("Alive", False)]
    ordered = sorted(alive, key=lambda r: (HEAD_NODE_RESOURCE not in r.get("Resources", {}),
                                           r["NodeManagerAddress"], r["NodeID"]))
    return [r["NodeID"] for r in ordered]


def cpu_slot_node(ray_nodes: list[dict[str, Any]], virtual_gpus: int) -> RayNode:
    """The node whose CPUs stand in for `virtual_gpus` virtual GPUs: the first in planner order
    with CPU for all of them (a cluster without GPUs, e.g. a default `ray start --head` here)."""
    need = virtual_gpus * VIRTUAL_SLOT_CPU
    by_id = {r["NodeID"]: r for r in ray_nodes}
    for node_id in node_order(ray_nodes):
        record = by_id[node_id]
        cpus = float(record.get("Resources", {}).get("CPU", 0.0))
        if cpus >= need:
            return RayNode(node_id=node_id, ip=record["NodeManagerAddress"], n_gpus=virtual_gpus, n_cpus=cpus,
                           is_head=HEAD_NODE_RESOURCE in record.get("Resources", {}))
    raise ValueError(f"the Ray cluster has no GPUs and no node with {need:g} CPUs for {virtual_gpus} virtual GPUs "
                     f"as CPU slots; start Ray with --num-gpus {virtual_gpus} or --num-cpus 1")


def gpu_nodes(ray_nodes: list[dict[str, Any]]) -> tuple[RayNode, ...]:
    """Alive nodes holding GPUs from `ray.nodes()` records: head first, then by IP, then id."""
    nodes = []
    for record in ray_nodes:
        resources = record.get("Resources", {})
        n_gpus = resources.get("GPU", 0)
        if not record.get("Alive", False) or n_gpus <= 0:
            continue
        if n_gpus != int(n_gpus):
            raise ValueError(
                f"node {record['NodeManagerAddress']} ({record['NodeID']}) advertises GPU={n_gpus}: "
                "a fractional GPU count cannot be split into one worker per GPU"
            )
        nodes.append(RayNode(
            node_id=record["NodeID"],
            ip=record["NodeManagerAddress"],
            n_gpus=int(n_gpus),
            n_cpus=float(resources.get("CPU", 0.0)),
            is_head=HEAD_NODE_RESOURCE in resources,
        ))
    if not nodes:
        raise ValueError(
            "the Ray cluster has no alive node with GPUs; on a machine without GPUs set "
            "cluster.virtual_gpus to N to run N CPU workers"
        )
    return tuple(sorted(nodes, key=lambda n: (not n.is_head, n.ip, n.node_id)))


def preset_for_gpu_name(gpu_name: str | None) -> str:
    """Hardware preset for a CUDA device name; "cpu" for None (no CUDA), H100 when unknown."""
    if gpu_name is None:
        return VIRTUAL_GPU_PRESET
    upper = gpu_name.upper()
    for marker, preset in GPU_NAME_TO_PRESET:
        if marker in upper:
            return preset
    return DEFAULT_GPU_PRESET


def detect_hardware_preset(timeout_s: float = 120.0) -> str:
    """Ask one GPU of the cluster its device name (a tiny task) and map it to a preset."""
    first = gpu_nodes(ray.nodes())[0]
    return preset_for_gpu_name(probe_cuda([first], timeout_s)[first.node_id])


def _cuda_device_name() -> str | None:
    """Runs on a GPU bundle: the device name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
