"""The Ray instances of the ray-tier tests.

`ray_session`: the one local Ray instance the ray-tier tests share (import it into a test module).
Ray starts once per pytest session with 2 CPUs and 4 virtual GPUs, no dashboard (it costs
seconds), and is shut down when the session ends. Workers get the repository root and tests/ on
PYTHONPATH, so classes defined in test modules and our packages import inside them.

`multinode_ray(nodes)`: a Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`:
a head and worker nodes, each its own raylet with its own GPU and CPU counts), for a module's
multi-node tests. A process connects to one Ray cluster at a time, so while it is up this process
is connected to it instead of the shared instance: the shared one is shut down first and started
again afterwards if it was running (the session fixture then finds it as it left it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

RAY_TEST_CPUS = 2
RAY_TEST_GPUS = 4
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def worker_runtime_env() -> dict[str, dict[str, str]]:
    """Workers import our packages and the test modules' classes from this checkout."""
    search_path = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])
    return {"env_vars": {"PYTHONPATH": search_path.rstrip(os.pathsep)}}


def start_shared_ray() -> None:
    """The local instance of `ray_session`. address="local": always a fresh instance, never a
    cluster someone started with `ray start`."""
    ray.init(address="local", num_cpus=RAY_TEST_CPUS, num_gpus=RAY_TEST_GPUS, include_dashboard=False,
             runtime_env=worker_runtime_env())


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """Local Ray with virtual GPUs for the whole test session (reused if already running)."""
    started_here = not ray.is_initialized()
    if started_here:
        start_shared_ray()
    yield
    if started_here:
        ray.shutdown()


@dataclass(frozen=True)
class NodeResources:
    """What one Ray node of a test cluster advertises (GPUs are virtual: CPU workers)."""

    gpus: int
    cpus: float = 1.0


@dataclass(frozen=True)
class MultiNodeRay:
    """A running test cluster: the `Cluster` handle, its GCS address and dashboard URL."""

    cluster: object  # ray.cluster_utils.Cluster
    address: str
    dashboard_url: str | None

    def add_node(self, resources: NodeResources) -> None:
        self.cluster.add_node(**node_args(resources))
        self.cluster.wait_for_nodes()


def node_args(resources: NodeResources) -> dict[str, object]:
    """Arguments of one node. Each gets its own dashboard-agent port: they all default to 52365,
    and an agent that loses that race (to another node, or to another Ray on this machine)
    serves no HTTP, so e.g. a head without it accepts no job."""
    return {"num_gpus": resources.gpus, "num_cpus": resources.cpus, "dashboard_agent_listen_port": free_port()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def multinode_ray(nodes: Sequence[NodeResources], dashboard: bool = False) -> Iterator[MultiNodeRay]:
    """Start a head (`nodes[0]`) and worker nodes on this machine, connect this process to them
    (instead of the shared instance), and tear everything down afterwards."""
    from ray.cluster_utils import Cluster

    shared = ray.is_initialized()
    if shared:
        ray.shutdown()
    head = {**node_args(nodes[0]), "include_dashboard": dashboard}
    dashboard_url = None
    if dashboard:
        port = free_port()
        head.update(dashboard_host="127.0.0.1", dashboard_port=port)
        dashboard_url = f"http://127.0.0.1:{port}"
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for node in nodes[1:]:
            cluster.add_node(**node_args(node))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env=worker_runtime_env())
        yield MultiNodeRay(cluster, cluster.address, dashboard_url)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if shared:
            start_shared_ray()
