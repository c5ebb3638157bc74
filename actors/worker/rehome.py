"""Moving a trained model's home to another placement: its weights and its optimizer state.

A re-plan (`app.run.replan`) can move a train call, and with it the placement where the model's
weights and ZeRO-1 optimizer state live between iterations. `move_trained_home` does that with
the reallocation executor: the weights move by the reallocation plan src -> dst as for any call,
then each of the optimizer's fp32 states (master weights, Adam m and v) is gathered over the
source's dp group into tensors shaped like the parameters (`ShardedAdamW.full_state`), moved by
the same plan and sliced into the destination's dp shards (`load_full_state`), one state at a
time so that at most one extra fp32 copy of the model exists. The step count and the optimizer
settings travel with them, so training continues exactly where it stopped: the destination's
weights, master weights and moments equal the source's, element for element.

Every rank of both meshes calls it, in the same order (it is collective over their union).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from actors.engine import OPTIMIZER_STATE_KEYS, ModelEngine
from actors.realloc import ReallocGroups, execute_reallocation, release_peer_mappings
from actors.worker.models import RoleState, bind_shards, shards_of, unbind_shards
from planning.plan import Placement
from planning.realloc_plan import ReallocPlan


def move_trained_home(rank: int, state: RoleState, src: Placement, dst: Placement, plan: ReallocPlan,
                      groups: ReallocGroups, union: ProcessGroup | None, device: torch.device,
                      engine_at: Callable[[Placement], ModelEngine]) -> dict[str, Any]:
    """Make `dst` the home of a trained role whose home is `src` (see the module docstring).

    union: the group of both meshes' ranks (None when they are one rank); engine_at(p): this
    rank's engine under placement p, built without weights on first use. Returns the stats of
    `ModelWorker.reallocate` (start, end, seconds, bytes), over the weights and the three states.
    """
    if not state.trainable or src == dst:
        raise ValueError(f"rehome: only a trained model's home moves, to another placement (src {src}, dst {dst})")
    start = time.time()
    in_src, in_dst = rank in src.mesh.gpus, rank in dst.mesh.gpus
    settings: list[Any] = [None]
    src_engine = state.engines.get(src) if in_src else None
    if rank == src.mesh.start:
        assert src_engine is not None
        settings = [(src_engine.optimizer.steps_done, state.optim)]
    if union is not None:
        dist.broadcast_object_list(settings, src=src.mesh.start, group=union)
    steps_done, optim = settings[0]
    if in_dst and state.copies.holds(dst) and dst != src:
        state.copies.after_call(dst, None)  # a stale copy from before the last training step
        unbind_shards(engine_at(dst).model)
    weights, moved = execute_reallocation(plan, rank, state.copies.shards(src) if in_src else {}, groups, device,
                                          state.dtype)
    sent, received = moved.total_sent, moved.total_received
    engine = None
    if in_dst:
        engine = engine_at(dst)
        bind_shards(engine.model, weights)
        engine.model.requires_grad_(True)
        engine.optim_config = optim
        engine.drop_optimizer()  # built afresh over the new tensors, then filled below
        engine.optimizer.steps_done = steps_done
    for key in OPTIMIZER_STATE_KEYS:
        full = src_engine.optimizer.full_state(key) if src_engine is not None else {}
        arrived, stats = execute_reallocation(plan, rank, full, groups, device, torch.float32)
        del full
        if engine is not None:
            engine.optimizer.load_full_state(key, arrived)
        sent, received = sent + stats.total_sent, received + stats.total_received
    if src_engine is not None and src != dst:
        src_engine.drop_optimizer()
        src_engine.model.requires_grad_(False)
    # Every rank of both meshes now calls dst home (ranks outside dst hold an empty copy of it).
    state.copies.load(dst, shards_of(engine.model) if engine is not None else {})
    release_peer_mappings()  # the source's parameters are released: no peer may keep them mapped
    end = time.time()
    return {"src": f"{src.mesh}/{src.layout}", "dst": f"{dst.mesh}/{dst.layout}", "start": start, "end": end,
            "seconds": end - start, "bytes_sent": sent, "bytes_received": received, "local_bytes": moved.local_bytes,
            "pulled": moved.pulled}


__all__ = ["move_trained_home"]
