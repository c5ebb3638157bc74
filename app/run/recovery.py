"""Recovering from a dead or stalled worker, and what the driver says when it cannot.

Failures of an operation reach the driver as Ray errors. `is_recoverable` sorts them:
  recoverable  the worker process died (RayActorError, lost objects), a collective broke or
               timed out because a peer died or hung (torch.distributed errors), or the call
               stalled (no progress for run.call_timeout_s): restarting the workers and resuming
               from the last complete checkpoint gets the run past it;
  fatal        an exception raised by our code or the user's (a bad reward function, a
               non-finite loss, a shape error): it would fail again, so the run ends.
The driver then restarts up to run.max_restarts times (`log_restart` prints one line and
appends it to `<run_dir>/restarts.jsonl`), and past that ends with `DriverError` naming the
operation, the iteration, the worker and the cause, on one line.

A stall is reported with the rank that stopped making progress (`stall_message`): every worker
of the stuck operation is asked, on its monitor thread, what its call thread is doing
(actors.worker.progress); ranks waiting inside a collective are blocked by a peer, the rank
that is not (or does not answer) is the one that stopped.

`guard_params` are the params every call gets for the worker-side guards
(actors.worker.guards): the non-finite policy and the reward function's time limit.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from app.config import ExperimentConfig

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Messages of torch.distributed backends when a peer went away or a collective timed out.
COMM_FAILURE = re.compile(r"connection (closed|reset)|broken pipe|timed out|timeout|nccl|gloo|socket|"
                          r"peer|store|watchdog", re.IGNORECASE)
MAX_MESSAGE = 1000


class DriverError(RuntimeError):
    """An operation failed or stalled; the message names it, its iteration and the worker(s)."""


class WorkerFailure(DriverError):
    """A failure of one operation on one worker; `recoverable` says whether a restart helps."""

    def __init__(self, message: str, op: str, worker: str, recoverable: bool) -> None:
        super().__init__(message)
        self.op, self.worker, self.recoverable = op, worker, recoverable


def one_line(text: str) -> str:
    """ANSI colour codes removed, whitespace collapsed, cut to MAX_MESSAGE characters."""
    flat = " ".join(ANSI.sub("", text).split())
    return flat if len(flat) <= MAX_MESSAGE else flat[:MAX_MESSAGE - 3] + "..."


def cause_of(error: BaseException) -> BaseException:
    """The worker's original exception inside a Ray task error (else the error itself)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def describe_error(error: BaseException) -> str:
    """`Type: message` of the original exception, on one line, without Ray's traceback."""
    cause = cause_of(error)
    if cause is error and type(error).__module__.startswith("ray"):
        # A Ray system error (a dead actor): its first line says what happened.
        first = next((line for line in ANSI.sub("", str(error)).splitlines() if line.strip()), "")
        return one_line(f"{type(error).__name__}: {first}")
    return one_line(f"{type(cause).__name__}: {cause}")


def is_recoverable(error: BaseException) -> bool:
    """Whether a restart of the workers can get past `error` (see the module docstring)."""
    from ray.exceptions import (
        GetTimeoutError,
        NodeDiedError,
        ObjectLostError,
        OwnerDiedError,
        RayActorError,
        RayTaskError,
        WorkerCrashedError,
    )
    from torch.distributed import DistError

    if isinstance(error, (RayActorError, ObjectLostError, OwnerDiedError, WorkerCrashedError, NodeDiedError,
                          GetTimeoutError)):
        return True
    if isinstance(error, RayTaskError):
        cause = cause_of(error)
        if isinstance(cause, DistError):
            return True
        # gloo/NCCL report a dead peer or a timed-out collective as a RuntimeError.
        return type(cause) is RuntimeError and bool(COMM_FAILURE.search(str(cause)))
    return False


def guard_params(cfg: ExperimentConfig) -> dict[str, Any]:
    """Params every call gets for actors.worker.guards."""
    return {"on_nonfinite": cfg.run.on_nonfinite, "reward_timeout_s": cfg.reward.timeout_s}


def stall_message(what: str, timeout_s: float, probes: dict[str, dict[str, Any] | None]) -> tuple[str, list[str]]:
    """(message, workers that stopped) for an operation that made no progress for timeout_s.

    probes: per worker name, its `ModelWorker.progress()` answer, or None when it gave none."""
    stopped = [name for name, p in probes.items() if p is None or (p.get("busy") and not p.get("in_collective"))]
    waiting = [name for name, p in probes.items() if p is not None and p.get("busy") and p.get("in_collective")]
    if not stopped:  # everyone waits in a collective (or nobody is busy): name them all
        stopped = list(probes)
    parts = []
    for name in stopped:
        p = probes[name]
        if p is None:
            parts.append(f"{name} does not answer")
        elif p.get("busy"):
            where = "in a collective" if p.get("in_collective") else "not in a collective"
            parts.append(f"{name} stopped in {p.get('method')} at {p.get('where')} ({where})")
        else:
            parts.append(f"{name} is idle (its call never started)")
    message = f"{what} made no progress for {timeout_s:g} s (run.call_timeout_s): {'; '.join(parts)}"
    if waiting and set(waiting) != set(stopped):
        message += f"; {', '.join(waiting)} wait(s) in a collective for it"
    return one_line(message), stopped


def probe_workers(workers: Any, ranks: list[int], timeout_s: float = 5.0) -> dict[str, dict[str, Any] | None]:
    """Per worker name, its `progress()` answer from its monitor thread, or None when it gives
    none within timeout_s (dead, or a worker class without the method)."""
    import ray

    from cluster.placement import MONITOR_GROUP

    refs = {}
    for rank in ranks:
        try:
            refs[rank] = workers.actor(rank).progress.options(concurrency_group=MONITOR_GROUP).remote()
        except (AttributeError, ValueError):
            refs[rank] = None
    deadline = time.monotonic() + timeout_s
    out: dict[str, dict[str, Any] | None] = {}
    for rank, ref in refs.items():
        answer = None
        if ref is not None:
            try:
                answer = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # a dead or unresponsive worker: reported as not answering
                answer = None
        out[workers.slots[rank].name] = answer if isinstance(answer, dict) else None
    return out


def log_restart(run_dir: Path, attempt: int, limit: int, failure: WorkerFailure, checkpoint: Path | None) -> str:
    """Print one line about a restart and append it to `<run_dir>/restarts.jsonl`."""
    source = f"checkpoint {checkpoint.name}" if checkpoint is not None else "iteration 0 (no complete checkpoint)"
    line = one_line(f"restart {attempt}/{limit} (run.max_restarts): {failure}; resuming from {source}")
    print(f"warning: {line}", file=sys.stderr, flush=True)
    record = {"restart": attempt, "time": time.time(), "op": failure.op, "worker": failure.worker,
              "error": str(failure), "checkpoint": None if checkpoint is None else str(checkpoint)}
    with (run_dir / "restarts.jsonl").open("a", encoding="utf-8") as sink:
        sink.write(json.dumps(record) + "\n")
    return line


__all__ = [
    "DriverError", "WorkerFailure", "cause_of", "describe_error", "guard_params", "is_recoverable", "log_restart",
    "one_line", "probe_workers", "stall_message",
]
