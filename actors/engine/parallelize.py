"""Turn the plain model into the shard one rank holds under a (dp, tp, pp) layout.

Order (torchtitan-style), as `build_model_shard` applies it:
  1. construct `Transformer(spec, critic)` on the meta device (no memory, no init);
  2. `keep_pp_stage`: drop the blocks outside this stage's range of
     planning.models.pipeline_partition; embedding on stage 0 only, final norm and head on the
     last stage only (a tied actor's last stage keeps the embedding table as its head);
  3. `apply_tp`: swap q/k/v/gate/up to column-parallel, o/down to row-parallel, the embedding to
     vocab-parallel, the head to column-parallel without gather (logits stay vocab-sharded), and
     rewrite the attention's local head counts; K/V stay whole when tp does not divide the KV heads;
     the attention's and the MLP's input enter the tp region once each (a forward pre-hook), not
     once per projection;
  4. materialise: `to_empty` on the device, then `init_shard_weights` (deterministic, equal to
     the slices of the serial model's `Transformer.init_weights`) or a checkpoint load.

Data parallelism needs no wrapper: ShardedAdamW (optim.py) reduce-scatters gradients over dp.
Gradient fix-ups the model itself cannot do are in `sync_model_parallel_grads`: replicated K/V
(partial gradients per tp rank) are all-reduced over tp, and a tied embedding's two copies
(first and last stage) over the embedding group, so both copies take identical steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from actors.engine.model import Transformer, init_param_tensor, set_elementwise_fusion
from actors.engine.process_groups import ParallelGroups, group_rank, group_size
from actors.engine.tp_layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    copy_to_tp_region,
)
from planning.layout import Layout
from planning.models import ModelSpec, kv_replicated, param_specs, pipeline_partition, tp_split_dim, validate_tp

EMBEDDING = "model.embed_tokens.weight"


def keep_pp_stage(model: Transformer, spec: ModelSpec, pp_rank: int, pp: int) -> None:
    """Reduce `model` (still on meta) to pipeline stage `pp_rank` of `pp`."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank}: must be in [0, pp={pp})")
    start, end = pipeline_partition(spec, pp, model.critic)[pp_rank]
    model.keep_layers(start, end, first=pp_rank == 0, last=pp_rank == pp - 1)


def apply_tp(model: Transformer, spec: ModelSpec, tp_group: dist.ProcessGroup | None) -> None:
    """Swap the layers of `model` (a stage, still on meta) for tensor-parallel ones."""
    tp = group_size(tp_group)
    if tp == 1:
        return
    validate_tp(spec, tp)
    h, d, rank = spec.hidden_size, spec.head_dim, group_rank(tp_group)
    meta = torch.device("meta")
    region = {"group": tp_group, "device": meta, "input_in_tp_region": True}
    for layer in model.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(h, spec.n_heads * d, spec.qkv_bias, **region)
        if kv_replicated(spec, tp):
            attn.k_proj = ReplicatedLinear(h, spec.n_kv_heads * d, spec.qkv_bias, **region)
            attn.v_proj = ReplicatedLinear(h, spec.n_kv_heads * d, spec.qkv_bias, **region)
            attn.n_kv_heads = spec.n_kv_heads
        else:
            attn.k_proj = ColumnParallelLinear(h, spec.n_kv_heads * d, spec.qkv_bias, **region)
            attn.v_proj = ColumnParallelLinear(h, spec.n_kv_heads * d, spec.qkv_bias, **region)
            attn.n_kv_heads = spec.n_kv_heads // tp
        attn.o_proj = RowParallelLinear(spec.n_heads * d, h, False, tp_group, device=meta)
        attn.n_heads = spec.n_heads // tp
        attn.q_head_offset = rank * attn.n_heads  # global index of the first local query head
        mlp.gate_proj = ColumnParallelLinear(h, spec.intermediate_size, False, **region)
        mlp.up_proj = ColumnParallelLinear(h, spec.intermediate_size, False, **region)
        mlp.down_proj = RowParallelLinear(spec.intermediate_size, h, False, tp_group, device=meta)
        # The block's two inputs enter the tp region once each, before their projections
        # (torchtitan's PrepareModuleInput, as a forward pre-hook: the plain model is unchanged).
        for module in (attn, mlp):
            module.register_forward_pre_hook(_TPRegionEntry(tp_group))
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = VocabParallelEmbedding(spec.vocab_size, h, tp_group, device=meta)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(h, spec.vocab_size, False, tp_group, gather_output=False, device=meta)
    elif not model.critic and model.model.norm is not None and model.model.embed_tokens is not None:
        # Tied head on the last stage: the plain model's F.linear on the table would skip the
        # tp region entry (the hidden state's gradient must be summed over tp).
        model.lm_head = TiedVocabParallelHead(model.model.embed_tokens)


