"""Ray plumbing: cluster description, one named worker per GPU, rendezvous and process groups.

The ray tests share one local Ray (2 CPUs, 4 virtual GPUs) and one group of 4 workers, since
starting worker processes is the slow part. The unit tests check the pure pieces (group listing,
node checks, ray.init arguments) without Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist

from cluster.collective import (
    init_world,
    layout_group_ranks,
    list_process_groups,
    parallel_groups_for,
    plan_placements,
    rendezvous,
    rendezvous_address,
    setup_process_groups,
)
from cluster.placement import WorkerCallError, WorkerGroup, create_workers
from cluster.resources import (
    PACKAGES_ROOT,
    VIRTUAL_SLOT_CPU,
    ClusterShortfall,
    RayClusterInfo,
    RayStartOptions,
    connect,
    cpu_slot_node,
    gpu_nodes,
    node_order,
    preset_for_gpu_name,
    ray_init_kwargs,
    select_nodes,
)
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.plan import ExecutionPlan, Placement
from tests.ray_fixtures import RAY_TEST_GPUS, TESTS_DIR, ray_session  # noqa: F401  (ray_session is a fixture)

GPUS = RAY_TEST_GPUS
# The plan the group tests use: a dp2tp2 call on all 4 GPUs, a tp2 call on GPUs 0-1 and a dp2
# call on GPUs 2-3; plus one reallocation pair. Groups {0,1} and {2,3} recur and are shared.
PLAN = [
    (Mesh(0, 4, GPUS), Layout(dp=2, tp=2)),
    (Mesh(0, 2, GPUS), Layout(tp=2)),
    (Mesh(2, 2, GPUS), Layout(dp=2)),
]
REALLOC = [{3, 0}]


class ProbeWorker:
    """A plain worker class: reports where it runs and sums values over its process groups."""

    def __init__(self, tag: str, rank: int, device: str = "cpu") -> None:
        if tag == "broken" and rank == 1:
            raise RuntimeError(f"constructor failure on rank {rank}")
        torch.set_num_threads(1)
        self.tag = tag
        self.rank = rank
        self.device = torch.device(device)
        self.groups: dict[tuple[int, ...], Any] = {}

    def set_process_groups(self, groups: dict[tuple[int, ...], Any]) -> None:
        self.groups = groups

    def describe(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "rank": self.rank,
            "name": ray.get_runtime_context().get_actor_name(),
            "gpu_ids": ray.get_gpu_ids(),
            "test_env": os.environ.get("REALRAY_TEST_ENV"),
            "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def all_reduce_world(self, value: float) -> float:
        tensor = torch.tensor([value], device=self.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def all_reduce_tp(self, mesh: Mesh, layout: Layout, value: float) -> float | None:
        """Sum of `value` over this rank's tp group of (mesh, layout); None outside the mesh."""
        groups = parallel_groups_for(self.groups, mesh, layout, dist.get_rank())
        if groups is None:
            return None
        tensor = torch.tensor([value], device=self.device)
        dist.all_reduce(tensor, group=groups.tp_group)
        return float(tensor.item())

    def member_count(self) -> int:
        return sum(group is not None for group in self.groups.values())

    def fail(self) -> None:
        raise ValueError(f"probe failure on rank {self.rank}")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def workers(ray_session: None) -> Iterator[WorkerGroup]:  # noqa: F811
    info = connect(RayStartOptions(virtual_gpus=GPUS, include_dashboard=False))
    group = create_workers(
        ProbeWorker, info.spec, {"tag": "probe"}, {"REALRAY_TEST_ENV": "yes"},
        rank_kwargs=[{"rank": r} for r in range(info.spec.n_gpus)],
        cpus_per_worker=0.25,
    )
    yield group
    group.shutdown()


# ---- ray tier -----------------------------------------------------------------------------------


