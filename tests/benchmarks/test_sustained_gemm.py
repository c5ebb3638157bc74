"""benchmarks/sustained_gemm.py on CPU: a rate per whole second, and the summary of them."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sustained_gemm import main, report, run

pytestmark = pytest.mark.unit


def test_rates_per_second_on_cpu() -> None:
    rates = run(64, 2.2, torch.device("cpu"), torch.float32, batch=4)
    assert len(rates) == 2 and all(r > 0 for r in rates)


def test_report_names_the_first_best_and_steady_rates() -> None:
    text = report([700.0, 800.0, 650.0, 640.0], 8192, "H200")
    assert "700 800 650 640" in text and "first second 700.0, best 800.0" in text
    assert "median of the second half 645.0 (80.6% of the best)" in text
    assert report([], 8, "x").startswith("no whole second")


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--cpu", "--n", "0"])
    assert "--n=0" in capsys.readouterr().err
