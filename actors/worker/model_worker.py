"""ModelWorker: the one process per GPU that holds every model shard placed on that GPU.

A plain class (cluster/placement.py applies `ray.remote`; tests drive it in-process). The driver
calls the same methods in the same global order on every worker of a call's mesh:

    w = ModelWorker(rank, world_size)            # global rank = global GPU index
    w.init_distributed(addr, port, "nccl", 300)  # or an already initialised world (tests)
    w.ensure_groups(sets)                        # ALL ranks, same list: every group the plan uses
    w.load_model("actor", spec, False, home, None, seed, True, {"lr": 1e-5})   # home mesh ranks
    w.reallocate("actor", home, gen_placement)   # ranks of both meshes
    meta, data = w.run_call(CallSpec(...), *producer_shards)   # ranks of the call's mesh
    w.release("actor", gen_placement); w.export("actor", out_dir)
    w.rehome("actor", home, new_home)            # a re-plan moved the train call: ranks of both meshes

Per role the worker keeps a `ModelCopies` (actors.realloc.offload: which placements have a copy on
this GPU, the home copy, offloaded host copies) and one `ModelEngine` per placement it ever
held (modules and groups are kept; a dropped copy's parameters are replaced by empty tensors so
its memory is freed, and a later reallocation binds fresh tensors to the same modules).

`load_model` runs on the home mesh's ranks (others may call it too: they only record the shapes).
A rank that receives a copy by reallocation without having loaded the model learns its shapes
from the source inside `reallocate`, over the group of both meshes' ranks (which the plan's
group listing includes).

Process groups: one registry (`actors.realloc.ReallocGroups`, keyed by sorted member ranks)
holds every group the plan needs; `ensure_groups` creates missing ones (collective over the
world, in sorted order), and each placement's `ParallelGroups` is looked up from it.
"""

from __future__ import annotations

import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from actors.engine import (
    ModelEngine,
    ParallelGroups,
    adamw_config_from,
    load_hf_checkpoint,
    lookup_parallel_groups,
    node_address,
)
from actors.realloc import ModelCopies, ReallocGroups, execute_reallocation, release_peer_mappings
from actors.worker.calls import CallContext, CallSpec, timed
from actors.worker.host_pauses import HostPauseClock
from actors.worker.memory import MemoryProbe, memory_probe_for
from actors.worker.models import (
    RoleState,
    bind_shards,
    export_role,
    home_of,
    resolve_device,
    resolve_dtype,
    shards_of,
    unbind_shards,
)
from actors.worker.ops import CALL_OPS, MODEL_FREE_OPS
from actors.worker.progress import activity
from actors.worker.rehome import move_trained_home
from actors.worker.state import load_rng_state, load_role_state, save_rng_state, save_role_state
from planning.models import ModelSpec
from planning.plan import Placement
from planning.realloc_plan import ReallocPlan, plan_reallocation