@pytest.mark.ray
def test_constructor_error_names_the_worker_and_frees_the_gpus(ray_session: None) -> None:  # noqa: F811
    # Runs before the module's 4-worker fixture exists (file order), on half of the GPUs.
    half = ClusterSpec(nodes=1, gpus_per_node=GPUS // 2, hardware=hardware_preset("cpu"))
    with pytest.raises(WorkerCallError, match=r"(?s)worker-n0-g1.*constructor failure on rank 1"):
        create_workers(ProbeWorker, half, {"tag": "broken"}, rank_kwargs=[{"rank": r} for r in range(half.n_gpus)],
                       ready_timeout_s=60)
    # The failed group gave its placement group back: all GPUs are free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("GPU", 0) < GPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == GPUS


@pytest.mark.ray
def test_virtual_gpus_as_cpu_slots(ray_session: None) -> None:  # noqa: F811
    # What a job on a Ray cluster without GPUs gets (a default `ray start --head` on a CPU box):
    # bundles of a CPU sliver, actors holding no GPU; the cluster's GPUs stay untouched.
    two = ClusterSpec(nodes=1, gpus_per_node=2, hardware=hardware_preset("cpu"))
    group = create_workers(ProbeWorker, two, {"tag": "slot"}, rank_kwargs=[{"rank": r} for r in range(2)],
                           cpus_per_worker=VIRTUAL_SLOT_CPU, gpus_per_worker=0.0, name_prefix="slot",
                           ready_timeout_s=120)
    try:
        described = group.run("describe", timeout_s=60)
        assert [d["name"] for d in described] == ["slot-n0-g0", "slot-n0-g1"]
        assert all(d["gpu_ids"] == [] for d in described)
        assert ray.available_resources().get("GPU", 0) == GPUS
    finally:
        group.shutdown()


@pytest.mark.ray
def test_cluster_spec_of_local_ray_with_virtual_gpus(ray_session: None) -> None:  # noqa: F811
    info = connect(RayStartOptions(virtual_gpus=GPUS, include_dashboard=False))
    assert (info.spec.nodes, info.spec.gpus_per_node) == (1, GPUS)
    assert info.spec.hardware.name == "cpu"
    assert (info.backend, info.device, info.virtual) == ("gloo", "cpu", True)
    assert len(info.nodes) == 1 and info.nodes[0].is_head


@pytest.mark.ray
def test_one_named_worker_per_gpu_bundle(workers: WorkerGroup) -> None:
    described = workers.run("describe", timeout_s=60)
    assert workers.names == tuple(f"worker-n0-g{g}" for g in range(GPUS))
    assert [d["name"] for d in described] == list(workers.names)
    assert [d["rank"] for d in described] == list(range(GPUS))
    assert all(d["tag"] == "probe" and d["test_env"] == "yes" and d["nvls"] == "0" for d in described)
    # Each actor holds exactly one (virtual) GPU, all distinct.
    gpu_ids = [tuple(d["gpu_ids"]) for d in described]
    assert all(len(ids) == 1 for ids in gpu_ids) and len(set(gpu_ids)) == GPUS
    # Named actors are reachable by name, as on the dashboard.
    assert ray.get(ray.get_actor("worker-n0-g3").describe.remote())["rank"] == 3


@pytest.mark.ray
def test_rendezvous_and_all_reduce_over_world_and_tp_group(workers: WorkerGroup) -> None:
    rendezvous(workers, backend="gloo", timeout_s=60)
    listing = setup_process_groups(workers, PLAN, REALLOC, timeout_s=60)
    assert listing == list_process_groups(PLAN, REALLOC)

    values = {rank: (float(10**rank),) for rank in range(GPUS)}
    world = workers.get(workers.call_per_rank("all_reduce_world", values), timeout_s=60)
    assert world == [1111.0] * GPUS

    # tp2 on GPUs 0-1: ranks 0+1 sum to 11; ranks 2, 3 are outside the mesh.
    mesh, layout = PLAN[1]
    tp_sums = workers.get(workers.call_per_rank("all_reduce_tp", {r: (mesh, layout, *values[r]) for r in range(GPUS)}))
    assert tp_sums == [11.0, 11.0, None, None]
    # dp2tp2 on all 4: tp groups {0,1} and {2,3}, the same process groups as above.
    mesh, layout = PLAN[0]
    tp_sums = workers.get(workers.call_per_rank("all_reduce_tp", {r: (mesh, layout, *values[r]) for r in range(GPUS)}))
    assert tp_sums == [11.0, 11.0, 1100.0, 1100.0]
    # Rank 0 belongs to the world, {0,1}, {0,2}, {0,3}; rank 3 to the world, {2,3}, {1,3}, {0,3}.
    assert workers.run("member_count", ranks=[0, 3]) == [4, 4]


@pytest.mark.ray
def test_worker_error_names_the_worker(workers: WorkerGroup) -> None:
    with pytest.raises(WorkerCallError, match=r"worker-n0-g2.*ValueError: probe failure on rank 2") as caught:
        workers.run("fail", ranks=[2], timeout_s=60)
    assert list(caught.value.failures) == ["worker-n0-g2"]
    # The worker survives a raising method.
    assert workers.run("describe", ranks=[2])[0]["rank"] == 2


@pytest.mark.ray
def test_timeout_names_the_slow_worker(workers: WorkerGroup) -> None:
    with pytest.raises(TimeoutError, match="worker-n0-g1"):
        workers.run("sleep", 3.0, ranks=[1], timeout_s=0.5)


# ---- gpu tier: real GPUs, NCCL --------------------------------------------------------------------


def real_gpu_smoke() -> None:
    """Own local Ray on this host's real GPUs: hardware detection, one worker per GPU, NCCL sums.

    Run in a child process by `test_real_gpus_nccl_world`, so it never meets the virtual-GPU Ray
    of the other tests (Ray is one instance per process).
    """
    n_gpus = torch.cuda.device_count()
    info = connect(RayStartOptions(include_dashboard=False))
    assert (info.spec.nodes, info.spec.gpus_per_node, info.virtual) == (1, n_gpus, False), info
    assert info.spec.hardware.name == preset_for_gpu_name(torch.cuda.get_device_name(0))
    workers = create_workers(ProbeWorker, info.spec, {"tag": "gpu", "device": info.device},
                             rank_kwargs=[{"rank": r} for r in range(n_gpus)], cpus_per_worker=1.0)
    try:
        described = workers.run("describe", timeout_s=120)
        # Ray gives each actor its own GPU through CUDA_VISIBLE_DEVICES.
        assert sorted(d["cuda_visible"] for d in described) == [str(g) for g in range(n_gpus)], described
        assert all(d["nvls"] == "0" for d in described)
        rendezvous(workers, backend=info.backend, timeout_s=120)
        setup_process_groups(workers, [(Mesh(0, n_gpus, n_gpus), Layout(tp=n_gpus))], timeout_s=120)
        values = {rank: (float(10**rank),) for rank in range(n_gpus)}
        expected = float(sum(10**r for r in range(n_gpus)))
        assert workers.get(workers.call_per_rank("all_reduce_world", values), 120) == [expected] * n_gpus
        mesh, layout = Mesh(0, n_gpus, n_gpus), Layout(tp=n_gpus)
        tp = workers.get(workers.call_per_rank("all_reduce_tp", {r: (mesh, layout, *values[r]) for r in values}), 120)
        assert tp == [expected] * n_gpus
        print(f"real GPU smoke ok: {n_gpus} x {info.spec.hardware.name}, names {workers.names}")
    finally:
        workers.shutdown()
        ray.shutdown()


@pytest.mark.gpu
def test_real_gpus_nccl_world() -> None:
    search_path = [str(PACKAGES_ROOT), str(TESTS_DIR), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in search_path if p)}
    env.pop("RAY_ADDRESS", None)
    child = subprocess.run(
        [sys.executable, "-c", "from tests.cluster.test_cluster_ray import real_gpu_smoke; real_gpu_smoke()"],
        cwd=PACKAGES_ROOT, env=env, capture_output=True, text=True, timeout=540,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-8000:]
    assert "real GPU smoke ok" in child.stdout


