"""Per-role bookkeeping of the model worker: where a role's shards live and how they bind to modules.

`RoleState` is one role's model on one worker: its shapes, whether it trains, its `ModelCopies`
(actors.realloc.offload) and one `ModelEngine` per placement it ever held. Engines outlive their
copies: dropping a copy replaces the module's parameters with empty tensors (`unbind_shards`)
and a later reallocation binds fresh tensors to the same modules (`bind_shards`, no copy).
Also: the process-group member sets of a placement, and the assembly of full HF tensors from
the shards every rank of a mesh contributes (for export).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from actors.engine import (
    AdamWConfig,
    ModelEngine,
    ParallelGroups,
    export_hf_checkpoint,
    gather_tp_shards,
    merge_stage_states,
)
from actors.realloc import ModelCopies
from planning.layout import Layout
from planning.models import ModelSpec
from planning.plan import Placement


def placement_group_sets(placement: Placement) -> list[tuple[int, ...]]:
    """Global-rank member sets of every group a placement's layout uses (mesh, tp, dp, pp,
    embedding), groups of one rank left out; the same sets cluster/collective.py lists."""
    layout, ranks = placement.layout, list(placement.mesh.gpus)
    sets = [ranks]
    sets += [[ranks[r] for r in layout.tp_group(d, p)] for p in range(layout.pp) for d in range(layout.dp)]
    sets += [[ranks[r] for r in layout.dp_group(t, p)] for p in range(layout.pp) for t in range(layout.tp)]
    for d in range(layout.dp):
        for t in range(layout.tp):
            column = [ranks[r] for r in layout.pp_group(d, t)]
            sets += [column, [column[0], column[-1]]] if layout.pp > 1 else [column]
    return [tuple(sorted(s)) for s in sets if len(s) > 1]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """"auto": cuda:0 when there is a GPU (Ray gives each worker one GPU through
    CUDA_VISIBLE_DEVICES, so it is always cuda:0), else the CPU."""
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A model's parameter dtype by name; None: bf16 on GPU, fp32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class RoleState:
    """One role's model on this worker (mutable bookkeeping of one process)."""

    spec: ModelSpec
    critic: bool
    trainable: bool
    dtype: torch.dtype
    optim: AdamWConfig | None
    copies: ModelCopies
    engines: dict[Placement, ModelEngine] = field(default_factory=dict)
    host_fraction: float = 0.0  # of the optimizer state in host memory (the plan's optimizer_offload)


def shards_of(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> this rank's parameter tensor (sharing storage with the module)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def bind_shards(model: nn.Module, shards: dict[str, Tensor]) -> None:
    """Make the module's parameters use `shards` (no copy)."""
    names = {name for name, _ in model.named_parameters()}
    if names != set(shards):
        raise ValueError(f"shards do not match the module: missing {sorted(names - set(shards))[:4]}, "
                         f"unexpected {sorted(set(shards) - names)[:4]}")
    for name, p in model.named_parameters():
        p.data = shards[name]


def unbind_shards(model: nn.Module) -> None:
    """Free the module's parameter memory (empty tensors until the next `bind_shards`)."""
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def home_of(state: RoleState) -> Placement | None:
    """The role's home placement on this rank, or None when this rank never held it."""
    try:
        return state.copies.home
    except ValueError:
        return None


def assemble_full_state(gathered: list[tuple[int, int, int, dict[str, Tensor]]], layout: Layout,
                        spec: ModelSpec) -> dict[str, Tensor]:
    """Full HF tensors from (dp_rank, tp_rank, pp_rank, shards) of every rank of a mesh (dp rank 0's
    shards are used): tp slices concatenated per stage, then the stages merged."""
    by_stage: list[dict[str, Tensor]] = []
    for pp_rank in range(layout.pp):
        shards = []
        for tp_rank in range(layout.tp):
            found = [s for d, t, p, s in gathered if (d, t, p) == (0, tp_rank, pp_rank)]
            if not found:
                raise ValueError(f"export: no shards from dp0 tp{tp_rank} pp{pp_rank} of {layout}")
            shards.append(found[0])
        by_stage.append(gather_tp_shards(shards, spec, layout.tp))
    return merge_stage_states(by_stage)


def export_role(state: RoleState, groups: ParallelGroups, rank: int, device: torch.device,
                out_dir: str | Path) -> Path | None:
    """Write a role as an HF checkpoint from its home copy (reloaded onto `device` if offloaded):
    every rank of the home mesh calls this (collective over the mesh, `groups` its home
    placement's); the mesh's first rank gathers the dp-rank-0 shards and writes the files,
    returning their directory (None on the other ranks)."""
    state.copies.reload(device)
    home = state.copies.home
    payload = (groups.dp_rank, groups.tp_rank, groups.pp_rank,
               {k: v.detach().cpu() for k, v in state.copies.shards(home).items()} if groups.dp_rank == 0 else {})
    first = home.mesh.start
    gathered: list[Any] = [payload]
    if groups.mesh_group is not None:
        gathered = [None] * home.mesh.size if rank == first else None
        dist.gather_object(payload, gathered, dst=first, group=groups.mesh_group)
    if rank != first:
        return None
    full = assemble_full_state(gathered, home.layout, state.spec)
    return export_hf_checkpoint(full, state.spec, state.critic, Path(out_dir))


__all__ = ["DTYPES", "RoleState", "assemble_full_state", "export_role", "bind_shards", "home_of", "placement_group_sets",
           "resolve_device", "resolve_dtype", "shards_of", "unbind_shards"]
