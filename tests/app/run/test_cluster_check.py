"""The configured cluster against a described Ray cluster (app.run.cluster_check), without Ray;
and which failures may come from a lost node (app.run.failures)."""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import ActorDiedError

from app.config import ConfigError, load_config
from app.run.cluster_check import check_local_start, planner_nodes
from app.run.failures import may_be_node_loss
from cluster.resources import RayClusterInfo, RayNode
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec
from tests.ray_fixtures import REPO_ROOT

pytestmark = pytest.mark.unit

PPO_TINY = REPO_ROOT / "examples" / "ppo-tiny.yaml"


def virtual_cluster(*gpus: int) -> RayClusterInfo:
    nodes = tuple(RayNode(f"{i:02d}" * 8, "10.0.0.1", n, 1.0, i == 0) for i, n in enumerate(gpus))
    return RayClusterInfo(ClusterSpec(len(nodes), min(gpus), hardware_preset("cpu")), nodes, virtual=True)


def test_the_planner_nodes_are_the_first_that_fit_in_cluster_order() -> None:
    cfg = load_config(PPO_TINY, ["cluster.nodes=2", "cluster.gpus_per_node=2"])
    info = planner_nodes(cfg, virtual_cluster(1, 2, 4, 2))
    assert [n.node_id[:2] for n in info.nodes] == ["01", "02"]
    assert (info.spec.nodes, info.spec.gpus_per_node) == (2, 2)
    with pytest.raises(ConfigError, match=r"cluster='2x2': larger than the Ray cluster: .*only 1 node\(s\) hold 2 GPUs"
                                          r".*allowed: at most what the Ray cluster has: 2 GPU node\(s\)"):
        planner_nodes(cfg, virtual_cluster(1, 2))


def test_several_virtual_nodes_need_a_ray_cluster_to_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    cfg = load_config(PPO_TINY, ["cluster.nodes=2", "cluster.gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"cluster.nodes=2: no Ray cluster to join \(RAY_ADDRESS is unset\); "
                                          r"allowed: 1 for the local Ray .*ray start --head"):
        check_local_start(cfg)
    check_local_start(load_config(PPO_TINY))  # one node: a local Ray holds it
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    check_local_start(cfg)  # a cluster to join


def test_failures_a_lost_node_may_explain() -> None:
    assert may_be_node_loss(ActorDiedError())
    assert may_be_node_loss(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234"))
    assert not may_be_node_loss(ValueError("rank 1: model 'actor' was never loaded here"))
