"""benchmarks/compaction_bench.py --cpu --tiny: the planted EOS ends rows at about the mean it aims
at, the loop compacts for every fraction but 0, every fraction samples the same rows, and the
table comes last; bad --fractions are refused."""

from __future__ import annotations

import pytest

from benchmarks import compaction_bench

pytestmark = pytest.mark.unit


def test_tiny_run_compacts_and_samples_the_same_rows(capsys: pytest.CaptureFixture[str]) -> None:
    compaction_bench.main(["--cpu", "--tiny", "--fractions", "0,0.5", "--min-row-steps", "auto,100000"])
    lines = capsys.readouterr().out.strip().splitlines()
    table = lines[-3:]  # fraction 0, then 0.5 with the default rule and with a bar no call reaches
    cells = [line.split() for line in table]
    assert [row[:2] for row in cells] == [["0", "-"], ["0.5", "0"], ["0.5", "100000"]]  # eager: no bar
    mean_len = [float(row[2]) for row in cells]
    assert len(set(mean_len)) == 1 and 10.0 < mean_len[0] < 45.0  # aimed at 24 of a 64-token budget
    assert [cells[0][7], cells[2][7]] == ["0", "0"] and int(cells[1][7]) >= 1  # compactions
    assert float(cells[0][5]) == 0.0 and float(cells[1][5]) > 0.0  # their host seconds
    assert all(row[-2] == "16/16" for row in cells)  # the same length for every row


@pytest.mark.parametrize("value", ["-1", "many", "auto,x"])
def test_bad_min_row_steps_exit(value: str) -> None:
    with pytest.raises(SystemExit, match="--min-row-steps"):
        compaction_bench.parse_args(["--min-row-steps", value])


@pytest.mark.parametrize("fractions", ["0.5", "0,1.0", "0,-0.5"])
def test_fractions_without_the_baseline_or_outside_0_1_exit(fractions: str) -> None:
    with pytest.raises(SystemExit, match="--fractions"):
        compaction_bench.parse_args(["--fractions", fractions])
