"""Runs on a real multi-node Ray cluster on this machine (tests.ray_fixtures.multinode_ray).

The module's cluster starts with two nodes of 2 virtual GPUs and 1 CPU each (the head with the
dashboard, for `ray job submit`); the four-node test adds two nodes of 1 GPU. In file order:
* the configured cluster is checked against the live one before any placement group: too many
  nodes, too many GPUs per node, and `cluster.virtual_gpus=false` on GPUs that are not CUDA
  devices each fail at once in one line (the CLI exits 2);
* PPO with a manual plan placing calls on different nodes (critic on node 1, generation on
  node 0) and layouts spanning both (ref dp2tp2 and actor training tp2pp2 over both nodes: dp
  and pp across nodes, tp inside), reallocating the actor between them every iteration; the
  workers run on the Ray nodes their names say; then the frozen reference model, reallocated
  between meshes on different nodes and across-node layouts, equals the serial model exactly;
* `ray job submit` of `python -m app train` (PPO, searched plan) against the two-node cluster;
* `python -m app profile --inter-node` times the link between the two nodes into the profile;
* GRPO with a searched plan on four nodes of one GPU;
* losing a node mid-run (its raylet and everything under it killed) ends the run, naming the
  node and the calls in flight there, well within the call timeout.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from actors.engine import ModelEngine, ParallelGroups
from actors.worker import CallSpec, ModelWorker, placement_group_sets
from app.config import ConfigError, load_config
from app.reporting.timeline import read_records
from app.reporting.tracking import read_metrics
from app.run import Driver, DriverError
from cluster.resources import ClusterShortfall, gpu_nodes, select_nodes
from planning.hardware import hardware_preset
from planning.layout import Layout, Mesh
from planning.plan import Placement
from planning.realloc_plan import ShardSlice, plan_reallocation, rank_params
from tests.ray_fixtures import REPO_ROOT, MultiNodeRay, NodeResources, multinode_ray

pytestmark = pytest.mark.ray

PPO_TINY = REPO_ROOT / "examples" / "ppo-tiny.yaml"
TWO_NODES = ["cluster.nodes=2", "cluster.gpus_per_node=2"]
JOB_AGENT_RETRIES = 12
SMALL = ["batch.prompts=16", "tracking.console=false", "tracking.wandb=false"]
# Calls on different nodes, and layouts over both nodes with tp inside one.
ACROSS_NODES = {
    "actor_gen": ("n0", "dp2"), "rew_inf": ("n1", "dp2"), "ref_inf": ("n0-1", "dp2tp2"),
    "critic_inf": ("n1", "dp2"), "actor_train": ("n0-1", "tp2pp2"), "critic_train": ("n1", "dp2"),
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[MultiNodeRay]:
    with multinode_ray([NodeResources(gpus=2), NodeResources(gpus=2)], dashboard=True) as running:
        yield running


def config(run_dir: Path, *overrides: str) -> Any:
    return load_config(PPO_TINY, [*TWO_NODES, *SMALL, f"run.dir={run_dir}", *overrides])


def manual_overrides(plan: dict[str, tuple[str, str]]) -> list[str]:
    return [f"plan.manual.{call}.{key}={value}" for call, (mesh, layout) in plan.items()
            for key, value in (("mesh", mesh), ("layout", layout))]


# ---- the configured cluster against the live one -------------------------------------------------


def test_a_cluster_that_does_not_fit_fails_at_once_naming_what_is_missing(
        cluster: MultiNodeRay, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    groups_before = len(ray.util.placement_group_table())
    cases = [
        (["cluster.nodes=3"], r"cluster='3x2': larger than the Ray cluster: .*only 2 node\(s\) hold 2 GPUs"),
        (["cluster.gpus_per_node=4"], r"cluster='2x4': .*no node holds 4 GPUs \(the most on one node: 2\)"),
    ]
    for overrides, message in cases:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=message) as caught:
            Driver(config(tmp_path, *overrides), tmp_path)
        assert "the Ray cluster has: 2 GPU node(s)" in str(caught.value) and "2 GPUs, 1 CPUs" in str(caught.value)
        assert time.monotonic() - started < 30
    # GPU resources that are not CUDA devices, with virtual GPUs off: one line, exit status 2.
    argv = ["train", str(PPO_TINY), *TWO_NODES, *SMALL, f"run.dir={tmp_path}", "cluster.virtual_gpus=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cluster.virtual_gpus=False: torch sees no CUDA device on node(s)") and "\n" not in err
    assert "allowed: true" in err
    # Real GPUs reserve a CPU per worker (RayClusterInfo.cpus_per_worker): with 1 CPU per node, a
    # node of 2 GPUs is short of CPUs (checked once its GPUs are CUDA devices; here on its own).
    with pytest.raises(ClusterShortfall, match=r"with 2 CPUs each for their workers \(1 per GPU\), but only 0"):
        select_nodes(gpu_nodes(ray.nodes()), 2, 2, cpus_per_gpu=1.0)
    assert len(ray.util.placement_group_table()) == groups_before  # nothing was reserved


# ---- PPO across nodes, then exact reallocation between them --------------------------------------


def _node_id(worker: object) -> str:
    return ray.get_runtime_context().get_node_id()


def _shards_of(worker: Any, role: str, placement: Placement) -> dict[str, torch.Tensor]:
    """This rank's shards of `role` under `placement` (empty outside its mesh)."""
    if worker.rank not in placement.mesh.gpus:
        return {}
    return {name: tensor.detach().clone() for name, tensor in worker._roles[role].copies.shards(placement).items()}


