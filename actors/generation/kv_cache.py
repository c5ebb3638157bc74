"""The KV cache generation uses: `actors.engine.attention.KVCache` with a head-major layout and a decode
attention that reads each cached K/V byte once.

Why a subclass: decode is memory-bound, and its cost is reading the weights plus the cache. The
base cache stores [n_seqs, max_len, n_kv, head_dim] and attends with SDPA on a transposed view and
`enable_gqa`, which makes kernels copy or expand the cache. Here K/V are stored
[n_seqs, n_kv, max_len, head_dim] (contiguous per KV head) and the query heads sharing a KV head
are folded into the query-length axis: q [B, Hkv, group, D] against K/V [B, Hkv, L, D] is plain
multi-head attention with `group` queries, so one fused kernel reads the cache once.

`kernel` picks the decode attention: "triton" (actors.kernels.decode_attention: one kernel per layer
that appends the step's K/V and attends over each sequence's own length; CUDA, the default
there), "sdpa" (one fused SDPA call with a length mask) or "matmul" (two batched matmuls and a
float32 softmax over [B, Hkv, group, L]; on small query counts this can beat the fused kernels,
which are tuned for long queries). "auto" resolves to "triton" where it runs and supports the
model's head_dim (a power of two >= 16), else "sdpa".

`attend_len` (a host int, default max_len) limits decode attention to the first slots; the
generation loop raises it in buckets as sequences grow, so early steps do not read empty slots
(each bucket gets its own CUDA graph). The "triton" kernel reads each sequence's own length from
the device, so it ignores `attend_len` (one graph serves every step). The model calls `prefill` /
`decode` exactly as on the base class; positions and lengths keep the base class's meaning.
Shared prompts (set by actors.generation.prefill): with `prefix_groups` the "triton" path attends
each group's queries to its prompt once (`prompt_partial`), then each row to its own slots.

`FusedQKV` (set on the cache by the generation call as `cache.qkv`) holds each layer's
concatenated [q; k; v] projection weights, so the model's decode steps run one GEMM per layer
instead of three; the cache only hands them out (`fused_qkv`). Likewise `cache.fp8`
(actors.generation.fp8_weights) hands out FP8 MLPs and head (`decode_mlp`, `decode_head`).

Kernels per step: a decode step is launch-bound, so the additive length mask is built once per
step by the first layer (`decode_mask`) and shared by the others, and the row and slot indices
are built once per cache; each layer then issues only its two K/V writes and the attention.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors.engine import (
    CacheLayerShape,
    KVCache,
    PackedBatch,
    expand_kv_heads,
    packed_attention,
)
from actors.generation.fp8_weights import Fp8DecodeWeights
from actors.kernels import (
    default_splits,
    gqa_decode_attention,
    kernel_supports_head_dim,
    prefix_partials,
    triton_on,
    triton_reads_e4m3,
    triton_runs,
)

DECODE_KERNELS = ("auto", "triton", "sdpa", "matmul")
# Query rows (group members x query heads per KV head) of one shared-prompt program at most:
# the tile's float32 accumulator lives in registers.
MAX_PREFIX_TILE = 64


def resolve_decode_kernel(kernel: str, device: torch.device | str, head_dims: Iterable[int] = (),
                          cache_dtype: torch.dtype | None = None) -> str:
    """The decode attention kernel to use on `device` for layers of `head_dims` and a cache of
    `cache_dtype`: "auto" is "triton" on CUDA with triton when it supports every head_dim (and,
    for an e4m3 cache, the GPU has e4m3: compute capability >= 8.9), else "sdpa"; an explicit
    "triton" must be runnable there (CUDA, or CPU under the interpreter) and support them."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode attention kernel {kernel!r}: unknown; allowed: {', '.join(DECODE_KERNELS)}")
    unsupported = sorted({d for d in head_dims if not kernel_supports_head_dim(d)})
    no_e4m3 = cache_dtype == torch.float8_e4m3fn and not triton_reads_e4m3(device)
    if kernel == "auto":
        return "triton" if triton_on(device) and not unsupported and not no_e4m3 else "sdpa"
    if kernel == "triton" and no_e4m3:
        raise ValueError(f"decode attention kernel 'triton' cannot read an e4m3 KV cache on {torch.device(device)}: "
                         "Triton has no e4m3 below compute capability 8.9; use 'auto' or 'sdpa' (which widen the "
                         "cache with torch), or kv_cache_dtype 'auto'")
    if kernel == "triton" and not triton_runs(device):
        raise ValueError(f"decode attention kernel 'triton' cannot run on {torch.device(device)}: needs CUDA "
                         f"with triton installed (or TRITON_INTERPRET=1 on CPU); use 'auto' or 'sdpa'")
    if kernel == "triton" and unsupported:
        raise ValueError(f"decode attention kernel 'triton': head_dim={unsupported[0]} is not supported (needs a "
                         f"power of two >= 16); use 'auto' or 'sdpa'")
    return kernel




