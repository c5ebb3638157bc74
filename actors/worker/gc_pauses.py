"""Python's garbage collector on a worker: how long it paused each call.

A worker holds a great many long-lived Python objects once its first calls have run: the model's
modules, torch.compile's graphs, guards and generated code, Triton's kernels, Ray's own state. A
full (generation-2) collection walks every one of them while the process stands still (on this
project's CPU machine 0.5M objects take ~0.2 s), and CPython starts one whenever enough objects
have survived the younger generations, at moments no call chooses. `CollectorClock` sums the
collections' pauses through `gc.callbacks`; `actors.worker.calls.timed` reads it around each call,
so every call's metadata carries `gc_s` (seconds of collection during the call) and `gc_full`
(full collections) beside its wall time, and the timeline `timing_gc_s/<call>`.

Measured on an H200 (docs/benchmarks.md, issue 27 tenth step): 1-16 ms per call after warm-up in
a 0.5B GRPO run, up to 3.8 s during the first generation (its compiles). A gc.freeze() after
warm-up was tried against that and dropped: it bought nothing measurable.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GcReading:
    """Totals since the clock was installed: seconds paused, and full (generation-2) collections."""

    seconds: float
    full_collections: int

    def since(self, earlier: GcReading) -> GcReading:
        return GcReading(self.seconds - earlier.seconds, self.full_collections - earlier.full_collections)


class CollectorClock:
    """Sums the pauses of this process's garbage collections (any thread's) while installed."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._full = 0
        self._started: float | None = None

    def install(self) -> CollectorClock:
        if self._on_event not in gc.callbacks:
            gc.callbacks.append(self._on_event)
        return self

    def uninstall(self) -> None:
        if self._on_event in gc.callbacks:
            gc.callbacks.remove(self._on_event)

    def reading(self) -> GcReading:
        return GcReading(self._seconds, self._full)

    def _on_event(self, phase: str, info: dict[str, Any]) -> None:
        # gc calls back with phase "start" before and "stop" after each collection, in the thread
        # that triggered it, with the GIL held: no other Python code runs in between.
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
            if info.get("generation") == 2:
                self._full += 1


__all__ = ["CollectorClock", "GcReading"]