def _slice(full: torch.Tensor, piece: ShardSlice) -> torch.Tensor:
    return full if piece.dim is None else full.narrow(piece.dim, piece.start, piece.stop - piece.start)


def test_ppo_across_two_nodes_then_exact_reallocation_between_them(cluster: MultiNodeRay, tmp_path: Path) -> None:
    cfg = config(tmp_path, "run.iterations=2", "checkpoint.at_end=false", *manual_overrides(ACROSS_NODES))
    driver = Driver(cfg, tmp_path)
    try:
        rows = [driver.step() for _ in range(2)]
        workers = driver.workers
        assert workers is not None
        # Planner node i is the Ray node its placement group was pinned to; the two differ.
        node_ids = workers.get(workers.call_function(_node_id), 60)
        assert node_ids == [slot.node_id for slot in workers.slots]
        assert node_ids[0] == node_ids[1] != node_ids[2] == node_ids[3]
        assert workers.names == ("worker-n0-g0", "worker-n0-g1", "worker-n1-g0", "worker-n1-g1")
        check_exact_reallocations(workers, driver.inputs.models["ref"].spec)
    finally:
        driver.close()
    assert [int(r["iteration"]) for r in rows] == [0, 1]
    assert all(r["realloc/received_gb"] > 0 and r["rollout/reward_mean"] >= 0 for r in rows)
    records = read_records(tmp_path / "timeline.jsonl")
    ranks = {name: {r.rank for r in records if r.name == name and r.kind == "call"} for name in ACROSS_NODES}
    assert ranks["actor_train"] == ranks["ref_inf"] == {0, 1, 2, 3}
    assert ranks["critic_train"] == {2, 3} and ranks["actor_gen"] == {0, 1}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert {c["name"]: c["layout"] for c in plan["calls"]}["actor_train"] == "dp1tp2pp2"


def check_exact_reallocations(workers: Any, spec: Any) -> None:
    """Move the frozen reference model (loaded from seed 0, the actor's) from its dp2tp2 home
    over both nodes to node 1, to tp2pp2 over both, to node 0 and to one GPU; after each move
    every rank's shards equal the serial model's slices exactly."""
    full = {name: p.detach() for name, p in
            ModelEngine(spec, False, ParallelGroups.serial(), "cpu", torch.float32, seed=0).model.named_parameters()}
    chain = [Placement(Mesh(0, 4, 2), Layout(dp=2, tp=2)), Placement(Mesh(2, 2, 2), Layout(tp=2)),
             Placement(Mesh(0, 4, 2), Layout(tp=2, pp=2)), Placement(Mesh(0, 2, 2), Layout(dp=2)),
             Placement(Mesh(1, 1, 2), Layout())]
    sets: list[tuple[int, ...]] = []
    for src, dst in itertools.pairwise(chain):
        sets += [*plan_reallocation(spec, False, src, dst).groups, *placement_group_sets(dst)]
        sets.append(tuple(sorted(set(src.mesh.gpus) | set(dst.mesh.gpus))))
    workers.run("ensure_groups", [list(s) for s in sets], timeout_s=120)
    for src, dst in itertools.pairwise(chain):
        workers.run("reallocate", "ref", src, dst, timeout_s=120)
        held = workers.get(workers.call_function(_shards_of, "ref", dst), 120)
        for rank, shards in enumerate(held):
            expected = {} if rank not in dst.mesh.gpus else {
                p.name: _slice(full[p.name], piece) for p, piece in rank_params(spec, False, dst, rank - dst.mesh.start)}
            assert sorted(shards) == sorted(expected), (dst, rank)
            for name, tensor in expected.items():
                assert torch.equal(shards[name], tensor), f"{dst.mesh}/{dst.layout} rank {rank}: {name} differs"


# ---- ray job submit ---------------------------------------------------------------------------------