# ---- unit tier: the pure pieces -----------------------------------------------------------------


@pytest.mark.unit
def test_group_listing_is_deterministic_and_deduplicated() -> None:
    listing = list_process_groups(PLAN, REALLOC)
    assert listing == list_process_groups(list(PLAN), [[0, 3]])
    assert len(set(listing)) == len(listing)
    # dp2tp2 on 0-3: mesh, tp {0,1} {2,3}, dp {0,2} {1,3}; pp groups have 1 rank and are left out.
    # tp2 on 0-1 and dp2 on 2-3 add nothing new; the realloc pair {0,3} comes last.
    assert listing == ((0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3), (0, 3))
    plan = ExecutionPlan.from_dict({f"call{i}": Placement(mesh, layout) for i, (mesh, layout) in enumerate(PLAN)})
    assert list_process_groups(plan_placements(plan), REALLOC) == listing


@pytest.mark.unit
def test_pipeline_layout_lists_pp_and_embedding_groups() -> None:
    groups = layout_group_ranks(Mesh(0, 8, 8), Layout(dp=1, tp=2, pp=4))
    assert (0, 2, 4, 6) in groups and (1, 3, 5, 7) in groups  # pp columns
    assert (0, 6) in groups and (1, 7) in groups  # first + last stage (tied embeddings)
    with pytest.raises(ValueError, match="layout dp1tp2pp1 has 2 ranks but mesh n0:g0-3 has 4"):
        layout_group_ranks(Mesh(0, 4, 8), Layout(tp=2))
    with pytest.raises(ValueError, match="rank 8 outside the world of 8"):
        list_process_groups([], [[2, 8]], world_size=8)


