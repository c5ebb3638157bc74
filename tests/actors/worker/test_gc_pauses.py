"""The garbage collector's pauses as a worker's clock counts them (actors.worker.gc_pauses)."""

from __future__ import annotations

import gc

import pytest

from actors.worker.gc_pauses import CollectorClock, GcReading

pytestmark = pytest.mark.unit


def _cycles(n: int) -> None:
    """n reference cycles that only the collector can free."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_the_clock_counts_full_collections_and_their_time() -> None:
    clock = CollectorClock().install()
    try:
        before = clock.reading()
        _cycles(1000)
        gc.collect()
        gc.collect(0)
        during = clock.reading().since(before)
    finally:
        clock.uninstall()
    assert during.full_collections == 1  # gc.collect(0) is a young collection
    assert during.seconds > 0.0
    gc.collect()  # uninstalled: no longer counted
    assert clock.reading().since(before) == during
    assert clock.install().install() is clock and gc.callbacks.count(clock._on_event) == 1
    clock.uninstall()
    assert clock._on_event not in gc.callbacks


def test_reading_since_subtracts() -> None:
    assert GcReading(1.5, 3).since(GcReading(0.5, 1)) == GcReading(1.0, 2)
