"""The cached decode step of a generation loop: one model forward over a fixed KV cache, eager or
replaying a captured CUDA graph (optionally through torch.compile), split into lanes.

Why lanes: at a few hundred rows a decode step is two different kinds of work done one after
the other: the projections and the head (matmuls of [rows, hidden] by the weights, compute-bound
once rows pass the matmul ridge, ~183 on an H200) and the attention (each row reads its own
cached K/V, memory-bound at any batch size). On one stream the GPU does one kind at a time and
the two add up. A step split into lanes, groups of rows each run as its own forward on its own
CUDA stream inside one captured graph, lets the scheduler put one lane's attention beside
another lane's matmuls. Each lane is a `KVCache.row_slice` view of the cache, so lanes write
into the same buffers and the lengths advance exactly as in one forward; the logits are the
lanes' outputs in row order. Without a CUDA graph the lanes run one after the other (same
results: CPU tests check the slicing that way).

    step = DecodeStep(model, cache, use_cuda_graph=True, compile_model=True, lanes=2)
    logits = step(tokens, attend_len)   # [B, V_local]; rows in order
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from actors.engine import KVCache, PackedBatch


def parameter_key(model: nn.Module) -> tuple[int, ...]:
    """data_ptr() of every parameter: changes when reallocation moves the weights."""
    return tuple(p.data_ptr() for p in model.parameters())


def lane_bounds(n_seqs: int, lanes: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of each of `lanes` lanes over n_seqs rows, sizes differing by at most
    one (at most n_seqs lanes)."""
    lanes = max(1, min(lanes, n_seqs))
    cuts = [n_seqs * i // lanes for i in range(lanes + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class DecodeStep:
    """One decode forward over a fixed KV cache: eager, or replaying a captured CUDA graph.

    A graph reads `static_input` ([B] token ids, or [B, H] hidden states on later pipeline
    stages) and the cache at fixed addresses, writes the new K/V at `cache.lengths`, advances the
    lengths and leaves logits [B, V_local] (or hidden [B, H]) in its static output. One graph per
    attention length bucket, captured on first use; all are dropped (and re-captured lazily)
    when the parameters' addresses change or after `invalidate()`.

    lanes: row groups run side by side (module docstring). The lanes' caches are made on the
    first call, after the generation call has set the cache's fused weights.
    """

    def __init__(self, model: nn.Module, cache: KVCache, use_cuda_graph: bool, compile_model: bool = False,
                 lanes: int = 1) -> None:
        self.model = model
        # torch.compile'd forward for decode (same parameters; the wrapper only changes kernels).
        self.forward = torch.compile(model) if compile_model else model
        self.cache = cache
        self.use_cuda_graph = use_cuda_graph and cache.lengths.device.type == "cuda"
        self.bounds = lane_bounds(cache.n_seqs, lanes)
        self.lanes: list[tuple[KVCache, PackedBatch]] = []  # (cache view, decode batch) per lane
        self.streams: list[torch.cuda.Stream] = []  # one per lane, made at the first capture
        device = cache.lengths.device
        if getattr(model, "has_embedding", True):
            self.static_input = torch.zeros(cache.n_seqs, dtype=torch.int64, device=device)
        else:
            param = next(model.parameters())
            self.static_input = torch.zeros(cache.n_seqs, model.spec.hidden_size, dtype=param.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # attend_len -> (graph, output)
        self.key: tuple[int, ...] = ()

    @property
    def n_lanes(self) -> int:
        return len(self.bounds)

    def invalidate(self) -> None:
        """Drop the captured graphs (the next call re-captures)."""
        self.graphs.clear()

    def __call__(self, x: Tensor, attend_len: int | None = None) -> Tensor:
        """x: tokens int64 [B] (first stage) or hidden [B, H]; returns logits/hidden [B, ...].
        attend_len: cache slots decode attention reads (default: all)."""
        if not self.lanes:
            self.lanes = self.lane_caches()
        for cache, _ in self.lanes:
            cache.set_attend_len(attend_len or self.cache.max_len)
        qkv = getattr(self.cache, "qkv", None)
        if not self.use_cuda_graph:
            if qkv is not None:
                qkv.refresh()  # weights moved since the last step: re-concatenate
            return self.run_lanes(x)
        if parameter_key(self.model) != self.key:
            self.invalidate()
            if qkv is not None:
                qkv.refresh()
            self.key = parameter_key(self.model)
        graph_key = self.lanes[0][0].attend_len
        if graph_key not in self.graphs:
            self.graphs[graph_key] = self.capture()
        graph, output = self.graphs[graph_key]
        self.static_input.copy_(x)
        graph.replay()
        return output

    def lane_caches(self) -> list[tuple[KVCache, PackedBatch]]:
        """Each lane's cache (the whole cache for one lane, else row views) and decode batch."""
        if self.n_lanes == 1:
            return [(self.cache, self.cache.decode_batch())]
        views = [self.cache.row_slice(start, stop) for start, stop in self.bounds]
        return [(view, view.decode_batch()) for view in views]

    def run_lanes(self, x: Tensor) -> Tensor:
        """The lanes' forwards one after the other on the current stream; outputs in row order."""
        outs = [self.forward(x[start:stop], batch, cache)
                for (start, stop), (cache, batch) in zip(self.bounds, self.lanes)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def fork_lanes(self) -> list[Tensor]:
        """Each lane's forward on its own stream, after the work queued on the current stream;
        the current stream then waits for all of them (captured, this is a fork and a join)."""
        origin = torch.cuda.current_stream()
        outs = []
        for (start, stop), (cache, batch), stream in zip(self.bounds, self.lanes, self.streams):
            stream.wait_stream(origin)
            with torch.cuda.stream(stream):
                outs.append(self.forward(self.static_input[start:stop], batch, cache))
        for stream in self.streams:
            origin.wait_stream(stream)
        return outs

    def capture(self) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if not self.streams:
            self.streams = [torch.cuda.Stream() for _ in self.bounds]
        saved_lengths = self.cache.lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Warm-up runs on the lanes' own streams (lazy buffers, kernel selection, each
            # stream's matmul workspace); each writes the slot the next real step overwrites
            # anyway, and the lengths are put back.
            for _ in range(2):
                self.fork_lanes()
                self.cache.lengths.copy_(saved_lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = self.fork_lanes()
            output = outs[0] if len(outs) == 1 else torch.cat(outs)
        self.cache.lengths.copy_(saved_lengths)
        return graph, output


__all__ = ["DecodeStep", "lane_bounds", "parameter_key"]
