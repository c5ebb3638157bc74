"""Run a function on N spawned gloo processes and collect what each returns (dist-tier tests).

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on 4 ranks

`fn` must be importable by module and name (a top-level function of a test module or package),
and its return value picklable. Every process joins a localhost gloo world on a free port with
one torch thread before `fn` runs (backend="nccl": an NCCL world, rank r on cuda:r), and leaves
it afterwards; with one_gpu_each=True rank r sees only GPU r, as cuda:0, the way Ray
starts a GPU actor (CUDA_VISIBLE_DEVICES set to its one GPU). If any rank raises, the others
are terminated (they may be stuck in a collective) and a RuntimeError carries every rank's
traceback.
Spawn once per world size and loop over cases inside `fn`: starting a process costs seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from actors.engine.process_groups import free_port, init_local_world


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, args: tuple[Any, ...],
            results: Any, gpu: int | None) -> None:
    import torch.distributed as dist

    try:
        init_local_world(rank, world_size, port, backend, gpu=gpu)
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    # Flush the queue's feeder thread now: tearing the world down after a failure can hang or
    # crash the process (a peer is stuck in a collective), and the report must not be lost.
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def _missing_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "no result in time (hung, or stuck in a collective after another rank failed)"
    return f"process exited with code {exitcode} without a result (crashed?)"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
                    backend: str = "gloo", one_gpu_each: bool = False) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` processes; return values by rank.

    backend "nccl" gives rank r the GPU cuda:r (gpu-tier tests); one_gpu_each=True makes GPU r
    the only one rank r sees (cuda:0 there)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    if one_gpu_each and backend != "nccl":
        raise ValueError(f"one_gpu_each=True needs backend='nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    gpu = 0 if one_gpu_each else None
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, args, results, gpu), daemon=True)
             for r in range(world_size)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for r, proc in enumerate(procs):
            if one_gpu_each:  # a spawned child starts with the parent's environment as it is now
                os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[r] if visible else str(r)
            proc.start()
    finally:
        if one_gpu_each:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
                (values if ok else errors)[rank] = payload
                if errors:  # the others may be stuck in a collective with the failed rank
                    deadline = min(deadline, time.monotonic() + 10.0)
                continue
            except queue.Empty:
                pass
            missing = [r for r in range(world_size) if r not in values and r not in errors]
            if any(procs[r].exitcode is not None for r in missing):
                # An exited process's result may still be in the pipe: give it a few seconds.
                deadline = min(deadline, time.monotonic() + 5.0)
            if time.monotonic() > deadline:
                errors.update({r: _missing_reason(procs[r].exitcode) for r in missing})
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [values[r] for r in range(world_size)]
