"""One Ray actor per GPU, pinned to placement-group bundles, and a handle to call them by rank.

The cluster is covered by one placement group per node: M bundles `{"GPU": 1, "CPU": k}`,
STRICT_PACK, so a node's GPUs are reserved together (virtual GPUs too: Ray counts them as
resources; on a cluster without GPU resources virtual GPUs are `{"CPU": slot}` bundles, see
`cluster.resources`). The planner's nodes are chosen before anything is reserved
(`cluster.resources.select_nodes`: a cluster too small fails at once, naming what is missing),
and group i is pinned to planner node i's Ray node, so node order, rank order and the machines
agree whatever Ray would have picked. Worker `node * M + local` is created in bundle `local` of
node `node`'s group and named `worker-n{node}-g{local}`, which is what the Ray dashboard shows.
The global rank of a worker equals its global GPU index, so a mesh's GPUs are the workers with
those ranks; its `WorkerSlot` also records the Ray node id and IP (to name a lost node).

The worker class is any plain Python class; `ray.remote` is applied here. On real GPUs Ray sets
CUDA_VISIBLE_DEVICES per actor, so a worker always computes on `cuda:0`. Each actor runs its
methods one at a time on one thread, plus a second concurrency group, `MONITOR_GROUP`, of one
thread: a method called with `.options(concurrency_group=MONITOR_GROUP)` (the driver's
`progress` probe of a stalled call) answers while the worker is busy.

`WorkerGroup` submits a method to a subset of ranks and returns the ObjectRefs; `get` waits for
them and, when a worker raises, raises `WorkerCallError` naming the worker, its rank and method.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.resources import RayNode, cpu_slot_node, gpu_nodes, select_nodes
from planning.layout import ClusterSpec

MONITOR_GROUP = "monitor"

# Env vars every worker gets: NVLink SHARP / multicast stays off (the lent H200 hosts do not
# support it, and NCCL, torch symmetric memory and NVSHMEM would otherwise try it and fail).
DEFAULT_WORKER_ENV_VARS: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# The label every Ray node carries with its id: bundles select their node by it.
NODE_ID_LABEL = "ray.io/node-id"

# PyTorch's caching allocator with growable segments: calls of changing shapes (micro-batches,
# generation rounds, reallocation buffers) then reuse freed memory instead of fragmenting it.
# Workers get it unless the user set PYTORCH_CUDA_ALLOC_CONF (in the driver's environment or in
# env_vars), whose value then wins. Set by Ray before the worker process starts, i.e. before
# torch initialises CUDA there.
ALLOCATOR_ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOCATOR_CONF = "expandable_segments:True"


def worker_env_vars(env_vars: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every worker's environment: the defaults, the allocator setting (the user's if set), then
    `env_vars` over them."""
    allocator = {ALLOCATOR_ENV_VAR: os.environ.get(ALLOCATOR_ENV_VAR) or DEFAULT_ALLOCATOR_CONF}
    return {**DEFAULT_WORKER_ENV_VARS, **allocator, **(env_vars or {})}


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Where one worker lives: its global rank (= global GPU index), planner node and local GPU,
    and the Ray node (id, IP) that planner node is."""

    rank: int
    node: int
    local_gpu: int
    name: str
    node_id: str = ""
    ip: str = ""


@dataclass(frozen=True)
class PendingCall:
    """ObjectRefs of one method submitted to some ranks, in the order of `ranks`."""

    method: str
    ranks: tuple[int, ...]
    refs: tuple[ray.ObjectRef, ...]

    def ref_of(self, rank: int) -> ray.ObjectRef:
        if rank not in self.ranks:
            raise ValueError(f"rank {rank}: '{self.method}' was submitted to ranks {list(self.ranks)} only")
        return self.refs[self.ranks.index(rank)]


class WorkerCallError(RuntimeError):
    """One or more workers raised (or died) in a call; names them. `failures`: name -> error."""

    def __init__(self, method: str, failures: dict[str, BaseException]) -> None:
        self.method = method
        self.failures = failures
        lines = [f"{name}: {_describe_error(error)}" for name, error in failures.items()]
        super().__init__(f"'{method}' failed on {', '.join(failures)}:\n" + "\n".join(lines))


class WorkerGroup:
    """Actor handles of every worker in global GPU order, and the placement groups holding them."""

    def __init__(self, actors: Sequence[ActorHandle], slots: Sequence[WorkerSlot],
                 placement_groups: Sequence[PlacementGroup]) -> None:
        if len(actors) != len(slots):
            raise ValueError(f"{len(actors)} actors but {len(slots)} slots")
        self._actors = tuple(actors)
        self.slots = tuple(slots)
        self._placement_groups = tuple(placement_groups)

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.slots)

    def actor(self, rank: int) -> ActorHandle:
        return self._actors[self._check_rank(rank)]

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> PendingCall:
        """Submit `method(*args, **kwargs)` to `ranks` (default: all), in rank order."""
        chosen = self._chosen(ranks)
        refs = tuple(getattr(self._actors[r], method).remote(*args, **kwargs) for r in chosen)
        return PendingCall(method, chosen, refs)

    def call_per_rank(self, method: str, args_by_rank: Mapping[int, Sequence[Any]], **kwargs: Any) -> PendingCall:
        """Submit `method(*args_by_rank[r], **kwargs)` to each rank r of the mapping, in rank order."""
        chosen = self._chosen(sorted(args_by_rank))
        refs = tuple(getattr(self._actors[r], method).remote(*args_by_rank[r], **kwargs) for r in chosen)
        return PendingCall(method, chosen, refs)

    def call_function(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None,
                      **kwargs: Any) -> PendingCall:
        """Run `fn(worker_instance, *args, **kwargs)` inside each chosen actor.

        For plumbing (rendezvous, process groups) that any worker class must support without
        defining a method for it. `fn` must be importable by the workers (a module-level function).
        """
        chosen = self._chosen(ranks)
        refs = tuple(self._actors[r].__ray_call__.remote(fn, *args, **kwargs) for r in chosen)
        return PendingCall(getattr(fn, "__name__", repr(fn)), chosen, refs)

    def call_function_per_rank(self, fn: Callable[..., Any], args_by_rank: Mapping[int, Sequence[Any]],
                               **kwargs: Any) -> PendingCall:
        """Run `fn(worker_instance, *args_by_rank[r], **kwargs)` inside each rank r of the mapping."""
        chosen = self._chosen(sorted(args_by_rank))
        refs = tuple(self._actors[r].__ray_call__.remote(fn, *args_by_rank[r], **kwargs) for r in chosen)
        return PendingCall(getattr(fn, "__name__", repr(fn)), chosen, refs)

    def get(self, pending: PendingCall, timeout_s: float | None = None) -> list[Any]:
        """Results of `pending` in its rank order.

        Returns as soon as all finish; raises `WorkerCallError` as soon as any worker fails (its
        peers may be stuck in a collective waiting for it), `TimeoutError` naming the workers
        still running after `timeout_s`.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        name_of = {ref: self.slots[rank].name for rank, ref in zip(pending.ranks, pending.refs)}
        results: dict[ray.ObjectRef, Any] = {}
        remaining = list(pending.refs)
        while remaining:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=left)
            if not ready:
                waiting = ", ".join(name_of[ref] for ref in remaining)
                raise TimeoutError(f"'{pending.method}' still running on {waiting} after {timeout_s} s")
            failures: dict[str, BaseException] = {}
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except RayError as error:
                    failures[name_of[ref]] = error
            if failures:
                raise WorkerCallError(pending.method, failures)
        return [results[ref] for ref in pending.refs]

    def run(self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """`call` then `get`: the results of `method` on `ranks`, in rank order."""
        return self.get(self.call(method, *args, ranks=ranks, **kwargs), timeout_s)

    def shutdown(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        for group in self._placement_groups:
            remove_placement_group(group)
        self._actors = ()
        self._placement_groups = ()

    def _chosen(self, ranks: Sequence[int] | None) -> tuple[int, ...]:
        if ranks is None:
            return tuple(range(self.world_size))
        chosen = tuple(self._check_rank(r) for r in ranks)
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"ranks={list(ranks)}: contains duplicates")
        return chosen

    def _check_rank(self, rank: int) -> int:
        if not self._actors:
            raise RuntimeError("this WorkerGroup was shut down")
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: must be an integer in [0, {self.world_size})")
        return rank


def create_workers(
    cls: type,
    cluster_spec: ClusterSpec,
    ctor_kwargs: Mapping[str, Any],
    env_vars: Mapping[str, str] | None = None,
    *,
    rank_kwargs: Sequence[Mapping[str, Any]] | None = None,
    cpus_per_worker: float = 0.0,
    gpus_per_worker: float = 1.0,
    name_prefix: str = "worker",
    ready_timeout_s: float = 300.0,
    nodes: Sequence[RayNode] | None = None,
    concurrency_groups: Mapping[str, int] | None = None,
) -> WorkerGroup:
    """Reserve every GPU of `cluster_spec` and start one `cls` actor per GPU.

    ctor_kwargs: constructor keyword arguments shared by all workers; `rank_kwargs[r]`, when
        given (one mapping per rank), is merged over them for worker r.
    env_vars: extra environment of every worker, over `worker_env_vars()`'s defaults.
    cpus_per_worker: the CPU share k of each bundle and actor (0 is allowed: on a CPU box with
        virtual GPUs the cores are too few to reserve one per worker).
    gpus_per_worker: the GPU share of each bundle and actor: 1, or 0 where virtual GPUs are CPU
        slots of a cluster without GPU resources (`RayClusterInfo.gpus_per_worker`).
    nodes: the Ray node of each planner node; None chooses them with `select_nodes` (a cluster
        too small raises `ClusterShortfall` before anything is reserved).
    concurrency_groups: Ray concurrency groups (name -> threads) besides the default one, whose
        single thread keeps the submission order; a method call submitted with
        `.options(concurrency_group=name)` runs on that group's threads.
    Waits until every constructor has run; a constructor that raises gives `WorkerCallError`.
    """
    _validate_create_args(cls, cluster_spec, rank_kwargs, cpus_per_worker, gpus_per_worker, env_vars)
    if nodes is None:
        nodes = default_nodes(cluster_spec, cpus_per_worker, gpus_per_worker)
    if len(nodes) != cluster_spec.nodes:
        raise ValueError(f"{len(nodes)} Ray nodes given for a cluster of {cluster_spec.nodes} nodes")
    groups = reserve_nodes(cluster_spec, nodes, cpus_per_worker, name_prefix, ready_timeout_s, gpus_per_worker)
    env = worker_env_vars(env_vars)
    remote_cls = ray.remote(concurrency_groups={MONITOR_GROUP: 1, **(concurrency_groups or {})})(cls)
    actors, slots = [], []
    for node, (group, ray_node) in enumerate(zip(groups, nodes)):
        for local in range(cluster_spec.gpus_per_node):
            rank = node * cluster_spec.gpus_per_node + local
            slot = WorkerSlot(rank, node, local, f"{name_prefix}-n{node}-g{local}", ray_node.node_id, ray_node.ip)
            kwargs = {**ctor_kwargs, **(rank_kwargs[rank] if rank_kwargs is not None else {})}
            actor = remote_cls.options(
                name=slot.name,
                num_gpus=gpus_per_worker,
                num_cpus=cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=local),
                runtime_env={"env_vars": env},
            ).remote(**kwargs)
            actors.append(actor)
            slots.append(slot)
    workers = WorkerGroup(actors, slots, groups)
    try:
        # A no-op inside each actor completes only after its constructor ran (or raised).
        workers.get(workers.call_function(_constructed), timeout_s=ready_timeout_s)
    except BaseException:
        workers.shutdown()
        raise
    return workers


