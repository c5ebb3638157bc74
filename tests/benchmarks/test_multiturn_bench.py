"""benchmarks/multiturn_bench.py --tiny --spread --read-lags 0,3: the table's rows, the cache check,
trajectories of 1..4 turns timed keeping and dropping the finished rows, which sample the same
ids, and the multi-turn call at two read lags, which sample the same ids too."""

from __future__ import annotations

import pytest

from benchmarks import multiturn_bench

pytestmark = pytest.mark.unit


def test_tiny_spread_run_drops_finished_rows_and_samples_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    multiturn_bench.main(["--tiny", "--spread", "--read-lags", "0,3"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ")]
    cells = {what.strip("| "): value.strip(" |") for what, value in rows}
    assert cells["mean turns, env step (measured), failed steps"].startswith("4.00,")
    assert float(cells["max logprob diff, loop vs fresh forward (8 rows)"]) < 1e-4
    kept = next(key for key in cells if key.startswith("1..4 turns, compact_fraction 0.0 "))
    dropped = next(key for key in cells if key.startswith("1..4 turns, compact_fraction 0.75 "))
    assert "(0 compactions" in kept and "(0 compactions" not in dropped
    assert cells["1..4 turns: trajectories the same either way"] == "8/8"
    assert cells["read lags sampling the first lag's ids"] == "2/2"
    assert cells["multi-turn generation, read_lag 3"].endswith("steps)")
    assert float(cells["host in the environments' submit and poll while rows decode"].split()[0]) >= 0