class ModelWorker:
    """See the module docstring. Every public method returns small picklable values."""

    def __init__(self, rank: int, world_size: int, device: str = "auto") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"ModelWorker rank={rank}: must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(device)
        # Peak memory (a subclass may install another probe) and host pauses (gc, compiles) of each call.
        self.memory_probe: MemoryProbe = memory_probe_for(self.device)
        self.host_pauses = HostPauseClock().install()
        weakref.finalize(self, self.host_pauses.uninstall)  # gc.callbacks is process-wide: no leftovers
        self._groups = ReallocGroups()
        self._timeout: timedelta | None = None  # the world's collective timeout, for every group
        self._roles: dict[str, RoleState] = {}
        self._parallel: dict[Placement, ParallelGroups] = {}
        # Reallocation plans by (spec, critic, src, dst): a plan is a pure function of these, and the
        # same pairs recur every iteration (the executor also caches its compiled program per plan).
        self._realloc_plans: dict[tuple[ModelSpec, bool, Placement, Placement], ReallocPlan] = {}

    # ---- distributed setup ---------------------------------------------------------------------
    def ping(self) -> int:
        return self.rank

    def address(self) -> tuple[str, int]:
        """This node's IP (the interface used for outbound traffic) and a free TCP port."""
        return node_address()

    def init_distributed(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> None:
        """Join the world of all workers; collectives slower than timeout_s raise."""
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: allowed: nccl, gloo")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        host = f"[{master_addr}]" if ":" in master_addr else master_addr
        self._timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{master_port}", rank=self.rank,
                                world_size=self.world_size, timeout=self._timeout, **kwargs)
        # Point-to-point reallocation uses the world group: its communicator must exist everywhere.
        dist.barrier()

    def ensure_groups(self, member_sets: list[tuple[int, ...]]) -> None:
        """Create every missing group (collective over the world: all ranks, the same list)."""
        sets = [tuple(sorted({int(r) for r in s})) for s in member_sets]
        self._groups.ensure([s for s in sets if len(s) > 1], timeout=self._timeout)

    def _lookup(self, members: list[int]) -> ProcessGroup | None:
        key = tuple(sorted(set(members)))
        if len(key) < 2 or self.rank not in key:
            return None
        if key not in self._groups:
            raise KeyError(f"rank {self.rank}: process group {list(key)} was never created; pass it to ensure_groups "
                           "(see actors.worker.placement_group_sets) on every rank first")
        return self._groups.get(key)

    def parallel_groups(self, placement: Placement) -> ParallelGroups:
        """This rank's groups under `placement` (it must be in the placement's mesh)."""
        if placement in self._parallel:
            return self._parallel[placement]
        mesh, layout = placement.mesh, placement.layout
        if self.rank not in mesh.gpus:
            raise ValueError(f"rank {self.rank} is not in mesh {mesh} ({layout})")
        groups = lookup_parallel_groups(layout, list(mesh.gpus), self.rank, self._lookup)
        self._parallel[placement] = groups
        return groups

    # ---- models ----------------------------------------------------------------------------------
    def load_model(self, role: str, spec: ModelSpec, critic: bool, placement: Placement, hf_dir: str | None,
                   seed: int, trainable: bool, optim: dict[str, Any], dtype: str | None = None,
                   host_fraction: float = 0.0) -> dict[str, Any]:
        """Build `role` on `placement` (random init from `seed`, or the HF checkpoint `hf_dir`).

        Called on the ranks of the placement's mesh; other ranks may call it too and then only
        record the model's shapes (reallocation also shares them, see `_share_role`).
        optim: AdamWConfig fields (lr, betas, weight_decay, max_grad_norm, warmup_steps, ...).
        host_fraction: of the optimizer state kept in host memory (the plan's optimizer_offload).
        """
        start = time.perf_counter()
        torch_dtype = resolve_dtype(dtype, self.device)
        config = adamw_config_from(role, optim) if trainable else None
        state = RoleState(spec, critic, trainable, torch_dtype, config, ModelCopies(role, trainable, offload_idle=False),
                          host_fraction=host_fraction if trainable else 0.0)
        self._roles[role] = state
        if self.rank not in placement.mesh.gpus:
            return {"role": role, "rank": self.rank, "held": False}
        groups = self.parallel_groups(placement)
        # The optimizer is built on first use, its master copy from the weights as they are then.
        engine = ModelEngine(spec, critic, groups, self.device, torch_dtype, seed=seed if hf_dir is None else None,
                             optim_config=config, optimizer_host_fraction=state.host_fraction)
        if hf_dir is not None:
            load_hf_checkpoint(hf_dir, spec, critic, engine.model, groups.tp_rank, groups.layout.tp)
        if not trainable:
            engine.model.requires_grad_(False)
        state.engines[placement] = engine
        state.copies.load(placement, shards_of(engine.model))
        n_local = sum(p.numel() for p in engine.model.parameters())
        return {"role": role, "rank": self.rank, "held": True, "placement": f"{placement.mesh}/{placement.layout}",
                "local_params": n_local, "seconds": time.perf_counter() - start}

    def _role(self, role: str) -> RoleState:
        if role not in self._roles:
            raise ValueError(f"rank {self.rank}: model {role!r} was never loaded here (loaded: {sorted(self._roles)}); "
                             "load it on its home mesh first")
        return self._roles[role]

    def _engine(self, state: RoleState, placement: Placement) -> ModelEngine:
        """The engine of `placement` on this rank, built (without weights) on first use."""
        if placement not in state.engines:
            groups = self.parallel_groups(placement)
            engine = ModelEngine(state.spec, state.critic, groups, self.device, state.dtype, seed=None,
                                 optimizer_host_fraction=state.host_fraction)
            if not state.trainable or placement != home_of(state):
                engine.model.requires_grad_(False)
            state.engines[placement] = engine
        return state.engines[placement]

    def _sync_engines(self, state: RoleState) -> None:
        """Free the parameters of every engine whose copy is no longer held."""
        for placement, engine in state.engines.items():
            if not state.copies.holds(placement):
                unbind_shards(engine.model)

    # ---- reallocation, release, offload ---------------------------------------------------------
    def reallocate(self, role: str, src: Placement, dst: Placement) -> dict[str, Any]:
        """Move `role` from its copy under `src` to `dst`; every rank of both meshes calls it.

        A stale copy under `dst` (e.g. made before the last training step) is replaced. A frozen
        model keeps one copy: its `src` copy is dropped afterwards.
        """
        start = time.time()
        stats = {"role": role, "src": f"{src.mesh}/{src.layout}", "dst": f"{dst.mesh}/{dst.layout}", "start": start,
                 "bytes_sent": 0, "bytes_received": 0, "local_bytes": 0, "pulled": False}
        in_src, in_dst = self.rank in src.mesh.gpus, self.rank in dst.mesh.gpus
        if src == dst or not (in_src or in_dst):
            return {**stats, "end": time.time(), "seconds": 0.0}
        state = self._share_role(role, src, dst)
        if state.trainable and dst == home_of(state):
            raise ValueError(f"reallocate({role}) -> {dst.mesh}/{dst.layout}: that is the trained model's home copy, "
                             "which only its optimizer updates")
        src_shards: dict[str, Tensor] = {}
        if in_src:
            state.copies.reload(self.device)
            src_shards = state.copies.shards(src)
        if in_dst and state.trainable and state.copies.holds(dst):
            # A stale extra copy (made before the last training step): free it before allocating.
            state.copies.after_call(dst, None)
            self._sync_engines(state)
        new, moved = execute_reallocation(self._plan(state, src, dst), self.rank, src_shards, self._groups, self.device,
                                          state.dtype)
        if in_dst:
            engine = self._engine(state, dst)
            bind_shards(engine.model, new)
            state.copies.add(dst, shards_of(engine.model))
        if not state.trainable:
            if in_dst:
                state.copies.after_call(dst, dst)  # keeps only the dst copy, which becomes home
            else:
                self._forget_copies(role, state)
            release_peer_mappings()  # the frozen model's old copy is gone: let its memory go
        self._sync_engines(state)
        end = time.time()
        return {**stats, "end": end, "seconds": moved.seconds, "bytes_sent": moved.total_sent,
                "bytes_received": moved.total_received, "local_bytes": moved.local_bytes, "pulled": moved.pulled}

    def rehome(self, role: str, src: Placement, dst: Placement, host_fraction: float | None = None) -> dict[str, Any]:
        """Make `dst` the home of trained `role` instead of `src` (a re-plan moved its train call):
        weights and optimizer state move together (actors.worker.rehome; a frozen model moves
        with `reallocate`). Every rank of both meshes calls it. host_fraction: the new plan's
        share of the optimizer state in host memory (None keeps the current one)."""
        state = self._share_role(role, src, dst)
        if host_fraction is not None:
            state.host_fraction = host_fraction
            for engine in state.engines.values():
                engine.optimizer_host_fraction = host_fraction
        union = self._lookup(sorted(set(src.mesh.gpus) | set(dst.mesh.gpus)))
        stats = move_trained_home(self.rank, state, src, dst, self._plan(state, src, dst), self._groups, union,
                                  self.device, lambda p: self._engine(state, p))
        self._sync_engines(state)
        return {"role": role, **stats}

    def _plan(self, state: RoleState, src: Placement, dst: Placement) -> ReallocPlan:
        """The reallocation plan of `state`'s model from src to dst (cached: a pure function)."""
        key = (state.spec, state.critic, src, dst)
        if key not in self._realloc_plans:
            self._realloc_plans[key] = plan_reallocation(*key)
        return self._realloc_plans[key]

    def _share_role(self, role: str, src: Placement, dst: Placement) -> RoleState:
        """The role's state; a rank that never loaded it learns its shapes from the first source
        rank (an object broadcast over the union of both meshes, whose group the plan creates)."""
        union = sorted(set(src.mesh.gpus) | set(dst.mesh.gpus))
        if self.rank not in union or len(union) < 2:
            return self._role(role)
        recipe: list[Any] = [None]
        if self.rank == src.mesh.start:
            s = self._role(role)
            recipe = [(s.spec, s.critic, s.trainable, s.dtype)]
        dist.broadcast_object_list(recipe, src=src.mesh.start, group=self._lookup(union))
        if role not in self._roles:
            spec, critic, trainable, dtype = recipe[0]
            self._roles[role] = RoleState(spec, critic, trainable, dtype, None,
                                          ModelCopies(role, trainable, offload_idle=False))
        return self._roles[role]

    def release(self, role: str, placement: Placement) -> None:
        """Drop this rank's copy of `role` under `placement` (never a trained model's home copy)."""
        state = self._role(role)
        if state.trainable:
            if state.copies.holds(placement) and placement == home_of(state):
                raise ValueError(f"release({role}, {placement.mesh}/{placement.layout}): that is the home copy "
                                 "of a trained model (its optimizer state lives beside it)")
            state.copies.after_call(placement, None)
        elif state.copies.holds(placement) or (state.copies.offloaded and state.copies.home == placement):
            self._forget_copies(role, state)
        self._sync_engines(state)

    @staticmethod
    def _forget_copies(role: str, state: RoleState) -> None:
        """A frozen model leaves this GPU: no device copy, no host copy, no home here."""
        state.copies.release_all()
        state.copies = ModelCopies(role, False, offload_idle=False)

    def offload(self, role: str) -> None:
        """Move a frozen model's copy to host memory (trained models stay with their optimizer)."""
        state = self._role(role)
        if state.trainable:
            raise ValueError(f"offload({role}): a trained model stays on its GPUs with its optimizer state")
        if state.copies.placements:
            state.copies.offload()
        self._sync_engines(state)

    def reload(self, role: str) -> None:
        """Bring an offloaded frozen model back to this GPU."""
        state = self._role(role)
        if not state.copies.offloaded:
            return
        state.copies.reload(self.device)
        home = state.copies.home
        bind_shards(state.engines[home].model, dict(state.copies.shards(home)))

    # ---- calls ------------------------------------------------------------------------------------
    def run_call(self, call: CallSpec, *inputs: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Run `call` on this rank's shard; inputs are producer shards (any subset covering the
        rows this rank needs). Returns (meta for the driver, data shard or None)."""
        placement = call.placement
        if self.rank not in placement.mesh.gpus:
            raise ValueError(f"call {call.name}: rank {self.rank} is not in its mesh {placement.mesh}")
        op = call.op
        if op not in CALL_OPS:
            raise ValueError(f"call {call.name}: params['op']={op!r} unknown; allowed: {', '.join(CALL_OPS)}")
        mesh_rank = self.rank - placement.mesh.start
        if op in MODEL_FREE_OPS:
            dp_rank, tp_rank, pp_rank = placement.layout.coords(mesh_rank)
            groups = ParallelGroups(placement.layout, dp_rank, tp_rank, pp_rank, None, None, None, None, None,
                                    (self.rank,), (self.rank,))
            # A host device: timing must not synchronise the GPU the default group is using, and
            # no memory probe (it may run beside a GPU call, whose peak a reset would spoil).
            ctx = CallContext(call, None, groups, mesh_rank, torch.device("cpu"))
            return timed(CALL_OPS[op], ctx, inputs, pauses=self.host_pauses)
        state = self._role(call.role)
        self._ensure_copy(call, state)
        engine = state.engines[placement]
        if call.kind == "train" and (not state.trainable or placement != home_of(state)):
            raise ValueError(f"call {call.name}: trains {call.role} under {placement.mesh}/{placement.layout}, but its "
                             "optimizer lives on its home placement (load_model's)")
        ctx = CallContext(call, engine, engine.groups, mesh_rank, self.device)
        meta, data = timed(CALL_OPS[op], ctx, inputs, self.memory_probe, self.host_pauses)
        if call.kind == "train":
            state.copies.after_train()
            self._sync_engines(state)
        return meta, data

    def _ensure_copy(self, call: CallSpec, state: RoleState) -> None:
        placement = call.placement
        if state.copies.holds(placement):
            return
        if state.copies.offloaded and state.copies.home == placement:
            self.reload(call.role)
            return
        held = ", ".join(f"{p.mesh}/{p.layout}" for p in state.copies.placements) or "none"
        raise ValueError(f"call {call.name}: rank {self.rank} holds no copy of {call.role} under "
                         f"{placement.mesh}/{placement.layout} (held: {held}); reallocate it there first")

    # ---- checkpoint state (actors.worker.state): home mesh ranks; rng: every rank ------------------
    def save_state(self, role: str, out_dir: str) -> dict[str, Any]:
        """Write a trained role's home shard: weights, fp32 master, AdamW moments, step count."""
        state, home = self._trained_home(role)
        return {"role": role, "rank": self.rank, **save_role_state(state.engines[home], out_dir)}

    def load_state(self, role: str, state_dir: str, saved: Placement) -> dict[str, Any]:
        """Overwrite a trained role's home shard (after `load_model`) with the state saved under
        `saved`, resharded to this layout by the reallocation plan."""
        state, home = self._trained_home(role)
        engine = state.engines[home]
        return {"role": role, "rank": self.rank,
                **load_role_state(engine, state.spec, state.critic, saved, home, self.rank, state_dir)}

    def _trained_home(self, role: str) -> tuple[RoleState, Placement]:
        state = self._role(role)
        home = home_of(state)
        if not state.trainable or home is None:
            raise ValueError(f"rank {self.rank} holds no trained home copy of {role!r}")
        return state, home

    def save_rng_state(self, out_dir: str) -> str:
        return save_rng_state(out_dir, self.rank)

    def load_rng_state(self, in_dir: str) -> bool:
        return load_rng_state(in_dir, self.rank)

    def progress(self) -> dict[str, Any]:
        """Where this worker's call thread is, answered from a second thread (for stall reports)."""
        return {"rank": self.rank, **activity(self)}

    # ---- export -------------------------------------------------------------------------------------
    def export(self, role: str, out_dir: str) -> dict[str, Any]:
        """Write `role` as an HF checkpoint from its home copy; every rank of the home mesh calls it
        (their shards are gathered on the mesh's first rank, which writes the files)."""
        state = self._role(role)
        start = time.perf_counter()
        path = export_role(state, self.parallel_groups(state.copies.home), self.rank, self.device, out_dir)
        return {"role": role, "path": None if path is None else str(path), "seconds": time.perf_counter() - start}


__all__ = ["ModelWorker"]