def reserve_nodes(cluster_spec: ClusterSpec, nodes: Sequence[RayNode], cpus_per_worker: float, name_prefix: str,
                  ready_timeout_s: float, gpus_per_worker: float = 1.0) -> list[PlacementGroup]:
    """One STRICT_PACK placement group per planner node, group i on Ray node `nodes[i]`."""
    shares = {"GPU": float(gpus_per_worker), "CPU": float(cpus_per_worker)}
    bundle = {name: amount for name, amount in shares.items() if amount > 0}
    groups = [pinned_group([dict(bundle) for _ in range(cluster_spec.gpus_per_node)], node.node_id,
                           f"{name_prefix}-pg{i}") for i, node in enumerate(nodes)]
    try:
        ray.get([g.ready() for g in groups], timeout=ready_timeout_s)
    except GetTimeoutError:
        for g in groups:
            remove_placement_group(g)
        raise TimeoutError(
            f"placement groups for {cluster_spec.nodes} node(s) x {cluster_spec.gpus_per_node} bundles "
            f"{bundle} not ready after {ready_timeout_s} s: other jobs hold these resources of nodes "
            f"{', '.join(n.describe() for n in nodes)}"
        ) from None
    for group, node in zip(groups, nodes):
        landed = set(placement_group_table(group)["bundles_to_node_id"].values())
        if landed != {node.node_id}:  # only possible with the soft hint of an old Ray
            for g in groups:
                remove_placement_group(g)
            raise ValueError(f"placement group for node {node.describe()} landed on Ray node(s) {sorted(landed)}; "
                             "Ray 2.49 or newer pins groups to their node (bundle label selectors)")
    return groups


