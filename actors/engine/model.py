"""Plain LLaMA-family decoder (Llama 2/3, Qwen2/2.5, Mistral) over packed batches.

No torch.distributed here: tensor parallelism (actors.engine.tp_layers, parallelize.py) swaps the
projections and rewrites the attention's LOCAL head counts; pipeline parallelism keeps a slice of
`model.layers` (an `nn.ModuleDict` keyed by the global layer index, so parameter names stay the
HF names of `planning.models.param_specs`). The module is built on any device, including "meta",
and materialised with `to_empty` + `init_weights(seed)` or by loading a checkpoint (hf_io.py).

Forward: `Transformer.forward(x, batch, kv_cache=None)`, x = token ids [T] (first stage) or hidden
states [T, H] (later stages); returns hidden [T, H] (no head), logits [T, V_local] (actor) or
values [T] float32 (critic).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors.engine.attention import KVCache, packed_attention
from actors.engine.fusion import fused
from actors.engine.main_grad import Linear, shared_input_linears
from actors.engine.packing import PackedBatch
from actors.engine.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from actors.engine.shared_prefix_attention import shared_prefix_attention
from planning.models import ModelSpec

# ---- elementwise work, eager or fused ---------------------------------------------------------
# Each function below is a chain of memory-bound elementwise kernels in eager mode (RMSNorm alone
# is six passes over [T, H]). With fusion on (`set_elementwise_fusion`, on by default for CUDA
# shards: actors.engine.parallelize) the same function runs through actors.engine.fusion.fused
# (torch.compile, the token count symbolic), which emits one kernel for the forward and one for
# the backward, with the matmuls left to cuBLAS around them.
# Values agree with eager to the rounding of the intermediates (the fused kernel keeps them in
# float32). The CPU path (every parity test) is eager.


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] -> weight * x / rms(x), the statistics in float32 (as HF does)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta))."""
    summed = x + delta
    return summed, rms_norm(summed, weight, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, [T, F]."""
    return F.silu(gate) * up


def pick(fn: Callable[..., object], fuse: bool) -> Callable[..., object]:
    return fused(fn) if fuse else fn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 (as HF does), scaled by a learned weight."""

    def __init__(self, hidden_size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.eps = eps
        self.fuse_elementwise = False

    def forward(self, x: Tensor) -> Tensor:
        return pick(rms_norm, self.fuse_elementwise)(x, self.weight, self.eps)


# ---- blocks ------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention with separate q/k/v projections.

    n_heads, n_kv_heads, head_dim are LOCAL counts (tensor parallelism rewrites them). kv_group is
    the model's global query-heads-per-KV-head; q_head_offset the global index of the first local
    query head. When K/V are replicated under tensor parallelism the local query heads do not map
    onto the local KV heads by a plain repeat, and these two give the map.
    """

    def __init__(self, spec: ModelSpec, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        self.kv_group = spec.n_heads // spec.n_kv_heads
        self.q_head_offset = 0
        self.sliding_window = spec.sliding_window
        self.backend = "auto"
        self.fuse_elementwise = False
        self.q_proj = Linear(h, spec.n_heads * d, bias=spec.qkv_bias, device=device)
        self.k_proj = Linear(h, spec.n_kv_heads * d, bias=spec.qkv_bias, device=device)
        self.v_proj = Linear(h, spec.n_kv_heads * d, bias=spec.qkv_bias, device=device)
        self.o_proj = Linear(spec.n_heads * d, h, bias=False, device=device)

    def kv_index(self, device: torch.device) -> Tensor | None:
        """[n_heads] KV head of each local query head, or None when it is the plain GQA repeat."""
        if self.n_heads == self.n_kv_heads * self.kv_group and self.q_head_offset % self.n_heads == 0:
            # K/V split with the query heads: local q head i uses local kv head i // kv_group.
            return None
        global_q = self.q_head_offset + torch.arange(self.n_heads, device=device)
        return global_q // self.kv_group

    def rotated_qkv(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] from x [T, H], rotary applied to q and k."""
        T, n_q, n_kv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        decoding = kv_cache is not None and kv_cache.prefilled
        fused_qkv = kv_cache.fused_qkv(self.layer_idx) if decoding else None
        if fused_qkv is not None:
            # Decode with the cache's concatenated [q; k; v] weight: one GEMM instead of three
            # (M = batch rows is small, so each projection alone is latency-bound).
            qkv = F.linear(x, *fused_qkv).view(T, n_q + 2 * n_kv, d)
            qk, v = pick(apply_rotary, self.fuse_elementwise)(qkv[:, : n_q + n_kv], cos, sin), qkv[:, n_q + n_kv :]
            return qk[:, :n_q], qk[:, n_q:], v
        q, k, v = shared_input_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.view(T, n_q, d), k.view(T, n_kv, d), v.view(T, n_kv, d)
        rotary = pick(apply_rotary, self.fuse_elementwise)
        if not decoding:
            return rotary(q, cos, sin), rotary(k, cos, sin), v
        # Decode: rotate q and k as one [B, Hq + Hkv, D] tensor, one set of elementwise kernels
        # instead of two (a decode step is launch-bound); q and k are views of it.
        qk = rotary(torch.cat((q, k), dim=1), cos, sin)
        return qk[:, :n_q], qk[:, n_q:], v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: PackedBatch, kv_cache: KVCache | None) -> Tensor:
        """x [T, H] -> [T, H]; cos/sin [T, head_dim]."""
        T = x.shape[0]
        q, k, v = self.rotated_qkv(x, cos, sin, kv_cache)
        kv_index = self.kv_index(x.device)
        if kv_cache is None and batch.shared_prefix is not None:
            if self.sliding_window is not None:
                raise ValueError(f"layer {self.layer_idx}: a sliding window ({self.sliding_window}) cannot attend "
                                 "over shared prefixes; run the call with share_prompts: false")
            out = shared_prefix_attention(q, k, v, batch, self.backend, kv_index)
        elif kv_cache is None:
            out = packed_attention(q, k, v, batch, self.backend, self.sliding_window, kv_index)
        elif not kv_cache.prefilled:
            out = kv_cache.prefill(self.layer_idx, q, k, v, batch, self.backend, self.sliding_window, kv_index)
        else:
            out = kv_cache.decode(self.layer_idx, q, k, v, self.sliding_window, kv_index)
        return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.intermediate_size
        self.gate_proj = Linear(h, f, bias=False, device=device)
        self.up_proj = Linear(h, f, bias=False, device=device)
        self.down_proj = Linear(f, h, bias=False, device=device)
        self.fuse_elementwise = False

    def forward(self, x: Tensor) -> Tensor:
        gate, up = shared_input_linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(pick(swiglu, self.fuse_elementwise)(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, spec: ModelSpec, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.self_attn = Attention(spec, layer_idx, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.mlp = MLP(spec, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: PackedBatch, kv_cache: KVCache | None) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)
        norm = self.post_attention_layernorm
        if norm.fuse_elementwise:  # the residual add and the norm in one kernel
            x, normed = fused(add_rms_norm)(x, attended, norm.weight, norm.eps)
        else:
            x = x + attended
            normed = norm(x)
        decoding = kv_cache is not None and kv_cache.prefilled
        # A decode step may take the MLP from the cache's other weights (FP8 copies).
        mlp_out = kv_cache.decode_mlp(self.self_attn.layer_idx, normed) if decoding else None
        return x + (self.mlp(normed) if mlp_out is None else mlp_out)


class DecoderTrunk(nn.Module):
    """HF's `model.` prefix: embedding, decoder blocks keyed by global index, final norm."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (spec.vocab_size, spec.hidden_size)
        # On the meta device (how the engine builds shards) nn.Embedding's own normal_ init runs
        # torch's Python reference kernels, whose first use imports torch._dynamo: ~2 s of every
        # worker's start, for values that init_weights or a checkpoint replaces anyway.
        weight = torch.empty(shape, device=device) if torch.device(device or "cpu").type == "meta" else None
        self.embed_tokens: nn.Module | None = nn.Embedding(*shape, device=device, _weight=weight)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, i, device) for i in range(spec.n_layers)})
        self.norm: nn.Module | None = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)


def set_elementwise_fusion(model: nn.Module, on: bool) -> None:
    """Run the norms, rotary and SwiGLU gate of every block (and the final norm) fused or eager."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.fuse_elementwise = on


# ---- the model -------------------------------------------------------------------------------


def init_param_tensor(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """float32 CPU value of parameter `name` under `Transformer.init_weights(seed)`: norm weights
    1, biases 0, matrices normal(0, 0.02) from a generator seeded by (seed, name). Pass the FULL
    shape and slice to get a tp shard that equals the serial model's slice."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)


class Transformer(nn.Module):
    """Actor (`lm_head`, or the embedding when tied) or critic (`score`, one value per token).

    A pipeline stage is this class with layers dropped (`keep_layers`). `embeds_tokens` says
    whether the embedding embeds the input (False on a tied actor's last stage, which keeps the
    embedding only as its head).
    """

    def __init__(self, spec: ModelSpec, critic: bool = False, device: torch.device | str | None = None) -> None:
        super().__init__()
        rope_inv_freq(spec)  # fail at construction on an unsupported rope_scaling, naming the field
        self.spec = spec
        self.critic = critic
        self.model = DecoderTrunk(spec, device)
        self.lm_head: nn.Module | None = None
        self.score: nn.Module | None = None
        if critic:
            self.score = Linear(spec.hidden_size, 1, bias=False, device=device)
        elif not spec.tie_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, device=device)
        self.embeds_tokens = True
        # rope_inv_freq per device, computed on first use: it is ~20 small kernels that
        # every forward (every decode step) would otherwise repeat. float32 [head_dim/2].
        self.inv_freq_by_device: dict[torch.device, Tensor] = {}

    def rope_inv_freq(self, device: torch.device) -> Tensor:
        """`rope_inv_freq(self.spec, device)`, cached per device (values depend on the spec only)."""
        inv_freq = self.inv_freq_by_device.get(device)
        if inv_freq is None:
            inv_freq = self.inv_freq_by_device[device] = rope_inv_freq(self.spec, device)
        return inv_freq

    # ---- structure -----------------------------------------------------------------------------
    @property
    def has_embedding(self) -> bool:
        """The forward takes token ids (first pipeline stage)."""
        return self.model.embed_tokens is not None and self.embeds_tokens

    @property
    def has_head(self) -> bool:
        """The forward returns logits / values (last pipeline stage)."""
        if self.model.norm is None:
            return False
        if self.critic:
            return self.score is not None
        return self.lm_head is not None or (self.spec.tie_embeddings and self.model.embed_tokens is not None)

    @property
    def layer_indices(self) -> list[int]:
        return [int(i) for i in self.model.layers]

    def keep_layers(self, start: int, end: int, first: bool, last: bool) -> None:
        """Turn this module into the pipeline stage holding blocks [start, end).

        first: keeps the embedding; last: keeps the final norm and head (a tied actor's last
        stage also keeps the embedding, as its head, per planning.models.stages_holding).
        """
        if not 0 <= start < end <= self.spec.n_layers:
            raise ValueError(f"keep_layers: [{start}, {end}) not a non-empty range of n_layers={self.spec.n_layers}")
        for idx in list(self.model.layers):
            if not start <= int(idx) < end:
                del self.model.layers[idx]
        tied_head = last and self.spec.tie_embeddings and not self.critic
        if not first and not tied_head:
            self.model.embed_tokens = None
        self.embeds_tokens = first
        if not last:
            self.model.norm, self.lm_head, self.score = None, None, None

    def set_attention_backend(self, backend: str) -> None:
        """Force an attention backend ("auto", "varlen", "flash", "sdpa") on every layer."""
        for layer in self.model.layers.values():
            layer.self_attn.backend = backend

    # ---- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: matrices normal(0, 0.02), biases 0, norm weights 1.

        Each tensor draws from its own CPU generator seeded by (seed, parameter name), so the
        values do not depend on the device, on which other layers the module holds (pipeline
        stages match the full model) or on the order of initialisation. Works after `to_empty`.
        """
        for name, param in self.named_parameters():
            param.copy_(init_param_tensor(name, tuple(param.shape), seed))

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: Tensor, batch: PackedBatch, kv_cache: KVCache | None = None,
                head_indices: Tensor | None = None) -> Tensor:
        """x: ids [T] (long) or hidden [T, H]; returns hidden [T, H], logits [T, V_local] or values [T].

        head_indices (int64 [N]): on a module with the head, apply norm and head only to these
        token positions and return [N, V_local] / [N]. A prefill needs just each prompt's last
        token: the full [T, V] logits of a long packed prompt batch would cost gigabytes.
        """
        if self.has_embedding:
            if x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"x: dtype {x.dtype}; the first stage takes token ids (int64 [T])")
            hidden = self.model.embed_tokens(x)
        else:
            hidden = x
        # Decode steps take positions from the cache (one token per sequence, at its length);
        # decided before the layers, whose prefill's `advance` below marks the cache prefilled.
        decoding = kv_cache is not None and kv_cache.prefilled
        positions = kv_cache.lengths if decoding else batch.positions
        # One cos/sin [T, head_dim] per forward, shared by every layer.
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq(hidden.device), hidden.dtype)
        for layer in self.model.layers.values():
            hidden = layer(hidden, cos, sin, batch, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(batch)
        if not self.has_head:
            return hidden
        if batch.shared_prefix is not None and kv_cache is None:
            # Each row's first suffix token is predicted from its group's last prefix token:
            # those rows again after the stream, [T_c + B, H] (actors.engine.shared_prefix).
            hidden = torch.cat([hidden, hidden[batch.shared_prefix.head_rows]])
        if head_indices is not None:
            hidden = hidden[head_indices]
        hidden = self.model.norm(hidden)
        if self.critic:
            return self.score(hidden).squeeze(-1).float()
        # A decode step may take the head from the cache's FP8 copies; a prefill keeps its own.
        logits = kv_cache.decode_head(hidden) if decoding else None
        if logits is not None:
            return logits
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)


__all__ = ["Attention", "DecoderLayer", "DecoderTrunk", "MLP", "RMSNorm", "Transformer", "add_rms_norm",
           "init_param_tensor", "rms_norm", "set_elementwise_fusion", "swiglu"]
