"""Batched generation with a static KV cache: packed prefill, decode loop, per-sequence stopping.

    out = generate(model, prompts, GenerationConfig(max_new_tokens=64, eos_token_id=2), groups)

`model` is a `Transformer` (or its tensor-parallel shard; pipeline stages go through
actors.generation.pipelined, which `generate` dispatches to when groups.layout.pp > 1). Prompts are 1-D
token tensors of different lengths. The call:
1. checks that the KV cache (n_seqs x (max_prompt + max_new_tokens) per layer), the fused
   [q; k; v] weights and the logits fit in free memory, failing with the bytes needed and
   available before allocating anything;
2. prefills all prompts packed (varlen attention), writing K/V into the cache; rows that hold
   the same prompt tensor (samples of one prompt) share one forward (actors.generation.prefill);
3. decodes one token per sequence per step until every sequence has emitted EOS or
   max_new_tokens tokens. Finished sequences keep a fixed slot in the (static-shape) step, but
   their tokens are ignored, until the live ones fall to `compact_fraction` of the step's rows:
   the step then drops the finished ones (actors.generation.compaction). The loop ends when all
   are done. The host reads the count of live rows after it has queued the next step
   (`FinishedFlag`), so the device never idles for the check; the step queued after the last
   token is discarded;
4. frees the cache and returns a frozen `GenerationOutput` (packed prompt+response ids,
   logprobs and top-k/top-p kept counts per response token, response lengths, no-EOS mask, and
   the seconds of its phases, `PhaseClock`).

On CUDA with `use_cuda_graph` the decode step (the model forward over the cache) is captured as a
CUDA graph within the call; sampling (a fused kernel for greedy and untruncated sampling, see
actors.kernels.fused_sampling) runs eagerly after it. With the default Triton decode attention one
graph serves every step (the kernel reads each sequence's own length); with "sdpa"/"matmul" there
is one graph per attention-length bucket (the cache read up to the longest sequence, rounded up to
`attend_bucket` slots). `DecodeStep` re-captures (and re-concatenates the fused [q; k; v]
weights) whenever the parameters' data_ptr()s change (weights moved by reallocation) or after
`invalidate()`. `compile_decode` adds torch.compile under the graph, which fuses the many small
elementwise kernels of a step (1.4x on an H200, docs/benchmarks.md).
The cache is `actors.generation.kv_cache.HeadMajorKVCache` (head-major K/V, GQA folded into the query axis).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from actors.engine import ParallelGroups
from actors.generation.compaction import RowCompactor, rows_dynamic
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import (
    GenerationConfig,
    GenerationOutput,
    ResponseRecorder,
    attend_length,
    prepare_cache,
)
from actors.generation.kv_cache import decode_weight_copies
from actors.generation.pipelined import generate_pipelined
from actors.generation.prefill import prefill
from actors.generation.sampling import sample_tensor_parallel


@torch.no_grad()
def generate(model: nn.Module, prompts: list[Tensor], config: GenerationConfig,
             groups: ParallelGroups | None = None) -> GenerationOutput:
    """Generate for prompts (1-D int token tensors); see the module docstring.

    groups: this rank's process groups (tp ranks of one pipeline call it with the same prompts);
    None runs serially. With groups.layout.pp > 1, `model` is this rank's pipeline stage.
    The output's `stats` hold the call's phases in seconds (`PhaseClock`), "decode_steps" and
    "compactions" (times the step dropped finished rows).
    """
    if groups is not None and groups.layout.pp > 1:
        return generate_pipelined(model, prompts, config, groups)
    tp_group = groups.tp_group if groups is not None else None
    device = next(model.parameters()).device
    clock = PhaseClock(device)
    prompt_tokens, batch, cache = prepare_cache(model, prompts, config, device)
    recorder = ResponseRecorder(len(prompts), config, device)
    logits = prefill(model, prompts, prompt_tokens, batch, cache)  # [B, V_local]; each distinct prompt once
    clock.mark("prefill")
    cache.qkv, cache.fp8 = decode_weight_copies(model, config.fuse_qkv, config.fp8_weights)
    decode = DecodeStep(model, cache, config.use_cuda_graph, config.compile_decode,
                        dynamic_rows=rows_dynamic(config, config.stop_token is not None))
    finished = FinishedFlag(device) if config.stop_token is not None else None
    compactor = RowCompactor(len(prompts), config)
    steps = 0
    for step in range(config.max_new_tokens):
        uniforms = config.step_uniforms(step, len(prompts), device)
        if uniforms is not None and compactor.active is not None:
            uniforms = uniforms[compactor.active]  # each row keeps the draws of its global row
        sampled = sample_tensor_parallel(logits, config.sampling, uniforms, tp_group)
        next_tokens = recorder.record(compactor.active, step, sampled)
        if step + 1 == config.max_new_tokens:
            break
        compacting = finished is not None and compactor.due(finished.live, config.max_new_tokens - step - 1)
        if compacting:
            compact_started = time.perf_counter()
            keep = compactor.compact(recorder.finished, cache)  # the step's live rows, moved to the front
            if keep is None:
                break
            next_tokens = next_tokens[keep]
            decode = decode.for_cache(cache)
        if finished is not None:
            finished.snapshot(recorder.finished)  # asynchronous: read after the next step is queued
        if step == 0 and device.type == "cuda":
            torch.cuda.synchronize(device)  # so that capture_s leaves out the prefill still running
        started = time.perf_counter()
        logits = decode(next_tokens, attend_length(batch.max_seqlen, step, config, cache.max_len))
        steps += 1
        if step == 0:  # compile on first use, warm-up runs and graph capture
            clock.totals["capture_s"] += time.perf_counter() - started
        elif compacting:  # the rows' move and the new step's first call (its graph's capture)
            clock.totals["compact_s"] += time.perf_counter() - compact_started
        # The device runs the step just queued while the host waits for the flag; when every
        # sequence has finished, that one step's logits go unused.
        if finished is not None and clock.timed_wait(finished.all_set):
            break
    clock.mark("decode")
    del decode, cache  # the cache (and a captured graph's pool) is freed with the call
    out = recorder.output(prompts, prompt_tokens)
    stats = {**clock.seconds(), "decode_steps": float(steps), "compactions": float(compactor.compactions)}
    return dataclasses.replace(out, stats=stats)


class FinishedFlag:
    """How many sequences are still generating, copied to the host without stopping the device:
    the copy goes into page-locked memory behind the step that set it, and `all_set` waits for
    that copy alone (work queued after it keeps running). `live` is the count it last read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=self.cuda)
        self.copied = torch.cuda.Event() if self.cuda else None
        self.count: Tensor | None = None
        self.live: int | None = None

    def snapshot(self, finished: Tensor) -> None:
        """finished: bool [B] on the device."""
        self.count = (~finished).sum().reshape(1)
        if self.copied is not None:
            self.host.copy_(self.count, non_blocking=True)
            self.copied.record()

    def all_set(self) -> bool:
        if self.copied is None:
            self.live = int(self.count)
        else:
            self.copied.synchronize()
            self.live = int(self.host[0])
        return self.live == 0


