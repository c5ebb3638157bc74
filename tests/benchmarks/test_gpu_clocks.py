"""benchmarks/gpu_clocks.py: nvidia-smi samples parsed and summed up overall and per call."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.gpu_clocks import call_spans, main, parse_samples, summary

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 4, 20, 0, 0)


def _row(second: float, sm: int, util: int, reasons: str = "0x0000000000000000", power: float = 600.0) -> str:
    stamp = datetime.fromtimestamp(T0.timestamp() + second).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, 0, {sm}, 3201, {power:.2f}, 50, {util}, {reasons}"


def test_rows_parse_and_junk_is_skipped() -> None:
    rows = [_row(0.0, 1980, 99), "Field \"clocks_event_reasons.active\" is not a valid field", _row(0.2, 1500, 97, "0x4")]
    samples = parse_samples(rows + ["2026/12/04 20:00:01.000, 0, 19"])  # a cut last line
    assert [s.sm_mhz for s in samples] == [1980.0, 1500.0]
    assert samples[1].reasons == 0x4 and samples[1].time - samples[0].time == pytest.approx(0.2)


def test_summary_counts_busy_samples_and_their_reasons() -> None:
    samples = parse_samples([_row(0, 345, 0, "0x1"), _row(1, 1980, 99), _row(2, 1200, 98, "0x4", 700.0),
                             _row(3, 1000, 100, "0xc")])
    text = summary(samples)
    assert text.startswith("3/4 busy samples: SM 1200 MHz median, 1000 lowest")
    assert "700 W max" in text and "sw_power_cap 2/3" in text and "hw_slowdown 1/3" in text
    assert summary(samples[:1]) == "1 samples, none busy"


def test_per_call_spans_from_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run-001" / "grpo"
    run.mkdir(parents=True)
    t = T0.timestamp()
    records = [{"iteration": 1, "name": "ref_inf", "kind": "call", "rank": r, "start": t + 1.0 + r, "end": t + 2.5}
               for r in range(2)] + [{"iteration": 1, "name": "x", "kind": "realloc", "rank": 0, "start": t, "end": t}]
    (run / "timeline.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert call_spans(run / "timeline.jsonl") == [(1, "ref_inf", t + 1.0, t + 2.5)]
    csv = tmp_path / "gpu_clocks.csv"
    csv.write_text("\n".join([_row(0.5, 1980, 99), _row(1.5, 900, 99, "0x40"), _row(2.0, 1100, 99)]) + "\n")
    assert main([str(csv), str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU clocks, all: 3/3 busy samples" in out
    assert "ref_inf" in out and "2/2 busy samples: SM 1000 MHz median, 900 lowest" in out and "hw_thermal 1/2" in out
