"""Checkpoint state of a trained model on one worker: save its shard, load it under any layout.

A trained role's state is its weights plus the optimizer's fp32 master weights and AdamW moments
and the step count. `save_role_state` writes it per (tp, pp) shard of the home layout, keyed by
HF parameter name like the weights: the dp ranks all-gather their ZeRO-1 slices
(`ShardedAdamW.per_parameter_state`) and dp rank 0 writes one safetensors file

    <dir>/tp<t>-pp<p>.safetensors   weight/<name> (model dtype), master/<name>, exp_avg/<name>,
                                    exp_avg_sq/<name> (fp32), metadata {steps_done, layout}

`load_role_state` fills the shard of any destination placement from those files with the
reallocation planner: `plan_reallocation(spec, critic, saved placement, new placement)` says
which piece of which parameter each destination rank needs from which source shard, and the
rank reads exactly those pieces (safetensors slices), for the weights and for each optimizer
kind alike. No rank ever holds more than its own shard, and the saved placement's GPUs need not
exist (another GPU count, another plan). Then the optimizer takes its [S] slices of the loaded
per-parameter state (`ShardedAdamW.load_per_parameter_state`).

`save_rng_state` / `load_rng_state`: this process's torch (and CUDA), Python and numpy random
generators, one file per global rank.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from actors.engine import ModelEngine, ShardedAdamW
from planning.models import ModelSpec
from planning.plan import Placement
from planning.realloc_plan import ShardSlice, plan_reallocation, rank_params, shard_slice

WEIGHT = "weight"
STATE_KINDS = (WEIGHT, *ShardedAdamW.STATE_KINDS)


def shard_file(directory: str | Path, tp_rank: int, pp_rank: int) -> Path:
    """The state file of the (tp_rank, pp_rank) shard."""
    return Path(directory) / f"tp{tp_rank}-pp{pp_rank}.safetensors"


def save_role_state(engine: ModelEngine, directory: str | Path) -> dict[str, Any]:
    """Write this shard's weights and optimizer state (dp rank 0 writes; collective over dp).

    Returns {"path": file or None, "steps_done", "bytes"}."""
    optimizer = engine.optimizer
    # Every dp rank takes part in the gather; host tensors (an offloaded part is not copied).
    per_param = optimizer.per_parameter_state(on_host=True)
    g = engine.groups
    if g.dp_rank != 0:
        return {"path": None, "steps_done": optimizer.steps_done, "bytes": 0}
    tensors: dict[str, Tensor] = {f"{WEIGHT}/{name}": p.detach().cpu().contiguous()
                                  for name, p in engine.model.named_parameters()}
    for kind, by_name in per_param.items():
        tensors.update({f"{kind}/{name}": t.cpu().contiguous() for name, t in by_name.items()})
    path = shard_file(directory, g.tp_rank, g.pp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    metadata = {"steps_done": str(optimizer.steps_done), "layout": str(g.layout)}
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)  # a reader never sees half a file under the final name
    return {"path": str(path), "steps_done": optimizer.steps_done,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def _region(piece: ShardSlice, holder: ShardSlice, ndim: int) -> tuple[slice, ...]:
    """Index of `piece` (full-parameter coordinates) inside the shard `holder` holds."""
    index = [slice(None)] * ndim
    if piece.dim is not None:
        offset = holder.start if holder.dim is not None else 0
        index[piece.dim] = slice(piece.start - offset, piece.stop - offset)
    return tuple(index)


def load_role_state(engine: ModelEngine, spec: ModelSpec, critic: bool, saved: Placement, placement: Placement,
                    rank: int, directory: str | Path) -> dict[str, Any]:
    """Fill this rank's shard under `placement` (weights, master, moments, step count) from the
    state `save_role_state` wrote under `saved`. Raises ValueError naming a missing file or
    tensor, or a shape that does not match (a checkpoint of another model)."""
    directory = Path(directory)
    plan = plan_reallocation(spec, critic, saved, placement)
    mine = {param.name: (param, piece) for param, piece in rank_params(spec, critic, placement,
                                                                       rank - placement.mesh.start)}
    params = dict(engine.model.named_parameters())
    if set(params) != set(mine):
        raise ValueError(f"load_role_state: the engine's parameters do not match the plan's shard "
                         f"(e.g. {sorted(set(params) ^ set(mine))[:3]})")
    out = {kind: {name: torch.empty(tuple(p.shape), dtype=p.dtype if kind == WEIGHT else torch.float32)
                  for name, p in params.items()} for kind in STATE_KINDS}
    covered = dict.fromkeys(params, 0)
    steps: set[int] = set()
    handles: dict[Path, Any] = {}
    try:
        for t in plan.transfers:
            if rank not in t.dst_gpus:
                continue
            param, my_piece = mine[t.param]
            _, tp_rank, pp_rank = saved.layout.coords(t.src_gpu - saved.mesh.start)
            path = shard_file(directory, tp_rank, pp_rank)
            if path not in handles:
                if not path.is_file():
                    raise ValueError(f"checkpoint state {directory}: no {path.name} (shard tp{tp_rank} pp{pp_rank} "
                                     f"of {saved.layout})")
                handles[path] = safe_open(str(path), framework="pt")
                steps.add(int(handles[path].metadata().get("steps_done", "0")))
            src = _region(t.piece, shard_slice(spec, param, saved.layout.tp, tp_rank), len(param.shape))
            dst = _region(t.piece, my_piece, len(param.shape))
            for kind in STATE_KINDS:
                key = f"{kind}/{t.param}"
                if key not in handles[path].keys():
                    raise ValueError(f"checkpoint state {path}: no tensor {key!r}")
                values = handles[path].get_slice(key)[src]
                target = out[kind][t.param][dst]
                if tuple(values.shape) != tuple(target.shape):
                    raise ValueError(f"checkpoint state {path}: {key} piece has shape {tuple(values.shape)}, "
                                     f"expected {tuple(target.shape)} (saved for another model?)")
                target.copy_(values)
            covered[t.param] += t.numel
    finally:
        handles.clear()
    short = [name for name, p in params.items() if covered[name] != p.numel()]
    if short:
        raise ValueError(f"checkpoint state {directory}: pieces of {short[:3]} missing for rank {rank}")
    if len(steps) != 1:
        raise ValueError(f"checkpoint state {directory}: shards disagree on the optimizer step count {sorted(steps)}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(out[WEIGHT][name])
    engine.optimizer.load_per_parameter_state({k: out[k] for k in ShardedAdamW.STATE_KINDS}, steps.pop())
    return {"steps_done": engine.optimizer.steps_done, "params": len(params)}


def rng_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rng-rank{rank}.pkl"


def save_rng_state(directory: str | Path, rank: int) -> str:
    """Write this process's random generator states (torch, CUDA, Python, numpy)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    path = rng_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(state))
    return str(path)


def load_rng_state(directory: str | Path, rank: int) -> bool:
    """Restore the states `save_rng_state` wrote for this rank; False when there is no file (a
    checkpoint of a smaller cluster): the generators are then left as they are."""
    path = rng_file(directory, rank)
    if not path.is_file():
        return False
    state = pickle.loads(path.read_bytes())
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


__all__ = [
    "STATE_KINDS", "WEIGHT", "load_rng_state", "load_role_state", "rng_file", "save_rng_state", "save_role_state",
    "shard_file",
]
