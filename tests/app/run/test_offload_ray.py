"""Optimizer offload end to end on the shared local Ray (4 virtual GPUs), with the real workers.

The embedded default run (PPO, tiny models, a manual plan) on virtual GPUs given too little
memory (`cluster.gpu_memory_gib`) for the actor's optimizer state: the planner keeps half of it
in host memory, the run trains and reports the streamed seconds. The same run with the default
memory, no offload and the same micro-batching (copied from the first run's plan.json) ends
with the same weights and optimizer state bit for bit, and the same metrics. A run stopped after
a checkpoint written with offloaded state and resumed ends where the uninterrupted one does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.reporting.tracking import read_metrics
from app.run.driver import Driver
from tests.app.run.test_recovery_ray import comparable, tensors_of
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

SMALL = ["tracking.console=false", "batch.prompts=8", "batch.gen_len=4", "run.iterations=4", "checkpoint.every=2"]
TIGHT = "cluster.gpu_memory_gib=0.0017"  # fits only with part of the actor's optimizer state on the host


def config(run_dir: Path, *overrides: str):
    return load_config(DEFAULT_CONFIG, [f"run.dir={run_dir}", *SMALL, *overrides])


def pinned_executions(run_dir: Path) -> list[str]:
    """Overrides that give every call the placement and the micro-batching / rounds the run's
    plan.json chose."""
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]
    keys = ("mesh", "layout", "micro_batch_tokens", "gen_rounds")
    return [f"plan.manual.{call}.{key}={entry[key]}" for call, entry in plan.items() for key in keys if key in entry]


def measured(rows: list[dict]) -> list[dict]:
    """What the runs must agree on: every metric but wall-clock ones, the offload's seconds and
    the plan's estimates (the two plans differ in what they keep on the GPU)."""
    return [{k: v for k, v in row.items() if k != "actor/offload_s" and not k.startswith("timing_est_s/")
             and not k.endswith("_est_gib")} for row in comparable(rows)]


def test_planned_offload_trains_exactly_like_no_offload_and_resumes(ray_session: None,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    offloaded, on_gpu, resumed = tmp_path / "offloaded", tmp_path / "on_gpu", tmp_path / "resumed"
    Driver(config(offloaded, TIGHT), offloaded).run()
    plan = json.loads((offloaded / "plan.json").read_text())
    assert plan["optimizer_offload"] == {"actor": 0.5}
    rows = read_metrics(offloaded)
    assert len(rows) == 4 and all(row["actor/offload_s"] > 0 for row in rows)
    final = tensors_of(offloaded / "checkpoints" / "iter_4")
    assert any("exp_avg/" in k for k in final)

    # The same program with all optimizer state on the GPUs: the same numbers, bit for bit.
    Driver(config(on_gpu, *pinned_executions(offloaded), "plan.optimizer_offload={actor: 0, critic: 0}"), on_gpu).run()
    assert json.loads((on_gpu / "plan.json").read_text())["optimizer_offload"] == {}
    assert "actor/offload_s" not in read_metrics(on_gpu)[0]
    assert measured(rows) == measured(read_metrics(on_gpu))
    assert_same_tensors(final, tensors_of(on_gpu / "checkpoints" / "iter_4"))

    # Stopped after the checkpoint iter_2 (written with offloaded state), then resumed.
    Driver(config(resumed, TIGHT), resumed).run(2)
    assert not (resumed / "checkpoints" / "iter_4").exists()
    more = Driver(config(resumed, TIGHT, "run.resume=auto"), resumed).run()
    assert [int(r["iteration"]) for r in more] == [2, 3]
    assert measured(rows) == measured(read_metrics(resumed))
    assert_same_tensors(final, tensors_of(resumed / "checkpoints" / "iter_4"))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), key