class FusedQKV:
    """The [q; k; v] projection weights (and biases) of every attention layer of `model`,
    concatenated once per generation call so that a decode step runs one GEMM per layer instead
    of three. Shared by the caches of one call (pipeline micro-batch slots); `refresh` rebuilds
    them only when the projections' storage moved (reallocation), so graphs that read them stay
    valid otherwise. Costs the bytes of those weights for the call (`nbytes`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.key: tuple[int, ...] = ()
        self.weights: dict[int, tuple[Tensor, Tensor | None]] = {}
        self.refresh()

    @staticmethod
    def projections(model: nn.Module) -> dict[int, tuple[nn.Module, nn.Module, nn.Module]]:
        """(q, k, v) projections per layer; layers whose projections gather their output are left out."""
        out = {}
        for idx, layer in model.model.layers.items():
            attn = layer.self_attn
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            if not any(getattr(p, "gather_output", False) for p in projs):
                out[int(idx)] = projs
        return out

    @staticmethod
    def nbytes(model: nn.Module) -> int:
        """Bytes the concatenated weights and biases take."""
        return sum(p.numel() * p.element_size() for projs in FusedQKV.projections(model).values()
                   for proj in projs for p in proj.parameters())

    def refresh(self) -> bool:
        """Rebuild when a projection's storage moved; returns whether it rebuilt."""
        projections = self.projections(self.model)
        key = tuple(p.data_ptr() for projs in projections.values() for proj in projs for p in proj.parameters())
        if key == self.key:
            return False
        self.weights.clear()  # free the old copies before making new ones
        with torch.no_grad():
            for idx, (q, k, v) in projections.items():
                bias = torch.cat([q.bias, k.bias, v.bias]) if q.bias is not None else None
                self.weights[idx] = (torch.cat([q.weight, k.weight, v.weight]), bias)
        self.key = key
        return True


def decode_weight_copies(model: nn.Module, fuse_qkv: bool, fp8_weights: bool
                         ) -> tuple[FusedQKV | None, Fp8DecodeWeights | None]:
    """The weight copies a call's decode steps read instead of the model's own (a cache's `qkv`
    and `fp8`): the fused [q; k; v] projections, the FP8 MLP and head weights; None where not
    asked for. Made after prefill, which reads the model's own weights."""
    return FusedQKV(model) if fuse_qkv else None, Fp8DecodeWeights(model) if fp8_weights else None


