"""Tests of app.reporting.tracking: metrics.jsonl, console output, offline W&B files, and degrading to a
warning when wandb cannot be imported or started. No network: W&B runs offline here."""

from __future__ import annotations

import io
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from app.reporting.tracking import StageTimer, Tracker, read_metrics

pytestmark = pytest.mark.unit


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, to see the carriage-return bar."""

    def isatty(self) -> bool:
        return True


def test_metrics_jsonl_and_plain_console_lines(tmp_path: Path) -> None:
    stream = io.StringIO()
    with Tracker(tmp_path / "run", total_iterations=4, wandb_enabled=False, stream=stream) as tracker:
        tracker.log({"rollout/reward_mean": 0.25, "actor/pg_loss": torch.tensor(-0.5),
                     "perf/throughput": np.float32(1234.5), "timing_s/iteration": 2.0}, iteration=0)
        tracker.log({"rollout/reward_mean": 0.5, "actor/kl": float("nan"), "timing_s/iteration": 2.0}, iteration=1)
        # Each line is on disk as soon as log() returns (flushed), before close.
        assert len(read_metrics(tmp_path / "run")) == 2
    rows = read_metrics(tmp_path / "run")
    assert rows[0] == {"iteration": 0, "rollout/reward_mean": 0.25, "actor/pg_loss": -0.5,
                       "perf/throughput": 1234.5, "timing_s/iteration": 2.0}
    assert rows[1]["actor/kl"] is None  # NaN is written as null (valid JSON)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in stream.getvalue()
    assert lines[0].startswith("iter 1/4 [#####...............]  25%")
    assert "reward 0.25" in lines[0] and "pg_loss -0.5" in lines[0] and "tok/s 1234" in lines[0]
    assert lines[1].endswith("2.00s/it eta 0:04")


def test_terminal_progress_bar_and_close(tmp_path: Path) -> None:
    stream = FakeTerminal()
    tracker = Tracker(tmp_path, total_iterations=10, wandb_enabled=False, stream=stream)
    for i in range(3):
        tracker.log({"rollout/reward_mean": i / 10}, iteration=i)
    tracker.close()
    tracker.close()  # a second close is harmless
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "iter 3/10 [######..............]  30%" in text
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log({"x": 1.0}, iteration=3)


def test_bad_metric_value_names_the_key(tmp_path: Path) -> None:
    with Tracker(tmp_path, wandb_enabled=False, console=False) as tracker:
        with pytest.raises(TypeError, match="metric 'actor/pg_loss'"):
            tracker.log({"actor/pg_loss": "low"}, iteration=0)


def test_stage_timer() -> None:
    timer = StageTimer()
    for _ in range(2):
        with timer.stage("gen"):
            time.sleep(0.01)
    with timer.stage("actor_train"):
        pass
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/actor_train"} and metrics["timing_s/gen"] >= 0.02


def test_wandb_offline_writes_run_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(tmp_path, project="realray-test", config={"lr": 1e-3}, console=False) as tracker:
        assert tracker.wandb_run is not None
        tracker.log({"rollout/reward_mean": 0.1}, iteration=0)
        tracker.log({"rollout/reward_mean": 0.2}, iteration=1)
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("*.wandb"))
    assert [row["rollout/reward_mean"] for row in read_metrics(tmp_path)] == [0.1, 0.2]


def test_wandb_import_failure_degrades_to_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.warns(UserWarning, match="cannot import wandb"):
        tracker = Tracker(tmp_path, console=False)
    with tracker:
        assert tracker.wandb_run is None
        tracker.log({"actor/kl": 0.01}, iteration=0)
    assert math.isclose(read_metrics(tmp_path)[0]["actor/kl"], 0.01)


def test_wandb_init_failure_degrades_to_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "not-a-mode")
    with pytest.warns(UserWarning, match="wandb.init failed"):
        tracker = Tracker(tmp_path, console=False)
    tracker.close()
    assert tracker.wandb_run is None
