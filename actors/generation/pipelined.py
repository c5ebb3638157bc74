"""Pipeline-parallel generation: micro-batches of sequences circulate through the stages.

The prompts are split into M micro-batches (contiguous sequence ranges, M = pp by default). Each
stage keeps one KV cache per micro-batch. Round r of micro-batch m is its prefill (r = 0) or the
decode of the token sampled in round r-1. Every stage walks the rounds in the same order,
(r, 0), (r, 1), ..., (r, M-1), (r+1, 0), ..., so while the last stage samples micro-batch m the
first stage already runs micro-batch m+1: with M >= pp no stage idles for a whole step.

Each micro-batch drops its finished rows on its own (`actors.generation.compaction`, one
`RowCompactor` per micro-batch): the last stage, which samples and so knows which rows finished,
decides, and the keep mask travels with the next round's messages, so every stage drops the same
rows from its cache before that micro-batch's next decode step.

Messages (all point-to-point inside this rank's pipeline column, sends non-blocking; b_m is the
micro-batch's row count before the round's compaction):
- stage s -> s+1: an int64 [1 + b_m] header (1 = micro-batch still running, 0 = finished; then
  the keep mask, all ones when no row is dropped), then, when running, the hidden states
  [T_m, H] (prefill) or [b_m', H] (decode, b_m' the rows kept);
- last stage -> first stage, after sampling round r (when r+1 < max_new_tokens): int64
  [2 b_m + 1], the next decode inputs, then the "still running" flag and the keep mask, which the
  first stage passes on as the header: a 0 flag tells every later stage that micro-batch m is done.
The last stage samples (tp rank 0 of its tp group, broadcast, as in generate.py) with the per
(seed, step) uniforms of the whole batch, so samples equal those of pp = 1. At the end the last
stage broadcasts the response buffers over the pipeline group and every rank returns the same
`GenerationOutput`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from actors.engine import PackedBatch, ParallelGroups
from actors.generation.compaction import RowCompactor, rows_dynamic
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import (
    GenerationConfig,
    GenerationOutput,
    ResponseRecorder,
    attend_length,
    prepare_cache,
)
from actors.generation.kv_cache import HeadMajorKVCache, decode_weight_copies
from actors.generation.sampling import sample_tensor_parallel


@dataclass(frozen=True)
class MicroBatchSlot:
    """One micro-batch on this stage: its global sequence rows int64 [b], packed prompt tokens
    [T_m], prompt boundaries, KV cache and compactor (mutable inside, the grouping is fixed)."""

    rows: Tensor
    prompt_tokens: Tensor
    batch: PackedBatch
    cache: HeadMajorKVCache
    compactor: RowCompactor

    @property
    def step_rows(self) -> Tensor:
        """The global rows int64 [b'] the decode step holds, in step order (finished ones dropped)."""
        active = self.compactor.active
        return self.rows if active is None else self.rows[active]


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
        slots.append(MicroBatchSlot(rows, tokens, batch, cache, RowCompactor(len(part), config)))
    return slots


def _receive_input(slot: MicroBatchSlot, rnd: int, messenger: PipelineMessenger,
                   groups: ParallelGroups) -> Tensor | None:
    """Input of round `rnd` for this stage, or None when the micro-batch has finished: prompt
    tokens / sampled tokens [b'] on the first stage, hidden states on the others. Forwards the
    header (running flag, keep mask) to the next stage and drops the rows it says to drop."""
    n_rows = slot.compactor.n_step_rows
    x: Tensor | None = None
    flags: Tensor | None = None
    if groups.is_first_stage and rnd == 0:
        x = slot.prompt_tokens
        flags = torch.ones(1 + n_rows, dtype=torch.int64)  # running, none dropped: no device read needed
        header = flags.to(slot.rows.device)
    elif groups.is_first_stage:
        message = messenger.recv((2 * n_rows + 1,), torch.int64, groups.last_stage_rank)
        x, header = message[:n_rows], message[n_rows:]
    else:
        header = messenger.recv((1 + n_rows,), torch.int64, groups.prev_stage_rank)
    if not groups.is_last_stage:
        messenger.send(header, groups.next_stage_rank)
    if flags is None:
        flags = header.cpu()  # one host read: the running flag and the keep mask
    if not bool(flags[0]):
        return None
    if not bool(flags[1:].all()):
        keep = torch.nonzero(flags[1:]).squeeze(1).to(slot.rows.device)
        slot.compactor.drop(keep, slot.cache)
        x = x[keep] if x is not None else None
    if groups.is_first_stage:
        return x
    return messenger.recv_hidden(slot.batch.n_tokens if rnd == 0 else slot.compactor.n_step_rows)


def _sample_and_reply(out: Tensor, slot: MicroBatchSlot, rnd: int, uniforms: Tensor | None,
                      recorder: ResponseRecorder, messenger: PipelineMessenger, groups: ParallelGroups) -> None:
    """Last stage: sample round `rnd` of a micro-batch, record it, and send the next decode
    inputs, the "still running" flag and the keep mask (all ones unless compaction is due) back to
    the first stage."""
    config = recorder.config
    logits = out  # [b, V_local]: the prefill already kept each prompt's last token only
    rows = slot.step_rows
    mb_uniforms = None if uniforms is None else uniforms[rows]
    sampled = sample_tensor_parallel(logits, config.sampling, mb_uniforms, groups.tp_group)
    next_tokens = recorder.record(rows, rnd, sampled)
    steps_left = config.max_new_tokens - rnd - 1
    if steps_left > 0:
        live = ~recorder.finished[rows]
        live_count = int(live.sum())
        keep = live if slot.compactor.due(live_count, steps_left) else torch.ones_like(live)
        still = torch.tensor([int(live_count > 0)], dtype=torch.int64, device=out.device)
        messenger.send(torch.cat([next_tokens, still, keep.to(torch.int64)]), groups.pp_global_ranks[0])


@torch.no_grad()
def generate_pipelined(model: nn.Module, prompts: list[Tensor], config: GenerationConfig,
                       groups: ParallelGroups) -> GenerationOutput:
    """Generate with `model` = this rank's pipeline stage; every rank of the pipeline column (and
    of its tp groups) calls this with the same prompts and config. Returns the same output on
    every rank."""
    param = next(model.parameters())
    device = param.device
    slots = _build_slots(model, prompts, config, config.pp_micro_batches or groups.layout.pp, device)
    copies = decode_weight_copies(model, config.fuse_qkv, config.fp8_weights)  # shared by every slot's cache
    for slot in slots:
        slot.cache.qkv, slot.cache.fp8 = copies
    dynamic_rows = rows_dynamic(config, config.stop_token is not None,
                                tuple(slot.compactor.n_step_rows for slot in slots))
    decoders = [DecodeStep(model, slot.cache, config.use_cuda_graph, config.compile_decode, dynamic_rows=dynamic_rows)
                for slot in slots]
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
                if decoders[m].static_input.shape[0] != slot.compactor.n_step_rows:  # rows were dropped
                    decoders[m] = decoders[m].for_cache(slot.cache)
                out = decoders[m](x, attend_length(slot.batch.max_seqlen, rnd - 1, config, slot.cache.max_len))
            if groups.is_last_stage:
                _sample_and_reply(out, slot, rnd, uniforms, recorder, messenger, groups)
            else:
                messenger.send(out, groups.next_stage_rank)
        messenger.end_round()
        if not any(running):
            break
    messenger.finish()
    stats = {"compactions": float(sum(slot.compactor.compactions for slot in slots))}
    del decoders, slots  # frees the caches (and any captured graphs) with the call
    _broadcast_responses(recorder, groups)
    prompt_tokens = torch.cat([p.to(device=device, dtype=torch.int64) for p in prompts])
    return dataclasses.replace(recorder.output(prompts, prompt_tokens), stats=stats)


def _broadcast_responses(recorder: ResponseRecorder, groups: ParallelGroups) -> None:
    """Copy the last stage's response buffers to every stage of the pipeline column."""
    for tensor in (recorder.tokens, recorder.logprobs, recorder.kept_counts, recorder.lengths):
        dist.broadcast(tensor, src=groups.last_stage_rank, group=groups.pp_group)
    finished = recorder.finished.to(torch.uint8)  # gloo does not broadcast bool tensors
    dist.broadcast(finished, src=groups.last_stage_rank, group=groups.pp_group)
    recorder.finished.copy_(finished.bool())


__all__ = ["MicroBatchSlot", "PipelineMessenger", "generate_pipelined", "split_rows"]