@pytest.mark.unit
def test_parallel_groups_come_from_the_shared_mapping() -> None:
    mesh, layout = Mesh(0, 8, 8), Layout(dp=2, tp=2, pp=2)
    # Stand-in handles: parallel_groups_for only looks groups up, it never talks to torch.
    mapping: dict[tuple[int, ...], Any] = {g: f"pg{g}" for g in list_process_groups([(mesh, layout)])}
    groups = parallel_groups_for(mapping, mesh, layout, rank=5)  # tp rank 1, dp rank 0, pp rank 1
    assert groups is not None
    assert (groups.dp_rank, groups.tp_rank, groups.pp_rank) == (0, 1, 1)
    assert (groups.tp_group, groups.dp_group, groups.pp_group) == ("pg(4, 5)", "pg(5, 7)", "pg(1, 5)")
    assert (groups.embedding_group, groups.mesh_group) == ("pg(1, 5)", "pg(0, 1, 2, 3, 4, 5, 6, 7)")
    assert (groups.pp_global_ranks, groups.dp_global_ranks) == ((1, 5), (5, 7))
    assert parallel_groups_for(mapping, Mesh(0, 4, 8), Layout(tp=4), rank=5) is None
    serial = parallel_groups_for(mapping, Mesh(5, 1, 8), Layout(), rank=5)
    assert serial is not None and serial.tp_group is None and serial.mesh_group is None
    with pytest.raises(KeyError, match=r"group \[0, 1, 2, 3\] of dp1tp4pp1 on n0:g0-3 was not created"):
        parallel_groups_for(mapping, Mesh(0, 4, 8), Layout(tp=4), rank=1)


@pytest.mark.unit
def test_world_join_times_out_instead_of_hanging() -> None:
    # Rank 0 of a world of 2 whose rank 1 never comes: the join raises after about timeout_s.
    _, port = rendezvous_address()
    started = time.monotonic()
    with pytest.raises(dist.DistError, match="1/2 clients joined"):
        init_world(0, 2, "127.0.0.1", port, "gloo", timeout_s=1.0)
    assert time.monotonic() - started < 30 and not dist.is_initialized()
    with pytest.raises(ValueError, match="backend='mpi': allowed: nccl, gloo"):
        init_world(0, 2, "127.0.0.1", port, "mpi", timeout_s=1.0)


def node_record(node_id: str, ip: str, gpus: float, head: bool = False, cpus: float = 8.0) -> dict[str, Any]:
    resources = {"GPU": gpus, "CPU": cpus, **({"node:__internal_head__": 1.0} if head else {})}
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": True, "Resources": resources}


@pytest.mark.unit
def test_nodes_in_cluster_order_and_the_planner_nodes_among_them() -> None:
    nodes = gpu_nodes([node_record("b" * 16, "10.0.0.2", 8), node_record("a" * 16, "10.0.0.9", 8, head=True),
                       {"NodeID": "c", "NodeManagerAddress": "10.0.0.3", "Alive": False, "Resources": {"GPU": 8}}])
    assert [n.ip for n in nodes] == ["10.0.0.9", "10.0.0.2"]  # head first; dead node dropped
    with pytest.raises(ValueError, match="virtual_gpus"):
        gpu_nodes([node_record("a", "10.0.0.1", 0)])
    # Uneven nodes: the planner takes the first ones that hold the configured GPUs and CPUs.
    uneven = gpu_nodes([node_record("a" * 16, "10.0.0.1", 4, head=True, cpus=2), node_record("b" * 16, "10.0.0.2", 8),
                        node_record("c" * 16, "10.0.0.3", 8, cpus=4)])
    assert [n.ip for n in select_nodes(uneven, 2, 4)] == ["10.0.0.1", "10.0.0.2"]
    assert [n.ip for n in select_nodes(uneven, 2, 8)] == ["10.0.0.2", "10.0.0.3"]
    assert [n.ip for n in select_nodes(uneven, 2, 4, cpus_per_gpu=1.0)] == ["10.0.0.2", "10.0.0.3"]


