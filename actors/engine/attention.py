"""Attention kernels over packed batches, and the static KV cache used for generation.

Three backends compute causal attention over a packed batch (sequences concatenated, no padding):
- "varlen": `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16);
- "flash": `flash_attn.flash_attn_varlen_func` when the package is installed (CUDA, fp16/bf16);
- "sdpa": `F.scaled_dot_product_attention` with a block-diagonal causal mask built from
  `cu_seqlens`; runs everywhere (the CPU path) and supports float32.
"auto" picks a kernel by device and dtype; a backend can be forced by name.

`KVCache` holds per-layer K/V [n_seqs, max_len, n_kv_local, head_dim] and per-sequence lengths.
The model's forward runs in two phases with a cache: prefill (packed prompts, attention over the
prompt only, K/V written into the cache) and decode (one token per sequence, appended to the
cache, attention over the cache with a length mask; static shapes, no host sync).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from actors.engine.packing import PackedBatch

BACKENDS = ("auto", "varlen", "flash", "sdpa")


# Whether a kernel package is installed does not change while a process runs, and
# resolve_backend asks for every layer of every micro-batch: find_spec costs 17-41 us a call
# (a scan of sys.path), ~58 us per attention call on CUDA before these were cached.
@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def varlen_attn_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether the installed varlen_attn has `enable_gqa` (added in torch 2.12)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


@functools.cache
def varlen_native_gqa(device_index: int) -> bool:
    """torch < 2.12 (no `enable_gqa`): whether varlen_attn takes fewer KV heads than query heads
    as they are on CUDA device `device_index`, checked once on a tiny case against repeated K/V,
    forward and backward. Its FlashAttention kernel handles GQA itself (dK/dV summed over each
    group); where the wrapper or kernel refuses, the caller repeats K/V (Hq / Hkv x the bytes:
    for a 1B model's training on an H200, 1.9 GiB more peak memory and two copies per layer)."""
    from torch.nn.attention.varlen import varlen_attn

    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the check needs autograd wherever it runs
            q, k, v = (torch.randn(6, heads, 64, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
                       for heads in (4, 2, 2))
            native = varlen_attn(q, k, v, cu, cu, 4, 4, window_size=(-1, 0))
            grads = torch.autograd.grad(native.float().square().sum(), (q, k, v))
            repeated = varlen_attn(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu, cu, 4, 4,
                                   window_size=(-1, 0))
            expected = torch.autograd.grad(repeated.float().square().sum(), (q, k, v))
    except (RuntimeError, TypeError, ValueError):
        return False
    return all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
               for a, b in zip((native, *grads), (repeated, *expected), strict=True))


def varlen_gqa_mode(device: torch.device) -> str:
    """How varlen_attn takes fewer KV heads than query heads on `device`: "enable_gqa" (torch >=
    2.12), "native" (as they are, `varlen_native_gqa`) or "repeat" (each KV head repeated)."""
    if _varlen_takes_gqa():
        return "enable_gqa"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "native" if varlen_native_gqa(index) else "repeat"


def _varlen_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict[str, bool]]:
    """K/V [T, Hkv, D] for varlen_attn with q's heads, and its extra arguments: as they are when
    the heads match or the kernel takes GQA (`varlen_gqa_mode`), else each KV head repeated for
    its query heads ([T, Hq, D], Hq / Hkv x the bytes)."""
    if k.shape[1] == q.shape[1]:
        return k, v, {}
    mode = varlen_gqa_mode(q.device)
    if mode != "repeat":
        return k, v, {"enable_gqa": True} if mode == "enable_gqa" else {}
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), {}


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Concrete backend for `backend` ("auto" or a forced name) on this device and dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: unknown; allowed: {', '.join(BACKENDS)}")
    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        if device.type == "cuda" and half:
            if flash_attn_available():
                return "flash"
            if varlen_attn_available():
                return "varlen"
        return "sdpa"
    if backend in ("varlen", "flash"):
        available = varlen_attn_available() if backend == "varlen" else flash_attn_available()
        if device.type != "cuda" or not half or not available:
            raise ValueError(
                f"attention backend {backend!r}: needs CUDA, fp16/bf16 and the kernel installed "
                f"(device={device.type}, dtype={dtype}, installed={available}); use 'sdpa' or 'auto'"
            )
    return backend


def packed_causal_mask(batch: PackedBatch, sliding_window: int | None = None) -> Tensor:
    """bool [T, T]: token i may attend token j (same sequence, j <= i, within the window)."""
    seq = batch.seq_ids()
    pos = batch.positions
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        # HF's convention: key j is visible from query i when i - j < sliding_window.
        allowed &= (pos[:, None] - pos[None, :]) < sliding_window
    return allowed


