"""Megatron-style tensor-parallel layers and the autograd region mappings they are built from.

Every layer and mapping takes its tp process group explicitly; a None group (or one of size 1)
makes it an ordinary layer with no communication. Parameters keep the plain names `weight` and
`bias` so a model keeps its HF parameter names after `apply_tp` swaps layers in; a shard's shape
is the full shape divided along planning.models.tp_split_dim.

Region mappings (x is replicated on every tp rank unless said otherwise):
  copy_to_tp_region      forward identity,             backward all-reduce (sum of partial grads)
  reduce_from_tp_region  forward all-reduce (sum),     backward identity
  gather_from_tp_region  forward all-gather last dim,  backward keep own slice
  scatter_to_tp_region   forward keep own slice,       backward all-gather last dim
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from actors.engine.main_grad import linear
from actors.engine.process_groups import group_rank, group_size


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _gather_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} not divisible by tp size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _own_slice_last_dim(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _own_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Enter a tp region: identity forward, gradients summed over tp backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Leave a tp region: partial results summed over tp forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Concatenate the tp ranks' last-dim slices [..., n/tp] -> [..., n]."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Keep this tp rank's last-dim slice [..., n] -> [..., n/tp]."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def _local_size(full: int, group: ProcessGroup | None, what: str) -> int:
    size = group_size(group)
    if full % size:
        raise ValueError(f"{what}={full}: not divisible by tp size {size}")
    return full // size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W [out, in] split by rows: this rank holds W[out/tp, in] and b[out/tp].

    Input x [..., in] replicated; output [..., out/tp] (or [..., out] with gather_output).
    input_in_tp_region: x has already passed copy_to_tp_region (once for all the projections of
    one input: q, k and v, or gate and up), so the layer does not enter the region itself and the
    backward all-reduces x's summed gradient once instead of once per projection.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ProcessGroup | None,
                 gather_output: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, input_in_tp_region: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.local_out_features = _local_size(out_features, group, "ColumnParallelLinear.out_features")
        self.group = group
        self.gather_output = gather_output
        self.input_in_tp_region = input_in_tp_region
        self.weight = nn.Parameter(torch.empty(self.local_out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.local_out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        x = x if self.input_in_tp_region else copy_to_tp_region(x, self.group)
        y = linear(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def reads_input_as_is(self) -> bool:
        """forward(x) is linear(x, weight, bias): inside a tp region, output not gathered."""
        return (self.input_in_tp_region or group_size(self.group) == 1) and (
            not self.gather_output or group_size(self.group) == 1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_out={self.local_out_features}"


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W [out, in] split by columns: this rank holds W[out, in/tp].

    Input x [..., in/tp] (already split, input_is_parallel) or [..., in] (scattered here);
    output [..., out] summed over tp; the bias (replicated) is added once after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ProcessGroup | None,
                 input_is_parallel: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.local_in_features = _local_size(in_features, group, "RowParallelLinear.in_features")
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        y = reduce_from_tp_region(linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_in={self.local_in_features}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose table [vocab, dim] is split by rows: this rank holds rows
    [rank * vocab/tp, (rank + 1) * vocab/tp). Ids outside the range look up zeros; the partial
    embeddings are summed over tp, so the output [..., dim] is the full embedding on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup | None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.local_num_embeddings = _local_size(num_embeddings, group, "VocabParallelEmbedding.num_embeddings")
        self.vocab_start = group_rank(group) * self.local_num_embeddings
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.local_num_embeddings, embedding_dim, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, local_rows={self.local_num_embeddings}"


class ReplicatedLinear(nn.Module):
    """A projection held whole on every tp rank that reads a replicated input inside a tp region:
    K/V when tp does not divide the KV heads (the attention then picks, per local query head,
    its KV head with Attention.q_head_offset / kv_index).

    weight [out, in] is whole; output [..., out]. The input passes copy_to_tp_region because
    each rank back-propagates only through its own query heads: both the input gradient and the
    weight gradient are partial per rank and their true value is the sum over tp (the input's is
    summed by the region, the weight's by the engine; see parallelize.tp_partial_grad_names).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: ProcessGroup | None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 input_in_tp_region: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.input_in_tp_region = input_in_tp_region  # as ColumnParallelLinear's
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        x = x if self.input_in_tp_region else copy_to_tp_region(x, self.group)
        return linear(x, self.weight, self.bias)

    def reads_input_as_is(self) -> bool:
        """forward(x) is linear(x, weight, bias): inside a tp region."""
        return self.input_in_tp_region or group_size(self.group) == 1

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, replicated"


class TiedVocabParallelHead(nn.Module):
    """Output head that reuses a VocabParallelEmbedding's table (tied embeddings under tp):
    hidden [..., H] -> logits [..., V/tp] of this rank's vocab slice (never gathered).

    It owns no parameter (the table stays `model.embed_tokens.weight`, so names and state_dict
    keep the HF names); the embedding module is held outside the module tree for that reason.
    """

    def __init__(self, embedding: VocabParallelEmbedding) -> None:
        super().__init__()
        self._embedding = (embedding,)  # a tuple: not registered as a submodule
        self.group = embedding.group

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(copy_to_tp_region(hidden, self.group), self._embedding[0].weight)


__all__ = [
    "ColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "TiedVocabParallelHead",
    "VocabParallelEmbedding",
    "copy_to_tp_region", "gather_from_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
]