@pytest.mark.unit
def test_a_cluster_too_small_names_what_is_missing_and_what_it_has() -> None:
    two = gpu_nodes([node_record("a" * 16, "10.0.0.1", 2, head=True, cpus=1), node_record("b" * 16, "10.0.0.2", 2, cpus=3)])
    have = "2 GPU node(s): 10.0.0.1 (aaaaaaaa, head): 2 GPUs, 1 CPUs; 10.0.0.2 (bbbbbbbb): 2 GPUs, 3 CPUs"
    cases = [
        ((3, 2, 0.0), "cluster.nodes=3 nodes of cluster.gpus_per_node=2 GPUs, but only 2 node(s) hold 2 GPUs"),
        ((1, 4, 0.0), "no node holds 4 GPUs (the most on one node: 2)"),
        ((2, 2, 1.0), ("with 2 CPUs each for their workers (1 per GPU), but only 1 node(s) have them; "
                       "short of CPUs: 10.0.0.1 (aaaaaaaa)")),
    ]
    for (n, m, cpus), missing in cases:
        with pytest.raises(ClusterShortfall) as caught:
            select_nodes(two, n, m, cpus)
        assert missing in caught.value.missing and caught.value.have == have
        assert "\n" not in str(caught.value)


@pytest.mark.unit
def test_a_cluster_without_gpus_lends_cpu_slots() -> None:
    def record(node_id: str, ip: str, cpus: float, head: bool = False, alive: bool = True) -> dict[str, Any]:
        resources = {"CPU": cpus, **({"node:__internal_head__": 1.0} if head else {})}
        return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": resources}

    nodes = [record("w", "10.0.0.1", 8), record("h", "10.0.0.5", 2, head=True),
             record("d", "10.0.0.0", 64, alive=False)]
    assert node_order(nodes) == ["h", "w"]  # head first, the dead node left out
    node = cpu_slot_node(nodes, 4)
    assert (node.node_id, node.n_gpus, node.is_head) == ("h", 4, True)
    assert cpu_slot_node([record("h", "10.0.0.5", 0, head=True), record("w", "10.0.0.1", 1)], 4).node_id == "w"
    with pytest.raises(ValueError, match="no GPUs and no node with 0.04 CPUs for 4 virtual GPUs"):
        cpu_slot_node([record("h", "10.0.0.5", 0, head=True)], 4)
    spec = ClusterSpec(nodes=1, gpus_per_node=4, hardware=hardware_preset("cpu"))
    slots = RayClusterInfo(spec, (node,), virtual=True, cpu_slots=True)
    assert (slots.gpus_per_worker, slots.cpus_per_worker, slots.backend) == (0.0, VIRTUAL_SLOT_CPU, "gloo")
    virtual = RayClusterInfo(spec, (node,), virtual=True)
    assert (virtual.gpus_per_worker, virtual.cpus_per_worker) == (1.0, 0.0)
    assert RayClusterInfo(spec, (node,), virtual=False).cpus_per_worker == 1.0


@pytest.mark.unit
def test_ray_init_arguments_and_gpu_presets() -> None:
    local = ray_init_kwargs(RayStartOptions(virtual_gpus=4, num_cpus=2, include_dashboard=False), None)
    worker_path = local.pop("runtime_env")["env_vars"]["PYTHONPATH"].split(os.pathsep)
    assert local == {"address": "local", "include_dashboard": False, "dashboard_host": "127.0.0.1", "num_cpus": 2,
                     "num_gpus": 4}
    assert worker_path[0] == str(PACKAGES_ROOT)
    assert ray_init_kwargs(RayStartOptions(), "ray://head:10001") == {"address": "ray://head:10001"}
    # Virtual GPUs with an address join that cluster and use its GPU resources.
    assert ray_init_kwargs(RayStartOptions(virtual_gpus=4), "127.0.0.1:6379") == {"address": "127.0.0.1:6379"}
    with pytest.raises(ValueError, match="cluster.virtual_gpus=True"):
        RayStartOptions(virtual_gpus=True)
    assert preset_for_gpu_name("NVIDIA H200") == "h200-141g"
    assert preset_for_gpu_name("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert preset_for_gpu_name("NVIDIA L40S") == "h100-80g"
    assert preset_for_gpu_name(None) == "cpu"