def expand_kv_heads(kv: Tensor, kv_index: Tensor | None) -> Tensor:
    """Pick one KV head per local query head along dim -2 when the GQA map is not a plain repeat
    (K/V replicated under tensor parallelism). kv: [..., n_kv, D] -> [..., n_q_local, D]."""
    return kv if kv_index is None else kv.index_select(-2, kv_index)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: PackedBatch,
    backend: str = "auto",
    sliding_window: int | None = None,
    kv_index: Tensor | None = None,
) -> Tensor:
    """Causal attention within each packed sequence.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention), or any
    Hkv when `kv_index` [Hq] maps each query head to its KV head. Returns [T, Hq, D].
    """
    k, v = expand_kv_heads(k, kv_index), expand_kv_heads(v, kv_index)
    name = resolve_backend(backend, q.device, q.dtype)
    scale = q.shape[-1] ** -0.5
    if name == "flash":
        from flash_attn import flash_attn_varlen_func

        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        return flash_attn_varlen_func(
            q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
            softmax_scale=scale, causal=True, window_size=window,
        )
    if name == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        # (left, 0) is causal attention limited to `left` earlier keys; (-1, 0) is plain causal.
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
        k, v, gqa = _varlen_kv(q, k, v)
        return varlen_attn(
            q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
            scale=scale, window_size=window, **gqa,
        )
    mask = packed_causal_mask(batch, sliding_window)
    # SDPA takes [batch, heads, seq, dim]: the whole pack is one "batch" row; the mask keeps
    # sequences apart. q.transpose: [T, H, D] -> [1, H, T, D].
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def attention_over_history(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    sliding_window: int | None = None, kv_index: Tensor | None = None,
) -> Tensor:
    """Causal attention of new tokens over their sequences' whole history (cached tokens, then
    the new ones): sequence s has queries q[cu_q[s]:cu_q[s+1]], the LAST tokens of its keys
    k[cu_k[s]:cu_k[s+1]], so query i of a sequence with n_q queries and n_k keys sees keys
    0 .. n_k - n_q + i (causal aligned at the bottom right, FlashAttention's convention).

    q: [T_q, Hq, D]; k, v: [T_k, Hkv, D]; cu_q, cu_k: int32 [B+1]. Returns [T_q, Hq, D]. On CUDA
    with fp16/bf16 and torch's varlen kernel: one fused call; elsewhere SDPA with a mask."""
    k, v = expand_kv_heads(k, kv_index), expand_kv_heads(v, kv_index)
    scale = q.shape[-1] ** -0.5
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and varlen_attn_available():
        from torch.nn.attention.varlen import varlen_attn

        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
        k, v, gqa = _varlen_kv(q, k, v)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window, **gqa)
    # Mask [T_q, T_k]: same sequence, key position <= query position (positions from each end).
    seq_q = torch.searchsorted(cu_q[1:].contiguous(), torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype),
                               right=True)
    seq_k = torch.searchsorted(cu_k[1:].contiguous(), torch.arange(k.shape[0], device=k.device, dtype=cu_k.dtype),
                               right=True)
    n_q, n_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    pos_q = torch.arange(q.shape[0], device=q.device) - cu_q[:-1].long()[seq_q] + (n_k - n_q)[seq_q]
    pos_k = torch.arange(k.shape[0], device=k.device) - cu_k[:-1].long()[seq_k]
    visible = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    if sliding_window is not None:
        visible &= (pos_q[:, None] - pos_k[None, :]) < sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=visible, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


@dataclass(frozen=True)
class CacheLayerShape:
    """Local K/V geometry of one attention layer (after tensor parallelism)."""

    n_kv_heads: int
    head_dim: int


