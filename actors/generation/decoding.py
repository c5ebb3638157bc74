"""The pieces a decode loop is built from: what to generate, the recorded output, the memory
check and the prefilled cache (the decode step itself is actors.generation.decode_step).

`actors.generation.loop` runs them as one serial loop and `actors.generation.pipelined` as
micro-batches circulating through pipeline stages; both import this module, neither imports the
other's loop (the generation package's docstring has the order).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from actors.engine import PackedBatch, pack_sequences
from actors.generation.fp8_weights import Fp8DecodeWeights
from actors.generation.kv_cache import DECODE_KERNELS, FusedQKV, HeadMajorKVCache
from actors.generation.sampling import SampledTokens, SamplingParams, step_uniforms

# GenerationConfig.kv_cache_dtype -> the cache's dtype (None: the model's own).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. eos_token_id None (or ignore_eos) runs every sequence to max_new_tokens.

    pp_micro_batches: sequence groups circulating through pipeline stages (default: pp).
    memory_limit_bytes: memory available to the call where the device cannot be asked (CPU);
    None skips the check there.
    attend_bucket: decode attention reads the cache up to the longest sequence rounded up to a
    multiple of this (one CUDA graph per bucket), not the whole max_len.
    decode_attention: "auto" (the Triton decode kernel on CUDA, else SDPA), "triton", "sdpa" or
    "matmul" (actors.generation.kv_cache).
    compile_decode: run the decode step through torch.compile (fuses the many small
    elementwise kernels of a step; compiles once per call and attention bucket shape).
    fuse_qkv: decode steps multiply by one concatenated [q; k; v] weight per layer (built once
    per call, `actors.generation.kv_cache.FusedQKV`; costs those weights' bytes for the call).
    fp8_weights: decode steps run the MLPs and the head with FP8 (e4m3) copies of their weights,
    quantized once per call (`actors.generation.fp8_weights`; one byte per weight for the call).
    The responses are then sampled from that model: the recorded logprobs are its own.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (e4m3, no scale: K/V are rounded to 3
    mantissa bits as they are cached and widened back as decode attention reads them; half the
    cache's bytes to hold and to read; the prefill attends its own prompt in full precision).
    compact_fraction: once the rows still generating are at most this fraction of the decode
    step's rows, the step drops the finished ones (`actors.generation.compaction`; under pp each
    micro-batch on its own); 0 keeps every row to the end. In [0, 1).
    compact_min_row_steps: a compaction waits until it drops at least this many row-steps (rows
    dropped x decode steps left); None: 4096 with CUDA graphs (each compaction captures a
    graph), else 0 (`actors.generation.compaction.min_row_steps`).
    compile_dynamic_rows: with compile_decode, trace the decode step with its row count symbolic
    from the first call, so that the smaller steps of compaction reuse that one compile instead
    of compiling a second time. None: where the call may compact (a stop token or a multi-turn
    call, and compact_fraction > 0), or where a pipeline's micro-batches hold unequal row counts
    (`actors.generation.compaction.rows_dynamic`).
    uniform_offset / uniform_total: these prompts are rows [uniform_offset, uniform_offset + B)
    of a batch of uniform_total sequences generated in rounds (None: B, this call alone); each
    sequence draws the random numbers it would draw in one call over the whole batch.
    """

    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    eos_token_id: int | None = None
    ignore_eos: bool = False
    pad_token_id: int = 0
    use_cuda_graph: bool = False
    pp_micro_batches: int | None = None
    memory_limit_bytes: int | None = None
    attend_bucket: int = 128
    decode_attention: str = "auto"
    compile_decode: bool = False
    fuse_qkv: bool = True
    fp8_weights: bool = False
    kv_cache_dtype: str = "auto"
    compact_fraction: float = 0.75
    compact_min_row_steps: int | None = None
    compile_dynamic_rows: bool | None = None
    uniform_offset: int = 0
    uniform_total: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"GenerationConfig.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.decode_attention not in DECODE_KERNELS:
            raise ValueError(f"GenerationConfig.decode_attention={self.decode_attention!r}: unknown; "
                             f"allowed: {', '.join(DECODE_KERNELS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"GenerationConfig.kv_cache_dtype={self.kv_cache_dtype!r}: unknown; "
                             f"allowed: {', '.join(KV_CACHE_DTYPES)}")
        if not 0.0 <= self.compact_fraction < 1.0:
            raise ValueError(f"GenerationConfig.compact_fraction={self.compact_fraction}: must be in [0, 1) "
                             "(0 keeps finished rows in the decode step)")
        if self.compact_min_row_steps is not None and self.compact_min_row_steps < 0:
            raise ValueError(f"GenerationConfig.compact_min_row_steps={self.compact_min_row_steps}: must be >= 0 "
                             "or None (4096 with CUDA graphs, else 0)")
        if self.attend_bucket < 1:
            raise ValueError(f"GenerationConfig.attend_bucket={self.attend_bucket}: must be >= 1")
        if self.pp_micro_batches is not None and self.pp_micro_batches < 1:
            raise ValueError(f"GenerationConfig.pp_micro_batches={self.pp_micro_batches}: must be >= 1 or None")
        if self.uniform_offset < 0 or (self.uniform_total is not None and self.uniform_total <= self.uniform_offset):
            raise ValueError(f"GenerationConfig.uniform_offset={self.uniform_offset}, uniform_total={self.uniform_total}: "
                             "need 0 <= offset < total")

    def step_uniforms(self, step: int, n_seqs: int, device: torch.device | str) -> Tensor | None:
        """float32 [n_seqs] random numbers of decode step `step` for this call's sequences (None
        when greedy): their rows of the draw for the whole batch (see uniform_offset)."""
        if self.sampling.greedy:
            return None
        total = self.uniform_total if self.uniform_total is not None else n_seqs
        if self.uniform_offset + n_seqs > total:
            raise ValueError(f"GenerationConfig: {n_seqs} prompts from row {self.uniform_offset} exceed "
                             f"uniform_total={total}")
        return step_uniforms(self.seed, step, total, device)[self.uniform_offset:self.uniform_offset + n_seqs]

    @property
    def stop_token(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


@dataclass(frozen=True)
class GenerationOutput:
    """Result of one `generate` call, B sequences, R = sum(response_lengths) response tokens.

    tokens: int64 [T] prompt then response of each sequence, packed; cu_seqlens int32 [B+1].
    prompt_lengths, response_lengths: int64 [B] (the response includes the EOS when emitted).
    logprobs: float32 [R] of each response token under the sampling distribution.
    kept_counts: int32 [R] size of the top-k/top-p set each token was sampled from, for
    `actors.generation.sampling.truncate_logits` on the train side; None when sampling did not truncate.
    no_eos: bool [B], True where the sequence hit max_new_tokens without emitting EOS.
    stats: seconds of the call's phases (actors.generation.loop.PhaseClock; empty where not timed).
    """

    tokens: Tensor
    cu_seqlens: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    logprobs: Tensor
    kept_counts: Tensor | None
    no_eos: Tensor
    sampling: SamplingParams
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def n_seqs(self) -> int:
        return self.prompt_lengths.numel()

    def packed_batch(self) -> PackedBatch:
        """Boundaries of the packed prompt+response sequences (for a forward over `tokens`)."""
        return PackedBatch.from_lengths((self.prompt_lengths + self.response_lengths).tolist(), self.tokens.device)

    def responses(self) -> list[Tensor]:
        """Response token ids of each sequence, int64 [response_length]."""
        seqs = torch.split(self.tokens, (self.prompt_lengths + self.response_lengths).tolist())
        return [seq[p:] for seq, p in zip(seqs, self.prompt_lengths.tolist())]

    def response_logprobs(self) -> list[Tensor]:
        return list(torch.split(self.logprobs, self.response_lengths.tolist()))

    def cpu(self) -> GenerationOutput:
        """The same output on the host (one copy per tensor; logprobs as float32)."""
        kept = self.kept_counts.cpu() if self.kept_counts is not None else None
        return replace(self, tokens=self.tokens.cpu(), cu_seqlens=self.cu_seqlens.cpu(),
                       prompt_lengths=self.prompt_lengths.cpu(), response_lengths=self.response_lengths.cpu(),
                       logprobs=self.logprobs.float().cpu(), kept_counts=kept, no_eos=self.no_eos.cpu())


# ---- bookkeeping of sampled tokens -----------------------------------------------------------


class ResponseRecorder:
    """Per-sequence response buffers [B, max_new_tokens] filled step by step (a mutable helper
    of one call; rows are global sequence indices, so pipeline micro-batches share one)."""

    def __init__(self, n_seqs: int, config: GenerationConfig, device: torch.device) -> None:
        self.config = config
        shape = (n_seqs, config.max_new_tokens)
        self.tokens = torch.full(shape, config.pad_token_id, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(shape, dtype=torch.float32, device=device)
        self.kept_counts = torch.zeros(shape, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(n_seqs, dtype=torch.int64, device=device)
        self.finished = torch.zeros(n_seqs, dtype=torch.bool, device=device)

    def record(self, rows: Tensor | None, step: int, sampled: SampledTokens) -> Tensor:
        """Store step `step` for sequences `rows` (int64 [b]; None: all B, in order); return the
        next decode input [b] (the sampled token, or the pad token for sequences already finished)."""
        if rows is None:
            return self.record_all(step, sampled)
        alive = ~self.finished[rows]
        self.tokens[rows, step] = torch.where(alive, sampled.tokens, self.tokens[rows, step])
        self.logprobs[rows, step] = sampled.logprobs.float()
        self.kept_counts[rows, step] = sampled.kept_counts
        self.lengths[rows] += alive.to(torch.int64)
        done = ~alive
        stop = self.config.stop_token
        if stop is not None:
            done |= sampled.tokens == stop
        self.finished[rows] = done | (self.lengths[rows] >= self.config.max_new_tokens)
        return torch.where(alive, sampled.tokens, torch.full_like(sampled.tokens, self.config.pad_token_id))

    def record_all(self, step: int, sampled: SampledTokens) -> Tensor:
        """`record` for every sequence, with in-place column writes instead of gathers and
        scatters by row index (about half the kernels of a step's bookkeeping)."""
        # A finished row's slot `step` still holds the pad token, so the stored token and the
        # next decode input are the same [B] tensor.
        next_input = torch.where(self.finished, self.config.pad_token_id, sampled.tokens)
        self.lengths += ~self.finished  # before `finished` changes: only live rows grow
        self.tokens[:, step] = next_input
        self.logprobs[:, step] = sampled.logprobs
        self.kept_counts[:, step] = sampled.kept_counts
        stop = self.config.stop_token
        if stop is not None:
            self.finished |= sampled.tokens == stop
        self.finished |= self.lengths >= self.config.max_new_tokens
        return next_input

    def all_finished(self, rows: Tensor | None = None) -> bool:
        return bool(self.finished.all() if rows is None else self.finished[rows].all())

    def output(self, prompts: list[Tensor], prompt_tokens: Tensor) -> GenerationOutput:
        """Assemble the packed output (one host sync for the lengths)."""
        new = torch.arange(self.config.max_new_tokens, device=self.lengths.device)
        keep = new[None, :] < self.lengths[:, None]  # [B, max_new]: row-major = packed order
        prompt_lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.int64, device=self.lengths.device)
        responses = torch.split(self.tokens[keep], self.lengths.tolist())
        prompt_split = torch.split(prompt_tokens, prompt_lengths.tolist())
        tokens = torch.cat([piece for pair in zip(prompt_split, responses) for piece in pair])
        total = prompt_lengths + self.lengths
        cu = torch.zeros(len(prompts) + 1, dtype=torch.int32, device=tokens.device)
        cu[1:] = torch.cumsum(total, 0).to(torch.int32)
        stop = self.config.stop_token
        last = self.tokens.gather(1, (self.lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        ended_by_eos = (last == stop) if stop is not None else torch.zeros_like(self.finished)
        truncating = self.config.sampling.truncates
        return GenerationOutput(
            tokens=tokens, cu_seqlens=cu, prompt_lengths=prompt_lengths, response_lengths=self.lengths.clone(),
            logprobs=self.logprobs[keep], kept_counts=self.kept_counts[keep] if truncating else None,
            no_eos=~ended_by_eos, sampling=self.config.sampling,
        )


# ---- memory ------------------------------------------------------------------------------------


def kv_cache_bytes(model: nn.Module, n_seqs: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the K and V caches of every attention layer `model` holds."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_token = sum(2 * layer.self_attn.n_kv_heads * layer.self_attn.head_dim for layer in model.model.layers.values())
    return n_seqs * max_len * per_token * itemsize


def logits_bytes(n_prompt_tokens: int, n_seqs: int, vocab_local: int, vocab_full: int, itemsize: int) -> int:
    """Bytes of the prefill logits [T, V_local] plus the float32 sampling work on [B, V] (scaled
    and sorted values, int64 order, log-probabilities, cdf: about 24 bytes per entry)."""
    return n_prompt_tokens * vocab_local * itemsize + n_seqs * vocab_full * 24


def check_memory(needed: dict[str, int], device: torch.device, limit_bytes: int | None) -> None:
    """Raise MemoryError naming the bytes needed (by part) and available, before allocating."""
    if device.type == "cuda":
        # Free device memory plus what PyTorch's caching allocator holds but no tensor uses.
        cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        available = torch.cuda.mem_get_info(device)[0] + cached_free
    elif limit_bytes is not None:
        available = limit_bytes
    else:
        return
    total = sum(needed.values())
    if total > available:
        parts = ", ".join(f"{name} {nbytes:,}" for name, nbytes in needed.items())
        raise MemoryError(f"generation needs {total:,} bytes ({parts}) but {available:,} bytes are available "
                          f"on {device}; use fewer prompts, shorter max_new_tokens or more tensor/pipeline parallelism")


def local_vocab(model: nn.Module) -> int:
    """Vocabulary rows of this shard's head (vocab-parallel under tp)."""
    # A tied head under tp (TiedVocabParallelHead) owns no weight: the table is the embedding's.
    weight = getattr(model.lm_head, "weight", None) if model.lm_head is not None else None
    if weight is None:
        weight = model.model.embed_tokens.weight
    return int(weight.shape[0])


def attend_length(max_prompt: int, n_generated: int, config: GenerationConfig, max_len: int) -> int:
    """Cache slots a decode step must read: the longest sequence after appending its input token
    (max_prompt + n_generated + 1), rounded up to the bucket, at most max_len."""
    needed = max_prompt + n_generated + 1
    return min(max_len, -(-needed // config.attend_bucket) * config.attend_bucket)


# ---- the single-stage loop ----------------------------------------------------------------------


def prepare_cache(model: nn.Module, prompts: list[Tensor], config: GenerationConfig,
                  device: torch.device, count_fused: bool = True) -> tuple[Tensor, PackedBatch, HeadMajorKVCache]:
    """Pack the prompts, check memory, allocate the cache (n_seqs x (max_prompt + max_new)).
    count_fused: include the call's fused [q; k; v] weights (once per call) in the check."""
    if not prompts:
        raise ValueError("prompts: empty; need at least one prompt")
    empty = [i for i, p in enumerate(prompts) if p.dim() != 1 or p.numel() == 0]
    if empty:
        raise ValueError(f"prompts {empty}: every prompt must be a non-empty 1-D token tensor")
    tokens, batch = pack_sequences([p.to(torch.int64) for p in prompts], device)
    max_len = batch.max_seqlen + config.max_new_tokens
    param = next(model.parameters())
    cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or param.dtype
    needed = {"kv_cache": kv_cache_bytes(model, len(prompts), max_len, cache_dtype)}
    if config.fuse_qkv and count_fused:
        needed["fused_qkv"] = FusedQKV.nbytes(model)
    if config.fp8_weights and count_fused:
        needed["fp8_weights"] = Fp8DecodeWeights.nbytes(model)
    if getattr(model, "has_head", True):
        vocab_local = local_vocab(model)
        needed["logits"] = logits_bytes(batch.n_tokens, len(prompts), vocab_local, model.spec.vocab_size,
                                        param.element_size())
    check_memory(needed, device, config.memory_limit_bytes)
    cache = HeadMajorKVCache.for_model(model, len(prompts), max_len, cache_dtype, device=device,
                                       kernel=config.decode_attention)
    return tokens, batch, cache


__all__ = [
    "GenerationConfig", "GenerationOutput", "ResponseRecorder", "attend_length", "check_memory",
    "kv_cache_bytes", "logits_bytes", "prepare_cache",
]