def test_ray_job_submit_trains_ppo_with_a_searched_plan(cluster: MultiNodeRay, tmp_path: Path) -> None:
    assert cluster.dashboard_url is not None
    wait_for_dashboard(cluster.dashboard_url)
    run_dir = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = ["ray", "job", "submit", "--address", cluster.dashboard_url, "--working-dir", ".",
               "--runtime-env-json", json.dumps({"excludes": ["runs", ".git", "*.png", "wandb"]}), "--",
               sys.executable, "-m", "app", "train", "examples/ppo-tiny.yaml", *TWO_NODES, *SMALL,
               "plan.mode=search", "plan.seconds=2", "run.iterations=1", "checkpoint.at_end=false",
               f"run.dir={run_dir}"]
    for _ in range(JOB_AGENT_RETRIES):  # the head's job agent registers a while after the dashboard answers
        submit = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420,
                                check=False)
        if submit.returncode == 0 or "No available agent" not in submit.stderr:
            break
        time.sleep(5)
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "1 iterations; reward mean" in submit.stdout
    assert [m["iteration"] for m in read_metrics(run_dir)] == [0]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mode"] == "search" and plan["cluster"].startswith("2x2")


def wait_for_dashboard(url: str, timeout_s: float = 120.0) -> None:
    """Until the dashboard answers (401 too: with token authentication, which a local ray.init
    turns on by default, the job CLI sends the token and this probe does not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


# ---- the inter-node link, measured --------------------------------------------------------------------


def test_profile_measures_the_link_between_two_nodes(cluster: MultiNodeRay, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"peak_flops": 1e10}))  # a single-node profile, which it completes
    assert main(["profile", "--inter-node", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    assert "inter-node link" in capsys.readouterr().out
    profile = json.loads(out.read_text())
    assert profile["peak_flops"] == 1e10 and profile["inter_node_bw"] > 0
    link = profile["measurements"]["inter_node"]
    assert link["backend"] == "gloo" and link["nodes"][0] != link["nodes"][1]
    assert hardware_preset("cpu").with_profile(out).inter_node_bw == profile["inter_node_bw"]


# ---- four nodes ---------------------------------------------------------------------------------------


def test_grpo_with_a_searched_plan_on_four_nodes(cluster: MultiNodeRay, tmp_path: Path) -> None:
    for _ in range(2):
        cluster.add_node(NodeResources(gpus=1))
    cfg = config(tmp_path, "cluster.nodes=4", "cluster.gpus_per_node=1", "algorithm=grpo", "batch.group_size=4",
                 "plan.mode=search", "plan.seconds=2", "run.iterations=1", "checkpoint.at_end=false")
    driver = Driver(cfg, tmp_path)
    try:
        rows = [driver.step()]
        assert driver.workers is not None
        assert len({slot.node_id for slot in driver.workers.slots}) == 4
    finally:
        driver.close()
    assert [int(r["iteration"]) for r in rows] == [0]
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in rows)  # not NaN


# ---- losing a node ------------------------------------------------------------------------------------


class NodeLosingWorker(ModelWorker):
    """Rank 2 (node 1) takes its whole Ray node down in iteration 1's critic inference: its
    raylet and every process under it (the node's workers, agents) die, as with a machine."""

    def run_call(self, call: CallSpec, *inputs: dict | None) -> tuple[dict, dict | None]:
        if call.name == "critic_inf" and call.iteration == 1 and self.rank == 2:
            kill_this_node()
        return super().run_call(call, *inputs)


def kill_this_node() -> None:
    import psutil

    raylet = psutil.Process(os.getppid())
    assert raylet.name() == "raylet", raylet.name()
    for process in raylet.children(recursive=True):
        if process.pid != os.getpid():
            process.kill()
    raylet.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def test_losing_a_node_ends_the_run_naming_the_node_and_the_calls(cluster: MultiNodeRay, tmp_path: Path) -> None:
    # Two nodes of 2 GPUs (the head and the first worker node); the 1-GPU nodes stay idle.
    call_timeout_s = 90.0
    cfg = config(tmp_path, "run.iterations=3", "checkpoint.at_end=false", f"run.call_timeout_s={call_timeout_s}")
    driver = Driver(cfg, tmp_path, worker_cls=NodeLosingWorker)
    try:
        driver.step()  # iteration 0; iteration 1 is already submitted, and takes node 1 down
        started = time.monotonic()
        with pytest.raises(DriverError) as caught:
            driver.step()
        elapsed = time.monotonic() - started
    finally:
        driver.close()
    message = str(caught.value)
    assert "\n" not in message
    assert "lost node 1 (" in message and "workers worker-n1-g0, worker-n1-g1" in message, message
    assert "critic_inf' of iteration 1" in message, message
    assert elapsed < call_timeout_s, elapsed
    assert [m["iteration"] for m in read_metrics(tmp_path)] == [0]
