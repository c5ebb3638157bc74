"""The cached decode step of a generation loop: one model forward over a fixed KV cache, eager or
replaying a captured CUDA graph (optionally through torch.compile).

    step = DecodeStep(model, cache, use_cuda_graph=True, compile_model=True)
    logits = step(tokens, attend_len)   # [B, V_local]

Tried and not kept: splitting the step's rows into two "lanes" captured on two forked CUDA
streams, so that one lane's attention (memory-bound) could overlap the other's matmuls
(compute-bound). At the peer bench's 512 rows it decoded 18% slower (docs/benchmarks.md, issue
27, fifth step); likely because each kernel of a step already fills the GPU, so the lanes'
kernels queue rather than overlap, while the half-size matmuls run less efficiently.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from actors.engine import PackedBatch
from actors.generation.kv_cache import HeadMajorKVCache
from actors.kernels import sm_count


def parameter_key(model: nn.Module) -> tuple[int, ...]:
    """data_ptr() of every parameter: changes when reallocation moves the weights."""
    return tuple(p.data_ptr() for p in model.parameters())


class DecodeStep:
    """One decode forward over a fixed KV cache: eager, or replaying a captured CUDA graph.

    A graph reads `static_input` ([B] token ids, or [B, H] hidden states on later pipeline
    stages) and the cache at fixed addresses, writes the new K/V at `cache.lengths`, advances the
    lengths and leaves logits [B, V_local] (or hidden [B, H]) in its static output. One graph per
    attention length bucket, captured on first use; all are dropped (and re-captured lazily)
    when the parameters' addresses change or after `invalidate()`.
    """

    def __init__(self, model: nn.Module, cache: HeadMajorKVCache, use_cuda_graph: bool,
                 compile_model: bool = False, warmups: int = 2, dynamic_rows: bool = False) -> None:
        self.model = model
        self.warmups = warmups  # forward runs before each capture (capture())
        # torch.compile'd forward for decode (same parameters; the wrapper only changes kernels).
        self.forward = torch.compile(model) if compile_model else model
        # With dynamic_rows the first trace already has the row count symbolic: a call that will
        # drop finished rows (actors.generation.compaction) compiles once instead of twice.
        self.dynamic_rows = dynamic_rows and compile_model
        if compile_model and cache.lengths.device.type == "cuda":
            sm_count(cache.lengths.device)  # cached now, so the trace reads it (no guard that fails next call)
        self.cache = cache
        self.batch = cache.decode_batch()  # positions come from cache.lengths during decode
        self.use_cuda_graph = use_cuda_graph and cache.lengths.device.type == "cuda"
        device = cache.lengths.device
        if getattr(model, "has_embedding", True):
            self.static_input = torch.zeros(cache.n_seqs, dtype=torch.int64, device=device)
        else:
            param = next(model.parameters())
            self.static_input = torch.zeros(cache.n_seqs, model.spec.hidden_size, dtype=param.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # attend_len -> (graph, output)
        self.key: tuple[int, ...] = ()
        self._mark_dynamic()

    def _mark_dynamic(self) -> None:
        """Under torch.compile, mark what the trace keeps symbolic: the cache's slot count always,
        the row count with dynamic_rows (a for_cache step: as its first step's trace)."""
        if self.forward is self.model:
            return
        if self.dynamic_rows:
            mark_rows_dynamic(self.static_input, self.batch, self.cache)
        mark_slots_dynamic(self.cache)

    def for_cache(self, cache: HeadMajorKVCache) -> DecodeStep:
        """The same step over another cache (one with fewer rows: actors.generation.compaction),
        sharing this step's compiled forward; its graphs are captured afresh, after one warm-up run
        (the forward's compile and kernel choices are made; the run sizes the new row count)."""
        step = DecodeStep(self.model, cache, self.use_cuda_graph, warmups=1)
        step.forward = self.forward
        step.dynamic_rows = self.dynamic_rows
        step._mark_dynamic()
        return step

    def invalidate(self) -> None:
        """Drop the captured graphs (the next call re-captures)."""
        self.graphs.clear()

    def __call__(self, x: Tensor, attend_len: int | None = None) -> Tensor:
        """x: tokens int64 [B] (first stage) or hidden [B, H]; returns logits/hidden [B, ...].
        attend_len: cache slots decode attention reads (default: all)."""
        self.cache.set_attend_len(attend_len or self.cache.max_len)
        if not self.use_cuda_graph:
            if self.cache.qkv is not None:
                self.cache.qkv.refresh()  # weights moved since the last step: re-concatenate
            if self.dynamic_rows:
                torch._dynamo.maybe_mark_dynamic(x, 0)  # eager steps pass their own input
            return self.forward(x, self.batch, self.cache)
        if parameter_key(self.model) != self.key:
            self.invalidate()
            if self.cache.qkv is not None:
                self.cache.qkv.refresh()
            self.key = parameter_key(self.model)
        if self.cache.attend_len not in self.graphs:
            self.graphs[self.cache.attend_len] = self.capture()
        graph, output = self.graphs[self.cache.attend_len]
        self.static_input.copy_(x)
        graph.replay()
        return output

    def capture(self) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        saved_lengths = self.cache.lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Warm-up runs (compile, lazy buffers, kernel selection) outside the capture; each
            # writes the slot the next real step overwrites anyway, and the lengths are put back.
            for _ in range(self.warmups):
                self.forward(self.static_input, self.batch, self.cache)
                self.cache.lengths.copy_(saved_lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self.forward(self.static_input, self.batch, self.cache)
        self.cache.lengths.copy_(saved_lengths)
        return graph, output


def mark_rows_dynamic(step_input: Tensor, batch: PackedBatch, cache: HeadMajorKVCache) -> None:
    """Ask torch.compile to trace a decode step's row count symbolically: dim 0 of its input, of
    its batch's boundaries and positions, and of the cache's per-row tensors. Without it dynamo
    specialises the first call's row count and, once compaction changes it, recompiles the step
    with the count symbolic (automatic dynamic shapes): a second full compile. `maybe_mark_dynamic`:
    where the model needs a concrete count, dynamo specialises instead of failing."""
    for tensor in (step_input, batch.cu_seqlens, batch.positions, *cache.row_tensors()):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def mark_slots_dynamic(cache: HeadMajorKVCache) -> None:
    """Ask torch.compile to trace the cache's slot count (max_len: the call's longest prompt plus
    its new tokens) symbolically. Two calls of a run rarely share their longest prompt, and pipeline
    micro-batches of one call rarely do; without it the second such step recompiles (automatic
    dynamic shapes), a second full compile of the decode step."""
    for tensor, dim in cache.slot_dims():
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


__all__ = ["DecodeStep", "mark_rows_dynamic", "mark_slots_dynamic", "parameter_key"]