class HeadMajorKVCache(KVCache):
    """k[layer], v[layer]: [n_seqs, n_kv_local, max_len, head_dim]; lengths int64 [n_seqs]."""

    def __init__(self, layers: dict[int, CacheLayerShape], n_seqs: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, kernel: str = "auto") -> None:
        kernel = resolve_decode_kernel(kernel, device, (shape.head_dim for shape in layers.values()), dtype)
        super().__init__({}, n_seqs, max_len, dtype, device)  # lengths and flags; buffers below
        self.kernel = kernel
        for idx, shape in layers.items():
            size = (n_seqs, shape.n_kv_heads, max_len, shape.head_dim)
            self.k[idx] = torch.zeros(size, dtype=dtype, device=device)
            self.v[idx] = torch.zeros(size, dtype=dtype, device=device)
        self.attend_len = max_len
        # Constant index tensors, built once instead of once per layer per step: the cache row
        # of each sequence int64 [n_seqs], and the slot numbers int64 [max_len].
        self.rows = torch.arange(n_seqs, device=device)
        self.slots = torch.arange(max_len, device=device)
        # Shared prompts (set in place by actors.generation.prefill.SharedPrefill): the Triton
        # decode attention reads row b's slots [0, prefix_lengths[b]) from row prefix_rows[b],
        # which holds the same prompt K/V, so a group of samples reads one copy. int64 [n_seqs].
        self.prefix_rows = self.rows.clone()
        self.prefix_lengths = torch.zeros(n_seqs, dtype=torch.int64, device=device)
        # The rows of each group, int64 [G, R] (-1 pads short groups; set by SharedPrefill): with
        # it the prompt's part of the attention runs once per (group, KV head) (cascade).
        self.prefix_groups: Tensor | None = None
        self.prefix_chunk_rows = MAX_PREFIX_TILE  # rows per chunk of prefix_groups (set with them)
        # Additive attention masks [n_seqs, 1, 1, attend_len] (0 visible, -inf hidden) of the
        # current decode step, keyed by (dtype, sliding_window): every layer of a step shares
        # one; `advance` (end of each forward) and `reset` drop them.
        self.step_masks: dict[tuple[torch.dtype, int | None], Tensor] = {}
        self.qkv: FusedQKV | None = None  # set by the generation call that owns this cache
        self.fp8: Fp8DecodeWeights | None = None  # likewise (GenerationConfig.fp8_weights)

    @staticmethod
    def for_model(model: nn.Module, n_seqs: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, kernel: str = "auto") -> HeadMajorKVCache:
        """A cache sized for the attention layers `model` (a `Transformer` or stage) holds."""
        layers = {int(idx): CacheLayerShape(layer.self_attn.n_kv_heads, layer.self_attn.head_dim)
                  for idx, layer in model.model.layers.items()}
        param = next(model.parameters())
        return HeadMajorKVCache(layers, n_seqs, max_len, dtype or param.dtype, device or param.device, kernel)

    def row_tensors(self) -> list[Tensor]:
        return [*super().row_tensors(), self.rows, self.prefix_rows, self.prefix_lengths]

    def slot_dims(self) -> list[tuple[Tensor, int]]:
        """(tensor, dim) of every tensor whose size along dim is max_len: the K/V buffers (dim 2)
        and the slot numbers. What differs between two calls whose longest prompts differ."""
        return [*((buffer, 2) for buffer in (*self.k.values(), *self.v.values())), (self.slots, 0)]

    def fused_qkv(self, layer: int) -> tuple[Tensor, Tensor | None] | None:
        return self.qkv.weights.get(layer) if self.qkv is not None else None

    def decode_mlp(self, layer: int, x: Tensor) -> Tensor | None:
        return self.fp8.mlp(layer, x) if self.fp8 is not None else None

    def decode_head(self, hidden: Tensor) -> Tensor | None:
        return self.fp8.head(hidden) if self.fp8 is not None else None

    def set_attend_len(self, attend_len: int) -> None:
        """Attend over slots [0, attend_len) in decode; must cover every length + 1."""
        if not 1 <= attend_len <= self.max_len:
            raise ValueError(f"attend_len={attend_len}: must be in [1, max_len={self.max_len}]")
        self.attend_len = self.max_len if self.kernel == "triton" else attend_len

    def reset(self) -> None:
        super().reset()
        self.step_masks.clear()
        self.prefix_lengths.zero_()
        self.prefix_groups = None

    def advance(self, batch: PackedBatch) -> None:
        super().advance(batch)
        self.step_masks.clear()  # the lengths moved: the next step builds its masks afresh

    def decode_mask(self, dtype: torch.dtype, sliding_window: int | None) -> Tensor:
        """Additive mask [n_seqs, 1, 1, attend_len] of this step: 0 where slot j <= lengths[b]
        (the new token included) and inside the window, -inf elsewhere. Built by the first layer
        that asks, reused by the others (same values SDPA derives from a bool mask)."""
        key = (dtype, sliding_window)
        mask = self.step_masks.get(key)
        if mask is None or mask.shape[-1] != self.attend_len:
            slots = self.slots[: self.attend_len]
            visible = slots[None, :] <= self.lengths[:, None]  # [B, L]
            if sliding_window is not None:
                visible &= slots[None, :] > self.lengths[:, None] - sliding_window
            # Rows padded to a multiple of 16 slots: CUDA's memory-efficient SDPA needs every
            # stride of the mask aligned and would otherwise pad a copy in every layer.
            padded = -(-self.attend_len // 16) * 16
            hidden = torch.full((visible.shape[0], 1, 1, padded), float("-inf"), dtype=dtype, device=visible.device)
            mask = hidden[..., : self.attend_len]  # [B, 1, 1, L], broadcast over heads and queries
            mask.masked_fill_(visible[:, None, None, :], 0.0)
            self.step_masks[key] = mask
        return mask

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, backend: str,
                sliding_window: int | None, kv_index: Tensor | None) -> Tensor:
        """Write packed prompt K/V [T, Hkv, D] into the cache and attend over the prompts."""
        if batch.n_seqs != self.n_seqs:
            raise ValueError(f"prefill: batch has {batch.n_seqs} sequences, cache holds {self.n_seqs}")
        if batch.max_seqlen > self.max_len:
            raise ValueError(f"prefill: prompt of {batch.max_seqlen} tokens exceeds cache max_len={self.max_len}")
        seq, pos = batch.seq_ids(), batch.positions
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, Hkv, D].
        self.k[layer][seq, :, pos] = k.to(self.k[layer].dtype)
        self.v[layer][seq, :, pos] = v.to(self.v[layer].dtype)
        return packed_attention(q, k, v, batch, backend, sliding_window, kv_index)

    def prompt_partial(self, q: Tensor, cache_k: Tensor, cache_v: Tensor,
                       sliding_window: int | None) -> tuple[Tensor, Tensor, Tensor] | None:
        """The shared prompts' partial attention (actors.kernels.prefix_attention) where it
        applies: groups set, no sliding window (it may cut into the prompt), the unsplit decode
        kernel (the split one reads the prompt slots itself), and a group's query rows fitting
        one tile of MAX_PREFIX_TILE. None: the decode kernel reads the prompt from prefix_rows."""
        groups = self.prefix_groups
        if groups is None or sliding_window is not None:
            return None
        n_seqs, n_q, _ = q.shape
        n_kv = cache_k.shape[1]
        if groups.shape[1] * (n_q // n_kv) > MAX_PREFIX_TILE:
            return None
        if default_splits(n_seqs, n_kv, cache_k.shape[2], q.device) != 1:
            return None
        return prefix_partials(q, cache_k, cache_v, groups, self.prefix_lengths)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sliding_window: int | None,
               kv_index: Tensor | None) -> Tensor:
        """Append one token per sequence (q [B, Hq, D], k/v [B, Hkv, D]) and attend over the
        first `attend_len` slots. Static shapes, no host sync (CUDA-graph safe)."""
        n_seqs, n_q, head_dim = q.shape
        cache_k, cache_v = self.k[layer], self.v[layer]
        if self.kernel == "triton" and kv_index is None:
            # Writes K/V at slot lengths[b] and attends over [0, lengths[b]] in one kernel.
            # torch.compile traces through the launch (user-defined Triton kernels are supported),
            # so the compiled step keeps fusing the elementwise work around it.
            partial = self.prompt_partial(q, cache_k, cache_v, sliding_window)
            return gqa_decode_attention(q, k, v, cache_k, cache_v, self.lengths, sliding_window,
                                        prefix_rows=self.prefix_rows, prefix_lengths=self.prefix_lengths,
                                        prefix_partial=partial)
        cache_k[self.rows, :, self.lengths] = k.to(cache_k.dtype)
        cache_v[self.rows, :, self.lengths] = v.to(cache_v.dtype)
        keys, values = cache_k[:, :, : self.attend_len], cache_v[:, :, : self.attend_len]  # [B, Hkv, L, D]
        # The matmul kernel adds the mask to float32 scores; SDPA takes it in the query dtype.
        mask_dtype = torch.float32 if self.kernel == "matmul" and kv_index is None else q.dtype
        mask = self.decode_mask(mask_dtype, sliding_window)  # [B, 1, 1, L]
        if kv_index is not None:
            # K/V replicated under tp with a non-repeat head map: pick one KV head per query head.
            keys = expand_kv_heads(keys.transpose(1, 2), kv_index)  # [B, L, Hq, D]
            values = expand_kv_heads(values.transpose(1, 2), kv_index)
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2).to(q.dtype),
                                                 values.transpose(1, 2).to(q.dtype), attn_mask=mask,
                                                 scale=head_dim**-0.5)  # [B, Hq, 1, D]
            return out.squeeze(2)
        n_kv = keys.shape[1]
        # Query heads of one KV group become `group` queries of that head: [B, Hkv, group, D].
        grouped = q.view(n_seqs, n_kv, n_q // n_kv, head_dim)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if self.kernel == "sdpa":
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=head_dim**-0.5)
        else:
            scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * head_dim**-0.5  # [B, Hkv, group, L]
            probs = torch.softmax(scores + mask, dim=-1).to(q.dtype)  # s + 0 = s; s + -inf = -inf
            out = torch.matmul(probs, values)  # [B, Hkv, group, D]
        return out.reshape(n_seqs, n_q, head_dim)


__all__ = ["DECODE_KERNELS", "FusedQKV", "HeadMajorKVCache", "decode_weight_copies", "resolve_decode_kernel"]
