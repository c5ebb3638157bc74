"""What a worker is doing right now, read from its threads' stacks (for the driver's stall report).

The Ray actor runs the worker's methods on one thread and answers `ModelWorker.progress` on a
second one (a separate concurrency group, see cluster.placement), so a worker stuck in a call
can still say where: `activity(worker)` walks the stacks of the other threads, finds the one
running a method of that worker object and reports the method, the innermost frame of our code
(not torch's or Ray's) and whether the thread waits inside torch.distributed. Among the ranks of a stalled call,
those waiting in a collective are blocked by a peer; a rank that is not is the one that stopped.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

LIBRARY_MARKERS = ("site-packages", "dist-packages", f"{Path(sys.prefix).name}/lib/python", "/lib/python3")
COLLECTIVE_MARKER = f"torch{'/'}distributed"


def _stack(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _is_library(filename: str) -> bool:
    return any(marker in filename for marker in LIBRARY_MARKERS)


def _describe(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


def activity(worker: object) -> dict[str, Any]:
    """{"busy": False} when no thread runs a method of `worker`; else {"busy": True, "method",
    "where" (innermost frame of our code), "innermost" (innermost frame at all),
    "in_collective" (the thread waits inside torch.distributed)}."""
    me = threading.get_ident()
    for ident, top in sys._current_frames().items():
        if ident == me:
            continue
        frames = _stack(top)
        methods = [f for f in frames if f.f_locals.get("self") is worker]
        if not methods:
            continue
        # Ray's own wrappers take the actor as `self` too: name the outermost method of ours.
        methods = [f for f in methods if not _is_library(f.f_code.co_filename)] or methods
        ours = next((f for f in frames if not _is_library(f.f_code.co_filename)), frames[0])
        in_collective = any(COLLECTIVE_MARKER in f.f_code.co_filename for f in frames)
        return {"busy": True, "method": methods[-1].f_code.co_name, "where": _describe(ours),
                "innermost": _describe(frames[0]), "in_collective": in_collective}
    return {"busy": False}


__all__ = ["activity"]