class _TPRegionEntry:
    """Forward pre-hook: the module's first argument (its input x) passes copy_to_tp_region, so
    the backward all-reduces x's gradient once, summed over the projections that read it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
        return (copy_to_tp_region(args[0], self.group), *args[1:])


@torch.no_grad()
def init_shard_weights(model: Transformer, spec: ModelSpec, tp_rank: int, tp: int, seed: int) -> None:
    """Fill a materialised shard with the tp slices of the serial model's deterministic init."""
    full_shapes = {p.name: p.shape for p in param_specs(spec, model.critic)}
    for name, param in model.named_parameters():
        if name not in full_shapes:
            raise ValueError(f"parameter {name!r}: not in planning.models.param_specs of {spec.name}")
        full = init_param_tensor(name, full_shapes[name], seed)
        dim = tp_split_dim(name, spec, tp)
        shard = full if dim is None else full.chunk(tp, dim=dim)[tp_rank]
        if shard.shape != param.shape:
            raise ValueError(f"parameter {name!r}: shard shape {tuple(shard.shape)} != module's {tuple(param.shape)}")
        param.copy_(shard)


def build_model_shard(spec: ModelSpec, critic: bool, layout: Layout, coords: tuple[int, int, int],
                      groups: ParallelGroups | None, device: torch.device | str, dtype: torch.dtype,
                      seed: int | None = 0) -> Transformer:
    """The shard of rank `coords` = (dp_rank, tp_rank, pp_rank) under `layout`, on `device`.

    groups supplies the tp group the layers communicate over; it may be None only when
    layout.tp == 1 (building a pipeline stage needs no communication). With `seed` the weights
    equal the matching slices of `Transformer(spec, critic)` after `init_weights(seed)`; with
    seed None they are left uninitialised for a checkpoint load.
    """
    dp_rank, tp_rank, pp_rank = coords
    if not (0 <= dp_rank < layout.dp and 0 <= tp_rank < layout.tp and 0 <= pp_rank < layout.pp):
        raise ValueError(f"coords={coords}: outside layout {layout}")
    if groups is None and layout.tp > 1:
        raise ValueError(f"groups=None: layout {layout} has tp > 1 and needs its tp group")
    if groups is not None and (groups.layout != layout or (groups.dp_rank, groups.tp_rank, groups.pp_rank) != coords):
        raise ValueError(f"groups are for {groups.layout} at {(groups.dp_rank, groups.tp_rank, groups.pp_rank)}, "
                         f"not {layout} at {coords}")
    model = Transformer(spec, critic, device="meta")
    keep_pp_stage(model, spec, pp_rank, layout.pp)
    apply_tp(model, spec, groups.tp_group if groups is not None else None)
    model.to_empty(device=device)
    if seed is not None:
        init_shard_weights(model, spec, tp_rank, layout.tp, seed)
    # On CUDA the blocks' elementwise work (norms, rotary, SwiGLU gate, residual add) runs fused.
    set_elementwise_fusion(model, torch.device(device).type == "cuda")
    return model.to(dtype)


def tp_partial_grad_names(model: Transformer) -> list[str]:
    """Parameters whose gradient on each tp rank is partial (replicated K/V): all-reduce over tp."""
    return [f"model.layers.{idx}.self_attn.{proj}.{kind}"
            for idx, layer in model.model.layers.items()
            for proj in ("k_proj", "v_proj")
            if isinstance(getattr(layer.self_attn, proj), ReplicatedLinear)
            for kind, p in getattr(layer.self_attn, proj).named_parameters(recurse=False) if p is not None]


def norm_excluded_names(model: Transformer, spec: ModelSpec, groups: ParallelGroups) -> frozenset[str]:
    """Parameters this rank must leave out of the global gradient norm so each element counts
    once: tp-replicated ones (norms, critic head, replicated K/V) on tp ranks other than 0, and
    the last stage's copy of a tied embedding."""
    tp = groups.layout.tp
    names = set()
    for name, _ in model.named_parameters():
        if tp > 1 and groups.tp_rank != 0 and tp_split_dim(name, spec, tp) is None:
            names.add(name)
        if name == EMBEDDING and not groups.is_first_stage:
            names.add(name)
    return frozenset(names)


def sync_model_parallel_grads(model: Transformer, groups: ParallelGroups,
                              grad_of: Callable[[str], Tensor | None] | None = None) -> None:
    """Sum the partial gradients of replicated K/V over tp and a tied embedding's two copies over
    the embedding group (call after backward, before the optimizer step). grad_of(name): where a
    parameter's accumulated gradient is (the optimizer's fp32 main_grad), default its .grad."""
    params = dict(model.named_parameters())
    grad_of = grad_of or (lambda name: params[name].grad)
    if groups.tp_group is not None:
        for name in tp_partial_grad_names(model):
            grad = grad_of(name)
            if grad is not None:
                dist.all_reduce(grad, group=groups.tp_group)
    if groups.embedding_group is not None and EMBEDDING in params and has_tied_copies(model, groups):
        grad = grad_of(EMBEDDING)
        if grad is None:
            grad = params[EMBEDDING].grad = torch.zeros_like(params[EMBEDDING])
        dist.all_reduce(grad, group=groups.embedding_group)


def has_tied_copies(model: Transformer, groups: ParallelGroups) -> bool:
    """True when the first and last pipeline stage each hold a copy of a tied embedding."""
    return model.spec.tie_embeddings and not model.critic and groups.layout.pp > 1


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) in module order, the order every dp replica flattens them in."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


__all__ = [
    "EMBEDDING", "apply_tp", "build_model_shard", "has_tied_copies", "init_shard_weights",
    "keep_pp_stage", "named_trainable_parameters", "norm_excluded_names", "sync_model_parallel_grads",
    "tp_partial_grad_names",
]