class PhaseClock:
    """Seconds of a generation call's phases: "prefill_s" (cache allocation and the packed
    prefill) and "decode_s" (the decode loop, sampling and graph capture included) as device time
    between CUDA events (host time on CPU, where every op is synchronous), "capture_s" (host
    seconds of the first decode step: compile on first use and graph capture), "compact_s" (host
    seconds of the compactions, each from the decision to the return of the smaller step's first
    call, which captures its graph), "sync_wait_s" (host seconds blocked reading the finished
    flag: the share of the loop the device sets the pace of). One event pair per phase, read
    once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, torch.cuda.Event | float]] = [("start", self._now())]
        self.totals: dict[str, float] = {"capture_s": 0.0, "compact_s": 0.0, "sync_wait_s": 0.0}

    def _now(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        """End of `phase` (which began at the previous mark)."""
        self.marks.append((phase, self._now()))

    def timed_wait(self, wait: Callable[[], bool]) -> bool:
        started = time.perf_counter()
        result = wait()
        self.totals["sync_wait_s"] += time.perf_counter() - started
        return result

    def seconds(self) -> dict[str, float]:
        """Every phase's seconds (synchronises with the device once)."""
        out = dict(self.totals)
        if self.cuda:
            self.marks[-1][1].synchronize()
        for (_, begin), (phase, end) in zip(self.marks, self.marks[1:]):
            out[f"{phase}_s"] = begin.elapsed_time(end) / 1e3 if self.cuda else end - begin
        return out


__all__ = ["FinishedFlag", "PhaseClock", "generate"]
