"""What stalled a worker's host: garbage collections and torch.compile's compiles, as the pause
clock counts them (actors.worker.host_pauses)."""

from __future__ import annotations

import gc

import pytest
import torch

from actors.worker.host_pauses import HostPauseClock, HostPauses, collect_after_compile, compile_totals

pytestmark = pytest.mark.unit


def _cycles(n: int) -> None:
    """n reference cycles that only the collector can free."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_the_clock_counts_full_collections_and_their_time() -> None:
    clock = HostPauseClock().install()
    try:
        before = clock.reading()
        _cycles(1000)
        gc.collect()
        gc.collect(0)
        during = clock.reading().since(before)
    finally:
        clock.uninstall()
    assert during.gc_full == 1  # gc.collect(0) is a young collection
    assert during.gc_s > 0.0 and during.compiles == 0
    gc.collect()  # uninstalled: no longer counted
    assert clock.reading().since(before).gc_full == 1
    assert clock.install().install() is clock and gc.callbacks.count(clock._on_gc) == 1
    clock.uninstall()
    assert clock._on_gc not in gc.callbacks


def test_the_clock_counts_collections_between_calls() -> None:
    clock = HostPauseClock().install()
    try:
        started, before = clock.call_started()
        assert before is None  # no call has ended yet
        during = clock.call_ended(started)
        assert during.gc_full == 0 and during.gc_s >= 0.0
        _cycles(1000)
        gc.collect()  # between the two calls
        started, before = clock.call_started()
        gc.collect()  # inside the second call: not in its gc_before_s
        inside = clock.call_ended(started)
        _, after_second = clock.call_started()  # right after the second call ended
    finally:
        clock.uninstall()
    assert before is not None and before > 0.0
    assert inside.gc_full == 1 and inside.gc_s > 0.0
    assert after_second is not None and after_second < inside.gc_s  # counted from the latest end


def test_the_clock_counts_compiles_and_recompiles() -> None:
    clock = HostPauseClock()

    def double_sin(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    def triple_cos(x: torch.Tensor) -> torch.Tensor:  # its own code: dynamo caches per code object
        return x.cos() * 3

    # fullgraph (as actors.engine.fusion compiles) counts too
    for fn, fullgraph in ((double_sin, False), (triple_cos, True)):
        compiled = torch.compile(fn, dynamic=False, fullgraph=fullgraph)
        before = clock.reading()
        compiled(torch.randn(8))
        compiled(torch.randn(8))  # the same shape: the compiled code is reused
        first = clock.reading().since(before)
        compiled(torch.randn(9))  # a new static shape: compiled again
        second = clock.reading().since(before)
        assert first.compiles == 1 and first.compile_s > 0.0
        assert second.compiles == 2 and second.compile_s > first.compile_s
    assert compile_totals()[0] >= 4


def test_since_subtracts_every_total() -> None:
    assert HostPauses(1.5, 3, 4, 2.0).since(HostPauses(0.5, 1, 1, 0.5)) == HostPauses(1.0, 2, 3, 1.5)


def test_a_compile_that_ran_full_collections_is_followed_by_one() -> None:
    clock = HostPauseClock().install()
    try:
        before = clock.reading()
        # not clocked, nothing compiled, a compile without a full collection of its own
        collected = [collect_after_compile(c, f) for c, f in ((None, None), (0, 2), (3, 0))]
        quiet = clock.reading().since(before)
        _cycles(1000)
        assert collect_after_compile(3, 1)
        after = clock.reading().since(before)
    finally:
        clock.uninstall()
    assert collected == [False, False, False] and quiet.gc_full == 0
    assert after.gc_full == 1 and after.gc_s > 0.0
    assert gc.isenabled() and gc.get_freeze_count() == 0  # a collection, no freeze
