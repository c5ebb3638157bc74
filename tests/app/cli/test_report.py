"""`python -m app report RUN_DIR [--out FILE.png]`: the curves PNG, the summary, bad run dirs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from app.cli import main
from app.reporting.curves import curve_panels

pytestmark = pytest.mark.unit


def write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def ppo_rows(n: int) -> list[dict]:
    return [{"iteration": i, "rollout/reward_mean": 0.1 * i, "rollout/response_length_mean": 8.0 - i / 10,
             "actor/kl": 0.01 * i, "actor/pg_loss": -0.1 * i, "critic/vf_loss": None if i == 1 else 1.0 / (i + 1),
             "timing_s/actor_gen": 1.0, "timing_s/actor_train": 2.0, "timing_s/iteration": 3.5,
             "timing_s/realloc": 0.1, "perf/throughput": 100.0 + i} for i in range(n)]


def test_report_draws_every_panel_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path / "run", ppo_rows(8))
    out = tmp_path / "curves.png"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "8 iterations" in text
    assert "reward: first 5 0.2 -> last 5 0.5" in text
    assert "actor_gen 1, actor_train 2, iteration 3.5" in text and "throughput: 103.5" in text
    assert "curves:" in text and "time per call" in text
    panels = {p.title: p.metrics for p in curve_panels(ppo_rows(8))}
    assert panels["losses"] == ("actor/pg_loss", "critic/vf_loss")
    assert panels["time per call"] == ("timing_s/actor_gen", "timing_s/actor_train", "timing_s/iteration")
    # Default output: RUN_DIR/curves.png.
    assert main(["report", str(run_dir)]) == 0 and (run_dir / "curves.png").is_file()


def test_grpo_rows_without_a_critic_draw_their_own_panels(tmp_path: Path) -> None:
    rows = [{"iteration": i, "rollout/reward_mean": 0.5, "actor/kl_loss": 0.001, "actor/pg_loss": 0.2,
             "timing_s/actor_gen": 1.0} for i in range(3)]
    assert [p.title for p in curve_panels(rows)] == ["reward", "KL to the reference", "losses", "time per call"]
    assert main(["report", str(write_run(tmp_path / "grpo", rows))]) == 0


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "no such directory"),
    (lambda d: d.mkdir(), "has no metrics.jsonl"),
    (lambda d: write_run(d, []), "no iteration recorded yet"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"iteration": 0}\n{oops\n')), "line 2: invalid JSON"),
    (lambda d: write_run(d, [{"iteration": 0, "note": "text"}]), "no numeric metric to draw"),
])
def test_bad_run_dir_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           setup: Callable[[Path], object], message: str) -> None:
    run_dir = tmp_path / "run"
    setup(run_dir)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