def pinned_group(bundles: list[dict[str, float]], node_id: str, name: str) -> PlacementGroup:
    """A STRICT_PACK group of `bundles` on the Ray node `node_id` (by its node-id label; an
    older Ray without bundle label selectors gets the soft node hint instead)."""
    if "bundle_label_selector" in inspect.signature(placement_group).parameters:
        return placement_group(bundles, strategy="STRICT_PACK", name=name,
                               bundle_label_selector=[{NODE_ID_LABEL: node_id} for _ in bundles])
    return placement_group(bundles, strategy="STRICT_PACK", name=name, _soft_target_node_id=node_id)


def default_nodes(cluster_spec: ClusterSpec, cpus_per_worker: float, gpus_per_worker: float) -> tuple[RayNode, ...]:
    """The planner's nodes when the caller names none: the first that fit (`select_nodes`), or,
    for CPU slots (no GPU share), the one node whose CPUs hold them (`cpu_slot_node`)."""
    records = ray.nodes()
    if gpus_per_worker == 0:
        if cluster_spec.nodes != 1:
            raise ValueError(f"virtual GPUs as CPU slots live on one node; the cluster asks for {cluster_spec.nodes}")
        return (cpu_slot_node(records, cluster_spec.gpus_per_node),)
    return select_nodes(gpu_nodes(records), cluster_spec.nodes, cluster_spec.gpus_per_node, cpus_per_worker)