class KVCache:
    """Static K/V cache for a fixed set of sequences, keyed by global layer index.

    k[layer], v[layer]: [n_seqs, max_len, n_kv_local, head_dim]; lengths: int64 [n_seqs], tokens
    already cached per sequence (equal across layers). `prefilled` is False until the first
    forward (the prefill) has written the prompts; later forwards are decode steps.
    """

    def __init__(
        self,
        layers: dict[int, CacheLayerShape],
        n_seqs: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if n_seqs < 1 or max_len < 1:
            raise ValueError(f"KVCache: n_seqs={n_seqs}, max_len={max_len}; both must be >= 1")
        self.n_seqs = n_seqs
        self.max_len = max_len
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        for idx, shape in layers.items():
            size = (n_seqs, max_len, shape.n_kv_heads, shape.head_dim)
            self.k[idx] = torch.zeros(size, dtype=dtype, device=device)
            self.v[idx] = torch.zeros(size, dtype=dtype, device=device)
        self.lengths = torch.zeros(n_seqs, dtype=torch.int64, device=device)
        # What a decode step adds to each length: 1 for every sequence, or 0 for the sequences a
        # multi-turn loop has paused (their step writes a slot they will overwrite, and their
        # length stays). A fixed buffer changed in place, so captured CUDA graphs read it.
        self.step_increment = torch.ones(n_seqs, dtype=torch.int64, device=device)
        self.prefilled = False

    @staticmethod
    def for_model(
        model: torch.nn.Module,
        n_seqs: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A cache sized for the attention layers `model` (a `Transformer` or stage) holds."""
        layers = {
            int(idx): CacheLayerShape(layer.self_attn.n_kv_heads, layer.self_attn.head_dim)
            for idx, layer in model.model.layers.items()
        }
        param = next(model.parameters())
        return KVCache(layers, n_seqs, max_len, dtype or param.dtype, device or param.device)

    def fused_qkv(self, layer: int) -> tuple[Tensor, Tensor | None] | None:
        """Concatenated [q; k; v] (weight, bias) for decode steps of `layer`, or None (the model
        then runs its three projections). This cache keeps none."""
        return None

    def decode_mlp(self, layer: int, x: Tensor) -> Tensor | None:
        """`layer`'s MLP output [T, H] for a decode step's x [T, H] from other weights (FP8
        copies), or None (the model then runs its own MLP). This cache keeps none."""
        return None

    def decode_head(self, hidden: Tensor) -> Tensor | None:
        """A decode step's logits [T, V_local] from other head weights, or None. This cache keeps none."""
        return None

    def reset(self) -> None:
        """Forget all cached tokens (buffers are kept, so CUDA graphs stay valid)."""
        self.lengths.zero_()
        self.prefilled = False

    def row_tensors(self) -> list[Tensor]:
        """The tensors with one entry per sequence along dim 0 (K/V buffers, lengths, step
        increments): what changes size when rows are dropped."""
        return [*self.k.values(), *self.v.values(), self.lengths, self.step_increment]

    def decode_batch(self) -> PackedBatch:
        """Boundaries of a decode step: one token per sequence at position `lengths`."""
        cu = torch.arange(self.n_seqs + 1, dtype=torch.int32, device=self.lengths.device)
        return PackedBatch(cu_seqlens=cu, positions=self.lengths.clone(), max_seqlen=1)

    # ---- attention with the cache ------------------------------------------------------------
    def prefill(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, batch: PackedBatch, backend: str,
        sliding_window: int | None, kv_index: Tensor | None,
    ) -> Tensor:
        """Write packed prompt K/V [T, Hkv, D] into the cache and attend over the prompts."""
        if batch.n_seqs != self.n_seqs:
            raise ValueError(f"prefill: batch has {batch.n_seqs} sequences, cache holds {self.n_seqs}")
        if batch.max_seqlen > self.max_len:
            raise ValueError(f"prefill: prompt of {batch.max_seqlen} tokens exceeds cache max_len={self.max_len}")
        seq, pos = batch.seq_ids(), batch.positions
        self.k[layer][seq, pos] = k.to(self.k[layer].dtype)
        self.v[layer][seq, pos] = v.to(self.v[layer].dtype)
        return packed_attention(q, k, v, batch, backend, sliding_window, kv_index)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sliding_window: int | None,
               kv_index: Tensor | None) -> Tensor:
        """Append one token per sequence (q: [B, Hq, D], k/v: [B, Hkv, D]) and attend over the
        cache. Static shapes and no host sync, so the step can be captured in a CUDA graph."""
        rows = torch.arange(self.n_seqs, device=q.device)
        # A full sequence (length max_len) overwrites its last slot instead of indexing out of
        # bounds: no host check is possible in a captured step; size max_len to prompt + new tokens.
        slot = self.lengths.clamp(max=self.max_len - 1)
        cache_k, cache_v = self.k[layer], self.v[layer]
        cache_k[rows, slot] = k.to(cache_k.dtype)
        cache_v[rows, slot] = v.to(cache_v.dtype)
        # Key slot j of sequence b is visible when j <= lengths[b] (the new token included).
        slots = torch.arange(self.max_len, device=q.device)
        visible = slots[None, :] <= self.lengths[:, None]
        if sliding_window is not None:
            visible &= slots[None, :] > self.lengths[:, None] - sliding_window
        keys = expand_kv_heads(cache_k, kv_index).transpose(1, 2)  # [B, H, max_len, D]
        values = expand_kv_heads(cache_v, kv_index).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=visible[:, None, None, :],
            scale=q.shape[-1] ** -0.5, enable_gqa=keys.shape[1] != q.shape[1],
        )  # [B, Hq, 1, D]
        return out.squeeze(2)

    def advance(self, batch: PackedBatch) -> None:
        """Record the tokens a forward added: the prompts after prefill, one token per sequence
        after decode (`step_increment`: none for a paused sequence)."""
        if not self.prefilled:
            self.lengths.copy_((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).to(torch.int64))
            self.prefilled = True
        else:
            self.lengths.add_(self.step_increment)


__all__ = [
    "BACKENDS", "CacheLayerShape", "KVCache", "attention_over_history", "expand_kv_heads", "flash_attn_available",
    "packed_attention", "packed_causal_mask", "resolve_backend", "varlen_attn_available",
]
