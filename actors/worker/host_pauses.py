"""What stopped a worker's host inside a call: Python's garbage collector, and torch.compile.

A call whose GPU waits on its host (a small model's forward: the 0.5B fidelity run's inference
calls kept the GPU busy in under half of their samples) is as fast as the host's Python. Two
things can stall that host for whole seconds at moments no call chooses:

* a full (generation-2) garbage collection, which walks every long-lived object while the
  process stands still: after warm-up a worker holds a great many (the model's modules,
  torch.compile's graphs, guards and generated code, Triton's kernels, Ray's state; 0.5M objects
  take ~0.2 s on this project's CPU machine);
* a compile by torch.compile (actors.engine.fusion, sampling.compile): seconds each, expected in
  a call's first run, a bug in any later one (a guard that fails on every new token count).

`HostPauseClock` counts both: collections through `gc.callbacks`, compiles from dynamo's counters
(`torch._dynamo.utils.counters["stats"]["unique_graphs"]`, which fullgraph compiles bump too where
`frames.ok` stays 0, and the `_compile.compile_inner` durations; both private, so a torch without
them reads as no compiles). `actors.worker.calls.timed` reads it around each call: its metadata
carries `HOST_PAUSE_KEYS` (`gc_s`, `gc_full`, `compiles`, `compile_s`) and `gc_before_s`, the
collections in the worker between the end of its previous call and the start of this one (a gap
between calls that no call's own time shows), and the timeline `timing_gc_s/<call>`,
`timing_gc_before_s/<call>` and `timing_compile_s/<call>`.

Measured on an H200 (docs/benchmarks.md, issue 27 tenth step): garbage collection took 1-16 ms
per call after warm-up in a 0.5B GRPO run, seconds only while the first generation compiled. A
gc.freeze() after warm-up was tried and dropped: it bought nothing measurable inside the calls.

What a compile leaves behind does cost later, at a moment no call chooses: CPython runs a full
collection once the objects promoted to the oldest generation since the last full one exceed a
quarter of those it holds, and the first generation's compile promotes a great many. On
H100s that full collection (~0.7 s) fell into the first timed step of 2 of 5 peer-bench rows
(docs/benchmarks.md, issue 27 twenty-eighth step). `collect_after_compile` runs one right after a
call whose compile was large enough to set off full collections of its own, in the warm-up it
belongs to (0.47-0.67 s there on H100s, twenty-ninth step); that resets the count, and the
smaller compiles after it (the training call's: 0.02-0.10 s of collection in its warm-up, so no
full one) stayed below the next quarter: no timed call collected for over 12 ms. A call that
compiled without a full collection is left alone: another full collection would walk every
object again (an estimated ~0.3 s) in the gap before the next call, which may be a timed step's.
No gc.freeze() (which would make repeated collections cheap): frozen objects that later form
unreachable cycles (a released copy's tensors) would never be freed.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class HostPauses:
    """Totals since the clock was installed (or their difference over a call)."""

    gc_s: float  # seconds the garbage collector ran
    gc_full: int  # of which full (generation-2) collections
    compiles: int  # graphs torch.compile compiled (recompiles included)
    compile_s: float  # seconds it spent compiling them

    def since(self, earlier: HostPauses) -> HostPauses:
        return HostPauses(self.gc_s - earlier.gc_s, self.gc_full - earlier.gc_full,
                          self.compiles - earlier.compiles, self.compile_s - earlier.compile_s)


# The metadata keys of a call's pauses (None where the call was not clocked).
HOST_PAUSE_KEYS = tuple(f.name for f in fields(HostPauses))


def compile_totals() -> tuple[int, float]:
    """(graphs compiled, seconds compiling) by torch.compile in this process so far; (0, 0.0)
    when dynamo was never imported (nothing compiled) or its private counters are gone."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0, 0.0
    utils = sys.modules["torch._dynamo.utils"]
    try:
        graphs = int(utils.counters["stats"]["unique_graphs"])
        seconds = float(sum(utils.compilation_time_metrics.get("_compile.compile_inner", ())))
    except (AttributeError, KeyError, TypeError):
        return 0, 0.0
    return graphs, seconds


class HostPauseClock:
    """Sums this process's garbage collections (any thread's) while installed, and reads
    torch.compile's totals."""

    def __init__(self) -> None:
        self._gc_s = 0.0
        self._gc_full = 0
        self._started: float | None = None
        self._last_call_end: HostPauses | None = None  # the reading when the latest call ended

    def install(self) -> HostPauseClock:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def reading(self) -> HostPauses:
        compiles, compile_s = compile_totals()
        return HostPauses(self._gc_s, self._gc_full, compiles, compile_s)

    def call_started(self) -> tuple[HostPauses, float | None]:
        """(the reading now, seconds of garbage collection since the latest call ended: None
        before the first call). Calls that overlap (a host op beside a GPU call) share the clock:
        the latest end is the one that counts."""
        now = self.reading()
        before = None if self._last_call_end is None else now.gc_s - self._last_call_end.gc_s
        return now, before

    def call_ended(self, started: HostPauses) -> HostPauses:
        """The pauses since `started` (call_started's reading); marks this moment as the latest
        call's end."""
        self._last_call_end = self.reading()
        return self._last_call_end.since(started)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # gc calls back with phase "start" before and "stop" after each collection, in the thread
        # that triggered it, with the GIL held: no other Python code runs in between.
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is not None:
            self._gc_s += time.perf_counter() - self._started
            self._started = None
            if info.get("generation") == 2:
                self._gc_full += 1


def collect_after_compile(compiles: int | None, full_collections: int | None) -> bool:
    """A full collection now when the call that just ended compiled graphs (`compiles` > 0) and ran
    full collections while doing so (`full_collections` > 0; both its `HostPauses` fields, None
    where it was not clocked): the garbage and the count of that compile are then settled before
    the next call instead of inside some later one. Returns whether it collected."""
    if not compiles or not full_collections:
        return False
    gc.collect()
    return True


__all__ = ["HOST_PAUSE_KEYS", "HostPauseClock", "HostPauses", "collect_after_compile", "compile_totals"]