def _validate_create_args(cls: type, cluster_spec: ClusterSpec, rank_kwargs: Sequence[Mapping[str, Any]] | None,
                          cpus_per_worker: float, gpus_per_worker: float, env_vars: Mapping[str, str] | None) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"cls={cls!r}: must be a plain class (ray.remote is applied by create_workers)")
    if rank_kwargs is not None and len(rank_kwargs) != cluster_spec.n_gpus:
        raise ValueError(f"rank_kwargs has {len(rank_kwargs)} entries; the cluster has {cluster_spec.n_gpus} GPUs")
    if cpus_per_worker < 0:
        raise ValueError(f"cpus_per_worker={cpus_per_worker}: must be >= 0")
    if gpus_per_worker not in (0.0, 1.0):
        raise ValueError(f"gpus_per_worker={gpus_per_worker}: must be 1 (one GPU per worker) or 0 (CPU slots)")
    if gpus_per_worker == 0 and cpus_per_worker <= 0:
        raise ValueError("gpus_per_worker=0 needs cpus_per_worker > 0: a placement bundle must reserve something")
    for key, value in (env_vars or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env_vars[{key!r}]={value!r}: names and values must be strings")


def _constructed(worker: object) -> str:
    """Runs inside an actor after its constructor; returns the worker's class name."""
    return type(worker).__name__


def _describe_error(error: BaseException) -> str:
    """The original exception of a Ray task error (type: message), else the error itself."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        return f"{type(error.cause).__name__}: {error.cause}"
    return f"{type(error).__name__}: {error}"
