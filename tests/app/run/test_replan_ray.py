"""Online re-planning end to end on the shared local Ray (2 CPUs, 4 virtual GPUs).

The tiny PPO config starts from a deliberately bad manual plan: every call on GPU 0 alone, the
other three idle. After one iteration (`plan.recalibrate_after=1`) the driver fits the cost model
to the measured call times, searches again from that plan, finds one spreading the calls over
the four GPUs (estimated far more than `plan.switch_gain` faster) and switches between two
iterations: the actor and critic move with their optimizer state (`ModelWorker.rehome`), the
reference with a reallocation. Checked: the decision is in plan.json's history, in
plan_history.jsonl and in the metrics; the actor's and critic's weights exported right after the
switch (from their new homes) equal the checkpoint written right before it (from GPU 0); training
goes on under the new plan (its calls run on the new placements, its metrics stay finite); call
records carry the plan's estimates, and the worker's memory probe (injected: CPU has none)
reaches timeline.jsonl, the memory metrics and timings.json (for every call but the rule reward,
which runs on the worker's threads beside GPU calls and measures no peak).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from actors.worker.memory import MemoryPeak
from actors.worker.model_worker import ModelWorker
from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.reporting.timeline import read_records
from app.reporting.tracking import read_metrics
from app.run.driver import Driver
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

CALLS = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_inf", "actor_train", "critic_train")
MAX_ITERATIONS = 5
FAKE_PEAK = MemoryPeak(allocated_bytes=3 * 2**20, reserved_bytes=4 * 2**20)


class FixedPeakProbe:
    """A memory probe that reports the same peak for every call (CPU workers have none)."""

    def reset(self) -> None:
        return None

    def peak(self) -> MemoryPeak:
        return FAKE_PEAK


class ProbedWorker(ModelWorker):
    def __init__(self, rank: int, world_size: int, device: str = "auto") -> None:
        super().__init__(rank, world_size, device)
        self.memory_probe = FixedPeakProbe()


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_replan_switches_plans_and_keeps_the_weights(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    on_gpu0 = [f"plan.manual.{call}={{mesh: 'n0:g0', layout: dp1tp1pp1}}" for call in CALLS]
    cfg = load_config(DEFAULT_CONFIG, [f"run.dir={tmp_path}", "tracking.console=false", *on_gpu0,
                                       f"run.iterations={MAX_ITERATIONS}", "plan.recalibrate_after=1",
                                       "plan.seconds=2", "checkpoint.every=1", "checkpoint.keep=0", "batch.prompts=16"])
    driver = Driver(cfg, tmp_path, worker_cls=ProbedWorker)
    try:
        # Calibrated after iteration 0, decided when iteration 1 is collected, applied once
        # iteration 2 (submitted before the decision) is in: iteration 3 runs the new plan.
        for _ in range(3):
            driver.step()
        switched_at = driver._plan_since
        assert switched_at == 3 and driver.dispatch is not None and not driver.dispatch.pending
        new_plan = driver.plan
        assert any(new_plan[c].mesh.size > 1 for c in CALLS)
        moved = tmp_path / "after-switch"
        for role in ("actor", "critic"):
            home = driver.dispatch.location[role]
            driver.workers.run("export", role, str(moved / role), ranks=list(home.mesh.gpus))
        # The probe's 3 MiB exceeds the estimates of the spread-out plan's calls (the tiny models
        # are 1-2 MiB per GPU there): a warning naming the call.
        with pytest.warns(UserWarning, match="call .* measured peak .* exceeds its estimate"):
            rows = [driver.step() for _ in range(MAX_ITERATIONS - switched_at)]
    finally:
        driver.close()
    before = tmp_path / "checkpoints" / f"iter_{switched_at}"  # written after the last old-plan training
    for role in ("actor", "critic"):
        old, new = _weights(before / role), _weights(moved / role)
        assert set(old) == set(new)
        assert all(bool((old[name] == new[name]).all()) for name in old), f"{role}: weights changed by the move"
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["critic/vf_loss"]) for r in rows)

    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["since_iteration"] == switched_at and plan["history"][0]["switched"] is True
    entry = plan["history"][0]
    assert entry["new_est_iteration_s"] < entry["current_est_iteration_s"] * (1 - cfg.plan.switch_gain)
    assert {r["name"]: r["mesh"] for r in plan["calls"]} == {c: str(p.mesh) for c, p in new_plan.placements}
    assert all(call["micro_batch_tokens"] or call["gen_rounds"] or call["model_free"] for call in plan["calls"])
    history = [json.loads(line) for line in (tmp_path / "plan_history.jsonl").read_text().splitlines()]
    assert history == plan["history"]

    records = read_records(tmp_path / "timeline.jsonl")
    later = [r for r in records if r.kind == "call" and r.iteration >= switched_at]
    assert later and all(r.rank in new_plan[r.name].mesh.gpus for r in later)
    assert {r.name for r in records if r.kind == "realloc" and r.name.startswith("replan:")} >= {
        "replan:actor", "replan:critic"}
    calls = [r for r in records if r.kind == "call"]
    assert all(r.est_s and r.est_s > 0 and r.est_peak_bytes for r in calls)
    # The rule reward runs beside GPU calls on the worker's threads: no probe, no peak.
    assert all(r.peak_allocated_bytes == (None if r.name == "rew_inf" else FAKE_PEAK.allocated_bytes) for r in calls)
    metrics = read_metrics(tmp_path)
    assert any(m.get("plan/switched") == 1.0 for m in metrics)
    assert all(m["memory/actor_train_peak_gib"] == pytest.approx(3 / 1024) for m in metrics)
    assert all(m["memory/actor_train_est_gib"] > 0 and m["timing_est_s/actor_gen"] > 0 for m in metrics)
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert {row["call"] for row in timings} == set(CALLS)
    assert all(row["estimated_peak_gib"] > 0 for row in timings)
    assert all(row["measured_peak_gib"] == pytest.approx(3 / 1024) for row in timings if row["call"] != "rew_inf")
