"""Unit tests of checkpoint bookkeeping and resume rules: atomic writes, pruning, incomplete
checkpoints never loaded, one run per run directory, the driver's state and the logs' rewind."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from app.cli.train import DEFAULT_CONFIG
from app.config import ConfigError
from app.config.experiment import load_config
from app.run.checkpoint import (
    begin,
    checkpoint_dir,
    commit,
    complete_checkpoints,
    incomplete_checkpoints,
    is_due,
    latest_checkpoint,
    prune,
    staging_dir,
)
from app.run.resume import (
    RunState,
    check_fingerprint,
    check_run_dir,
    clear_incomplete,
    driver_rng_state,
    fingerprint,
    placement_json,
    placement_of,
    read_run_state,
    restore_driver_rng,
    rewind_logs,
)
from planning.layout import Layout, Mesh
from planning.plan import Placement

pytestmark = pytest.mark.unit


def write_checkpoint(run_dir: Path, n: int, roles: tuple[str, ...] = ("actor",), state: RunState | None = None) -> Path:
    staging = begin(run_dir, n)
    for role in roles:
        (staging / role).mkdir()
        (staging / role / "config.json").write_text("{}")
    record = {"run_state": state.to_json()} if state is not None else {}
    return commit(staging, n, list(roles), record)


def test_schedule_atomic_commit_and_never_rewritten(tmp_path: Path) -> None:
    assert [n for n in range(1, 8) if is_due(n, 3, 7, True)] == [3, 6, 7]
    assert [n for n in range(1, 8) if is_due(n, 0, 7, False)] == []
    with pytest.raises(ValueError, match="iterations_done"):
        checkpoint_dir(tmp_path, 0)
    staging = begin(tmp_path, 3)
    assert staging == staging_dir(tmp_path, 3) and staging.name == ".tmp-iter_3"
    assert latest_checkpoint(tmp_path) is None and incomplete_checkpoints(tmp_path) == [staging]
    (staging / "actor").mkdir()
    with pytest.raises(RuntimeError, match="actor"):  # an export that wrote nothing
        commit(staging, 3, ["actor"], {})
    (staging / "actor" / "config.json").write_text("{}")
    final = commit(staging, 3, ["actor"], {"exports": {}})
    assert final == checkpoint_dir(tmp_path, 3) and not staging.exists()
    assert json.loads((final / "checkpoint.json").read_text())["iterations"] == 3
    assert latest_checkpoint(tmp_path) == final and incomplete_checkpoints(tmp_path) == []
    with pytest.raises(FileExistsError, match="never rewritten"):
        begin(tmp_path, 3)


def test_incomplete_checkpoints_are_never_loaded_and_are_cleared(tmp_path: Path) -> None:
    done = write_checkpoint(tmp_path, 2)
    killed = begin(tmp_path, 4)  # a writer killed mid-checkpoint
    (killed / "actor").mkdir()
    legacy = checkpoint_dir(tmp_path, 6)  # an older version's checkpoint without its marker
    (legacy / "actor").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == done
    assert incomplete_checkpoints(tmp_path) == [killed, legacy]
    messages = clear_incomplete(tmp_path)
    assert len(messages) == 2 and all("incomplete" in m for m in messages)
    assert incomplete_checkpoints(tmp_path) == [] and complete_checkpoints(tmp_path) == [done]
    again = begin(tmp_path, 4)  # the same N is written again later
    assert again.is_dir() and not any(again.iterdir())


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for n in (1, 2, 3, 4):
        write_checkpoint(tmp_path, n)
    removed = prune(tmp_path, keep=2)
    assert [d.name for d in removed] == ["iter_1", "iter_2"]
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["iter_3", "iter_4"]
    assert prune(tmp_path, keep=0) == []
    assert not list((tmp_path / "checkpoints").glob(".del-*"))


def state(n: int = 4) -> RunState:
    cfg = load_config(DEFAULT_CONFIG)
    home = Placement(Mesh(0, 2, 4), Layout(tp=2))
    return RunState(n, 1, 32, 0.07, {n: 0.05}, {"actor": placement_json(home)}, fingerprint(cfg), "abc123",
                    driver_rng_state())


def test_run_state_round_trips_and_the_fingerprint_is_checked(tmp_path: Path) -> None:
    saved = state()
    final = write_checkpoint(tmp_path, 4, state=saved)
    loaded = read_run_state(final)
    assert loaded == saved and placement_of(loaded.homes["actor"]) == Placement(Mesh(0, 2, 4), Layout(tp=2))
    check_fingerprint(loaded, load_config(DEFAULT_CONFIG, ["run.iterations=99", "plan.mode=heuristic"]), final)
    with pytest.raises(ConfigError, match="batch.prompts=32.*differs"):
        check_fingerprint(loaded, load_config(DEFAULT_CONFIG, ["batch.prompts=32"]), final)
    (final / "checkpoint.json").write_text("{}")
    with pytest.raises(ConfigError, match="run.resume"):
        read_run_state(final)


def test_driver_random_generators_round_trip() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = json.loads(json.dumps(driver_rng_state()))  # as stored in checkpoint.json
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_driver_rng(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_run_directory_holds_one_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert check_run_dir(run, None) is None and check_run_dir(run, "auto") is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="run.dir=.*names an existing file"):
        check_run_dir(tmp_path / "file", None)
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # unrelated files do not make a run
    assert check_run_dir(run, None) is None
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(run, None)
    assert check_run_dir(run, "auto") is None  # no checkpoint yet: starts again from iteration 0
    first, second = write_checkpoint(run, 2), write_checkpoint(run, 4)
    assert check_run_dir(run, "auto") == second and check_run_dir(run, str(second)) == second
    with pytest.raises(ConfigError, match="later checkpoints exist \\(iter_4\\)"):
        check_run_dir(run, str(first))
    assert check_run_dir(tmp_path / "fresh", str(second)) == second  # continue elsewhere
    with pytest.raises(ConfigError, match="run.resume"):
        check_run_dir(run, str(run / "checkpoints" / "iter_9"))


def test_rewind_logs_keeps_the_iterations_before_the_checkpoint(tmp_path: Path) -> None:
    rows = [json.dumps({"iteration": i, "x": i}) for i in (0, 1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"iteration": 4, "x"')  # a row cut by a kill
    (tmp_path / "timeline.jsonl").write_text("\n".join(rows) + "\n")
    rewind_logs(tmp_path, 2)
    for name in ("metrics.jsonl", "timeline.jsonl"):
        kept = [json.loads(line)["iteration"] for line in (tmp_path / name).read_text().splitlines()]
        assert kept == [0, 1]
    rewind_logs(tmp_path, 0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
