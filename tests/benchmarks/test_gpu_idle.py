"""benchmarks/gpu_idle.py on hand-made intervals: busy time is the union of overlapping kernels,
gaps fall into their size bins, and host events are charged only for the time they overlap a gap."""

from __future__ import annotations

import pytest

from benchmarks.gpu_idle import busy_intervals, format_report, idle_report

pytestmark = pytest.mark.unit


def test_busy_intervals_merge_overlapping_and_touching_kernels() -> None:
    kernels = [(50.0, 60.0), (0.0, 10.0), (5.0, 20.0), (20.0, 30.0)]
    assert busy_intervals(kernels) == [(0.0, 30.0), (50.0, 60.0)]


def test_gaps_are_binned_and_host_time_counts_only_inside_gaps() -> None:
    # busy [0, 100), [105, 200), [700, 800), [2800, 3000): gaps of 5, 500 and 2000 us.
    kernels = [(0.0, 100.0), (105.0, 200.0), (700.0, 800.0), (2800.0, 3000.0)]
    host = [("cudaStreamSynchronize", 150.0, 650.0),  # 450 us of it inside the 500 us gap
            ("aten::copy_", 900.0, 2900.0),  # 1900 us inside the 2000 us gap
            ("aten::mm", 0.0, 90.0)]  # while the GPU is busy: not charged
    report = idle_report(kernels, host)
    assert report.busy_us == pytest.approx(100 + 95 + 100 + 200)
    assert report.span_us == pytest.approx(3000.0)
    counts = {label: (n, us) for label, n, us in report.gaps_us}
    assert counts == {"< 10 us": (1, 5.0), "10 us-100 us": (0, 0.0), "100 us-1 ms": (1, 500.0), ">= 1 ms": (1, 2000.0)}
    assert report.host_during_gaps == (("aten::copy_", 1900.0), ("cudaStreamSynchronize", 450.0))
    idle = report.span_us - report.busy_us
    assert idle == pytest.approx(sum(us for _, _, us in report.gaps_us))
    text = format_report(report, "step")
    assert "idle 2.5 ms" in text and "aten::copy_ 1.9 ms" in text


def test_no_kernels_gives_an_empty_report() -> None:
    report = idle_report([], [("aten::mm", 0.0, 1.0)])
    assert report.busy_us == 0.0 and report.gaps_us == () and report.host_during_gaps == ()
