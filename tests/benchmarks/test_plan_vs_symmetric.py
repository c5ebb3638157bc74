"""benchmarks/plan_vs_symmetric.py: steady-state figures and speedups from two runs' outputs."""

from __future__ import annotations

import math

import pytest

from benchmarks.plan_vs_symmetric import CASES, main, summarise, table

pytestmark = pytest.mark.unit


def _result(est: float, iterations: list[float], realloc: float, peak: float) -> dict:
    rows = [{"iteration": i, "timing_s/iteration": t, "timing_s/realloc": realloc, "realloc/received_gb": 1.5,
             "memory/actor_train_peak_gib": peak, "memory/actor_gen_peak_gib": peak / 2}
            for i, t in enumerate(iterations)]
    return {"rc": 0, "plan": {"est_iteration_s": est}, "rows": rows}


def test_steady_state_leaves_out_the_first_iteration_and_speedups_compare_the_modes() -> None:
    searched = _result(8.0, [30.0, 9.0, 11.0], realloc=0.2, peak=60.0)
    symmetric = _result(10.0, [25.0, 12.0, 12.0], realloc=0.0, peak=70.0)
    s = summarise(searched)
    assert s["meas_s"] == 10.0 and s["est_s"] == 8.0 and s["peak_gib"] == 60.0
    assert math.isclose(s["realloc_pct"], 2.0) and s["realloc_gb"] == 1.5
    text = table({("2gpu-ppo-1b-1b", 0): {"search": searched, "heuristic": symmetric}})
    row = next(line for line in text.splitlines() if " search " in line)
    # estimated 10 / 8 = 1.25x, measured 12 / 10 = 1.20x, measured / estimated 0.96x
    assert "1.25x" in row and "1.20x" in row and "0.96x" in row


def test_failed_run_is_a_row_not_a_crash() -> None:
    failed = {"rc": 1, "error": "ConfigError: plan.manual ..."}
    text = table({("tiny", 1): {"search": failed, "heuristic": _result(1.0, [1.0, 1.0], 0.0, 1.0)}})
    assert "failed: ConfigError" in text


def test_unknown_case_and_bad_iterations_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--cases", "9gpu-nothing"])
    assert exc.value.code == 2 and "unknown; allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--iterations", "0"])
    assert all(c.gpus in (0, 2, 4, 8) for c in CASES.values())
