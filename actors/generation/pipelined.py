"""Pipeline-parallel generation: micro-batches of sequences circulate through the stages.

The prompts are split into M micro-batches (contiguous sequence ranges, M = pp by default). Each
stage keeps one KV cache per micro-batch. Round r of micro-batch m is its prefill (r = 0) or the
decode of the token sampled in round r-1. Every stage walks the rounds in the same order,
(r, 0), (r, 1), ..., (r, M-1), (r+1, 0), ..., so while the last stage samples micro-batch m the
first stage already runs micro-batch m+1: with M >= pp no stage idles for a whole step.

Messages (all point-to-point inside this rank's pipeline column, sends non-blocking):
- stage s -> s+1: an int64 [1] header (1 = micro-batch still running, 0 = finished), then, when
  running, the hidden states [T_m, H] (prefill) or [b_m, H] (decode);
- last stage -> first stage, after sampling round r (when r+1 < max_new_tokens): int64 [b_m + 1],
  the next decode inputs followed by the "still running" flag. The first stage turns a 0 flag
  into a 0 header, which tells every later stage that micro-batch m is done.
The last stage samples (tp rank 0 of its tp group, broadcast, as in generate.py) with the per
(seed, step) uniforms of the whole batch, so samples equal those of pp = 1. At the end the last
stage broadcasts the response buffers over the pipeline group and every rank returns the same
`GenerationOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from actors.engine import PackedBatch, ParallelGroups
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import (
    GenerationConfig,
    GenerationOutput,
    ResponseRecorder,
    attend_length,
    prepare_cache,
)
from actors.generation.fp8_weights import Fp8DecodeWeights
from actors.generation.kv_cache import FusedQKV, HeadMajorKVCache
from actors.generation.sampling import sample_tensor_parallel


@dataclass(frozen=True)
class MicroBatchSlot:
    """One micro-batch on this stage: its global sequence rows int64 [b], packed prompt tokens
    [T_m], prompt boundaries and KV cache (mutable tensors inside, the grouping is fixed)."""

    rows: Tensor
    prompt_tokens: Tensor
    batch: PackedBatch
    cache: HeadMajorKVCache


def split_rows(n_seqs: int, n_parts: int) -> list[range]:
    """Contiguous, near-equal ranges of sequence indices (no empty range)."""
    n_parts = max(1, min(n_parts, n_seqs))
    base, extra = divmod(n_seqs, n_parts)
    bounds = [0]
    for i in range(n_parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(n_parts)]


class PipelineMessenger:
    """Non-blocking sends kept alive until completed; blocking receives. One pipeline column."""

    def __init__(self, groups: ParallelGroups, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups, self.hidden_size, self.dtype, self.device = groups, hidden_size, dtype, device
        self.in_flight: list[tuple[dist.Work, Tensor]] = []
        self.previous_round: list[tuple[dist.Work, Tensor]] = []

    def send(self, tensor: Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self.in_flight.append((dist.isend(tensor, dst, self.groups.pp_group), tensor))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src, self.groups.pp_group)
        return buf

    def recv_hidden(self, n_rows: int) -> Tensor:
        return self.recv((n_rows, self.hidden_size), self.dtype, self.groups.prev_stage_rank)

    def end_round(self) -> None:
        """Complete the sends of the round before this one (their receivers have run by now)."""
        for work, _ in self.previous_round:
            work.wait()
        self.previous_round, self.in_flight = self.in_flight, []

    def finish(self) -> None:
        for work, _ in self.previous_round + self.in_flight:
            work.wait()
        self.previous_round, self.in_flight = [], []


def _build_slots(model: nn.Module, prompts: list[Tensor], config: GenerationConfig, n_parts: int,
                 device: torch.device) -> list[MicroBatchSlot]:
    slots = []
    for slot_index, part in enumerate(split_rows(len(prompts), n_parts)):
        tokens, batch, cache = prepare_cache(model, [prompts[i] for i in part], config, device,
                                             count_fused=slot_index == 0)
        rows = torch.tensor(list(part), dtype=torch.int64, device=device)
        slots.append(MicroBatchSlot(rows, tokens, batch, cache))
    return slots


def _receive_input(slot: MicroBatchSlot, rnd: int, messenger: PipelineMessenger,
                   groups: ParallelGroups) -> Tensor | None:
    """Input of round `rnd` for this stage, or None when the micro-batch has finished: prompt
    tokens / sampled tokens [b] on the first stage, hidden states on the others. Forwards the
    running / finished header to the next stage."""
    n_rows = slot.rows.numel()
    x: Tensor | None
    if groups.is_first_stage:
        if rnd == 0:
            x = slot.prompt_tokens
        else:
            message = messenger.recv((n_rows + 1,), torch.int64, groups.last_stage_rank)
            x = message[:n_rows] if bool(message[n_rows]) else None
    else:
        header = messenger.recv((1,), torch.int64, groups.prev_stage_rank)
        x = messenger.recv_hidden(slot.batch.n_tokens if rnd == 0 else n_rows) if bool(header[0]) else None
    if not groups.is_last_stage:
        header = torch.tensor([int(x is not None)], dtype=torch.int64, device=slot.rows.device)
        messenger.send(header, groups.next_stage_rank)
    return x


def _sample_and_reply(out: Tensor, slot: MicroBatchSlot, rnd: int, uniforms: Tensor | None,
                      recorder: ResponseRecorder, messenger: PipelineMessenger, groups: ParallelGroups) -> None:
    """Last stage: sample round `rnd` of a micro-batch, record it, and send the next decode
    inputs plus the "still running" flag back to the first stage."""
    config = recorder.config
    logits = out  # [b, V_local]: the prefill already kept each prompt's last token only
    mb_uniforms = None if uniforms is None else uniforms[slot.rows]
    sampled = sample_tensor_parallel(logits, config.sampling, mb_uniforms, groups.tp_group)
    next_tokens = recorder.record(slot.rows, rnd, sampled)
    if rnd + 1 < config.max_new_tokens:
        still = torch.tensor([int(not recorder.all_finished(slot.rows))], dtype=torch.int64, device=out.device)
        messenger.send(torch.cat([next_tokens, still]), groups.pp_global_ranks[0])


@torch.no_grad()
def generate_pipelined(model: nn.Module, prompts: list[Tensor], config: GenerationConfig,
                       groups: ParallelGroups) -> GenerationOutput:
    """Generate with `model` = this rank's pipeline stage; every rank of the pipeline column (and
    of its tp groups) calls this with the same prompts and config. Returns the same output on
    every rank."""
    param = next(model.parameters())
    device = param.device
    slots = _build_slots(model, prompts, config, config.pp_micro_batches or groups.layout.pp, device)
    fused = FusedQKV(model) if config.fuse_qkv else None  # one copy shared by every slot's cache
    fp8 = Fp8DecodeWeights(model) if config.fp8_weights else None  # likewise
    for slot in slots:
        slot.cache.qkv, slot.cache.fp8 = fused, fp8
    decoders = [DecodeStep(model, slot.cache, config.use_cuda_graph, config.compile_decode) for slot in slots]
    messenger = PipelineMessenger(groups, model.spec.hidden_size, param.dtype, device)
    recorder = ResponseRecorder(len(prompts), config, device)
    running = [True] * len(slots)
    for rnd in range(config.max_new_tokens):
        uniforms = config.step_uniforms(rnd, len(prompts), device) if groups.is_last_stage else None
        for m, slot in enumerate(slots):
            if not running[m]:
                continue
            x = _receive_input(slot, rnd, messenger, groups)
            running[m] = x is not None
            if x is None:
                continue
            # Prefill over the packed prompts, or one decode step over this micro-batch's cache.
            if rnd == 0:
                last = slot.batch.last_token_indices() if groups.is_last_stage else None
                out = model(x, slot.batch, slot.cache, head_indices=last)
            else:
                out = decoders[m](x, attend_length(slot.batch.max_seqlen, rnd - 1, config, slot.cache.max_len))
            if groups.is_last_stage:
                _sample_and_reply(out, slot, rnd, uniforms, recorder, messenger, groups)
            else:
                messenger.send(out, groups.next_stage_rank)
        messenger.end_round()
        if not any(running):
            break
    messenger.finish()
    del decoders, slots  # frees the caches (and any captured graphs) with the call
    _broadcast_responses(recorder, groups)
    prompt_tokens = torch.cat([p.to(device=device, dtype=torch.int64) for p in prompts])
    return recorder.output(prompts, prompt_tokens)


def _broadcast_responses(recorder: ResponseRecorder, groups: ParallelGroups) -> None:
    """Copy the last stage's response buffers to every stage of the pipeline column."""
    for tensor in (recorder.tokens, recorder.logprobs, recorder.kept_counts, recorder.lengths):
        dist.broadcast(tensor, src=groups.last_stage_rank, group=groups.pp_group)
    finished = recorder.finished.to(torch.uint8)  # gloo does not broadcast bool tensors
    dist.broadcast(finished, src=groups.last_stage_rank, group=groups.pp_group)
    recorder.finished.copy_(finished.bool())


__all__ = ["MicroBatchSlot", "PipelineMessenger", "generate_pipelined", "split_rows"]
