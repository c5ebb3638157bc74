"""Multi-turn generation: trajectories that pause for an environment and resume on their own cache.

    out = generate_turns(model, prompts, config, budget, source, groups)

Every trajectory keeps its KV cache slots for the whole call (prompt + `budget` tokens). Each decode
step samples one token for every trajectory that is decoding; a trajectory whose turn ends (its
stop token, `config.max_new_tokens` tokens this turn, or the budget spent) pauses: the steps that
follow keep their static shape, but a paused row's length does not advance (`step_increment` 0),
so the slot its step writes is overwritten later. The device decides which rows sample and which
turns end (actors.generation.turn_state), so the host queues steps ahead: it reads each step's
sampled ids up to `read_lag` steps later and then hands each ended turn to the `TurnSource`
(actors.generation.turns) with the ids the trajectory sampled in it. When the source answers
with observation ids, they are prefilled at the trajectory's current length through a
`CacheExtension` (no re-prefill of the history) and its next turn starts from that forward's
last logits. Answers that arrive while other rows decode are gathered into one packed forward
(for up to RESUME_AFTER_STEPS steps, or until they are 1/RESUME_BATCH_DIVISOR of the step's
rows): each forward costs milliseconds of host time however few tokens it has. The source steps
environments on its own threads, so decoding goes on while some trajectories wait; when every
live trajectory waits, the loop blocks in `poll` until one answer arrives, and prefills it.

Finished trajectories leave the decode step: once the live ones (decoding or waiting) are at
most `config.compact_fraction` of the step's rows, their cache rows move to the front and a step
over them alone goes on (`actors.generation.compaction`). The host keeps every row's state by its
global row (`HostTrajectories`); `step_rows` / `step_of` map between those and the step's rows, which
the device-side tensors (logits, cache rows, random draws, the sampled tokens) are ordered by.

Token in, token out: the output holds, per trajectory, exactly the ids sampled (mask 1, with their
sampling logprobs) and the observation ids appended (mask 0, logprob 0), in order.

Tensor parallelism: every tp rank runs the same loop; tokens come from `sample_tensor_parallel`
(tp rank 0 samples and broadcasts), and the source lives on tp rank 0 only: its answers are
broadcast to the group each loop iteration, so the ranks take the same branches. Pipeline
parallelism is not supported here (the planner places multi-turn generation at pp=1).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from actors.engine import ParallelGroups, broadcast_from_first
from actors.generation.cache_extension import CacheExtension, extension_batch
from actors.generation.compaction import RowCompactor, rows_dynamic
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig, attend_length, prepare_cache
from actors.generation.kv_cache import HeadMajorKVCache, decode_weight_copies
from actors.generation.prefill import prefill
from actors.generation.sampling import SamplingParams, sample_tensor_parallel
from actors.generation.turn_state import DeviceTurns, HostTrajectories, StepReadback
from actors.generation.turns import TurnResult, TurnSource

POLL_WAIT_S = 0.05  # longest single wait in `poll` while every live trajectory waits
# Decode steps the host queues beyond the last one it has read: the device runs on through host
# stalls up to this many steps long (its bookkeeping, submits, environment threads holding the GIL).
READ_LAG = 2
# Answered observations wait for one prefill together (`_TurnLoop.resume_due`): at most this many
# decode steps, or until they are 1/RESUME_BATCH_DIVISOR of the step's rows.
RESUME_AFTER_STEPS = 8
RESUME_BATCH_DIVISOR = 8


@dataclass(frozen=True)
class TurnsOutput:
    """One multi-turn call, B trajectories.

    prompts[i]: int64 [p_i]; responses[i]: int64 [r_i], sampled and observation ids interleaved;
    response_masks[i]: float32 [r_i], 1 where the actor sampled the id, 0 on observations;
    logprobs[i]: float32 [r_i], sampling logprobs (0 on observations); turns[i]: turns sampled;
    no_eos[i]: the last turn ended without the stop token; length_cut[i]: the budget ended it.
    stats: loop counters: "decode_steps", "extensions" (observation prefills) and "extend_s"
    (their device seconds), "wait_s" / "max_wait_s" (blocked waiting for answers with no row
    decoding: in all, the longest such wait), "env_calls_s" (host seconds in the source's submit
    and poll while rows decode), "compactions" (times the step dropped finished trajectories),
    "device_wait_s" (on CUDA, host seconds waiting for steps' sampled ids: near the call's decode
    time when the device sets the pace, near zero when the host does).
    """

    prompts: list[Tensor]
    responses: list[Tensor]
    response_masks: list[Tensor]
    logprobs: list[Tensor]
    turns: list[int]
    no_eos: list[bool]
    length_cut: list[bool]
    sampling: SamplingParams
    stats: dict[str, float] = field(default_factory=dict)


def _extend(model: nn.Module, cache: object, rows: list[int], observations: list[list[int]],
            starts: list[int], device: torch.device) -> Tensor:
    """Prefill each row's observation ids at its length; returns the last-token logits [b, V]."""
    tokens, batch = extension_batch([torch.tensor(ids) for ids in observations], starts, device)
    span = max(start + len(ids) for start, ids in zip(starts, observations))
    extension = CacheExtension(cache, torch.tensor(rows, dtype=torch.int64, device=device),
                               torch.tensor(starts, dtype=torch.int64, device=device), span,
                               torch.tensor([len(ids) for ids in observations], dtype=torch.int64, device=device))
    return model(tokens, batch, extension, head_indices=batch.last_token_indices())


def _mark(device: torch.device) -> object:
    """A point in the device's timeline (a CUDA event; the host clock on CPU)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(spans: list[tuple[object, object]], device: torch.device) -> float:
    """Device seconds between each (begin, end) mark pair (waits for the device once, at the end)."""
    if device.type != "cuda":
        return float(sum(end - begin for begin, end in spans))
    torch.cuda.synchronize(device)
    return sum(begin.elapsed_time(end) for begin, end in spans) / 1000.0


@torch.no_grad()
def generate_turns(model: nn.Module, prompts: list[Tensor], config: GenerationConfig, budget: int,
                   source: TurnSource | None, groups: ParallelGroups | None = None,
                   read_lag: int = READ_LAG) -> TurnsOutput:
    """Multi-turn generation for prompts (1-D token tensors); see the module docstring.

    config.max_new_tokens: sampled tokens per turn; budget: tokens per trajectory after its prompt
    (sampled and observed); source: the environments (None on tp ranks other than 0); read_lag:
    decode steps the host may queue beyond the last one it has read (the output does not depend
    on it; 0 reads every step before queueing the next).
    """
    if groups is not None and groups.layout.pp > 1:
        raise ValueError(f"multi-turn generation runs at pp=1; the layout has pp={groups.layout.pp}")
    tp_group = groups.tp_group if groups is not None else None
    if source is None and (tp_group is None or dist.get_rank(tp_group) == 0):
        raise ValueError("generate_turns: tp rank 0 (or a serial call) needs a TurnSource")
    if budget < 2:
        raise ValueError(f"generate_turns: budget={budget}; needs at least 2 tokens after the prompt")
    if read_lag < 0:
        raise ValueError(f"generate_turns: read_lag={read_lag}; must be >= 0")
    device = next(model.parameters()).device
    # One spare slot: a finished row's idle decode steps write at its length, which may be the budget.
    sizing = dataclasses.replace(config, max_new_tokens=budget + 1)
    prompt_tokens, batch, cache = prepare_cache(model, prompts, sizing, device)
    logits = prefill(model, prompts, prompt_tokens, batch, cache)  # [B, V_local]; each distinct prompt once
    cache.qkv, cache.fp8 = decode_weight_copies(model, config.fuse_qkv, config.fp8_weights)
    loop = _TurnLoop(model, cache, logits, config, budget, source, tp_group, read_lag,
                     [p.numel() for p in prompts])
    stats = loop.run()
    state = loop.state
    del loop, cache
    return _output(prompts, state, config.sampling, stats)


class _TurnLoop:
    """One call's loop: the decode step over the cache and the latest logits (of the step queued
    last: [n, V_local] over the step's n rows), the device's turn state and the readback of its
    steps (actors.generation.turn_state), the host's trajectories, the row compactor, counters.

    Each iteration queues a decode step while some row may sample, reads the steps queued more
    than `read_lag` steps ago (all of them when none was queued), hands the turns they ended to
    the source, and serves the source's answers (observation prefills; finished rows dropped)."""

    def __init__(self, model: nn.Module, cache: HeadMajorKVCache, logits: Tensor, config: GenerationConfig,
                 budget: int, source: TurnSource | None, tp_group: ProcessGroup | None, read_lag: int,
                 prompt_lengths: list[int]) -> None:
        self.model, self.cache, self.logits, self.config = model, cache, logits, config
        self.source, self.tp_group, self.read_lag = source, tp_group, read_lag
        self.device = logits.device
        n = len(prompt_lengths)
        self.decode = DecodeStep(model, cache, config.use_cuda_graph, config.compile_decode,
                                 dynamic_rows=rows_dynamic(config, True))  # environments end trajectories
        self.state = HostTrajectories(prompt_lengths, config, budget)
        self.turns = DeviceTurns(config, n, budget, self.device)
        self.readback = StepReadback(n, self.device, read_lag + 1)
        self.compactor = RowCompactor(n, config)
        self.stats = {"decode_steps": 0.0, "wait_s": 0.0, "max_wait_s": 0.0, "env_calls_s": 0.0}
        self.extensions: list[tuple[object, object]] = []  # device time of each observation prefill
        self.deferred: list[TurnResult] = []  # answers with observations, not yet prefilled
        self.deferred_since = 0.0  # decode steps queued when the oldest of them arrived

    def run(self) -> dict[str, float]:
        while self.state.live():
            queued = self.state.may_sample(self.readback.pending)
            if queued:
                self.queue_step()
            while self.readback.pending > (self.read_lag if queued else 0):
                self.read_step()
            self.serve_answers()
        while self.readback.pending:  # steps queued after the last turn ended: nothing sampled
            self.read_step()
        stats = self.stats
        stats["device_wait_s"] = self.readback.wait_s
        stats["extensions"], stats["extend_s"] = float(len(self.extensions)), _seconds(self.extensions, self.device)
        stats["compactions"] = float(self.compactor.compactions)
        return stats

    def queue_step(self) -> None:
        """Sample every step row from the latest logits (rows not sampling are ignored); the device
        ends turns (`DeviceTurns.advance`); queue the results' copy to the host, then the decode
        step, in which only the rows that sampled advance (their tokens go into the cache)."""
        config, unread = self.config, self.readback.pending
        sampled = sample_tensor_parallel(self.logits, config.sampling, self.turns.uniforms(), self.tp_group)
        tokens = sampled.tokens
        sampling, ended = self.turns.advance(tokens)
        self.readback.push(torch.stack([tokens.double(), sampled.logprobs.double(), sampling.double(),
                                        ended.double()]))
        self.cache.step_increment.copy_(sampling)
        next_input = tokens.masked_fill(sampling == 0, config.pad_token_id)  # paused rows feed padding
        # The device's lengths are at most the host's plus one per unread step.
        longest = int(self.state.lengths[self.state.step_rows].max())
        self.logits = self.decode(next_input, attend_length(longest, unread, config, self.cache.max_len))
        self.stats["decode_steps"] += 1

    def read_step(self) -> None:
        """Read the oldest unread step into the host's state; hand the turns it ended to the source."""
        state = self.state
        ended = state.record(self.readback.pop())
        began = time.perf_counter()
        for row in ended:
            action = state.end_turn(row)
            if self.source is not None:
                self.source.submit(row, action, last=state.length_cut[row])
        self.stats["env_calls_s"] += time.perf_counter() - began

    def serve_answers(self) -> None:
        """Poll the source (waiting up to POLL_WAIT_S when no row decodes and none is due to
        resume: the device idles), end the trajectories it ended, resume the answered ones when
        due (`resume_due`), drop finished ones when due."""
        state = self.state
        began = time.perf_counter()
        idle = not state.decoding.any() and not self.deferred
        found = self.source.poll(POLL_WAIT_S if idle else 0.0) if self.source is not None else None
        gap = time.perf_counter() - began
        if idle:  # every live row waits: the device idles (one gap per such poll)
            self.stats["wait_s"] += gap
            self.stats["max_wait_s"] = max(self.stats["max_wait_s"], gap)
        else:
            self.stats["env_calls_s"] += gap
        ended = 0
        for result in broadcast_from_first(found, self.tp_group) or []:
            if result.done or not result.observation_ids:
                state.answer(result)  # None: the trajectory ends here
                ended += 1
            else:
                if not self.deferred:
                    self.deferred_since = self.stats["decode_steps"]
                self.deferred.append(result)
        if self.deferred and self.resume_due():
            ended += self.resume()
        # The live count falls only when an answer ends a trajectory: check then, not every step.
        if ended and self.compactor.due(state.live_count(), state.steps_left()):
            self.drop_finished()

    def resume_due(self) -> bool:
        """Whether to prefill the answered observations now: an observation prefill is a whole
        eager forward (hundreds of kernel launches, milliseconds of host time), so answers that
        arrive one or two at a time are gathered for up to RESUME_AFTER_STEPS decode steps, or
        until they are 1/RESUME_BATCH_DIVISOR of the step's rows, or no row decodes."""
        return (not self.state.decoding.any()
                or self.stats["decode_steps"] - self.deferred_since >= RESUME_AFTER_STEPS
                or len(self.deferred) * RESUME_BATCH_DIVISOR >= len(self.state.step_rows))

    def resume(self) -> int:
        """Take the deferred answers: prefill each observation at its trajectory's length (its
        next token comes from that forward's last logits), queued behind every step queued so
        far, in which the row (waiting) did not advance, so the host's length is the cache's.
        Returns how many trajectories ended instead (the observation did not fit the budget)."""
        answered = [(r.row, int(self.state.lengths[r.row]), self.state.answer(r)) for r in self.deferred]
        self.deferred = []
        resumed = [(row, start, ids) for row, start, ids in answered if ids is not None]
        if not resumed:
            return len(answered)
        begin = _mark(self.device)
        step_rows = [int(self.state.step_of[row]) for row, _, _ in resumed]  # waiting rows are never dropped
        ext = _extend(self.model, self.cache, step_rows, [ids for _, _, ids in resumed],
                      [start for _, start, _ in resumed], self.device)
        index = torch.tensor(step_rows, dtype=torch.int64, device=self.device)
        self.logits = self.logits.clone()  # the decode step's output buffer is reused by the next step
        self.logits[index] = ext.to(self.logits.dtype)
        observed = torch.tensor([len(ids) for _, _, ids in resumed], dtype=torch.int64, device=self.device)
        self.turns.resume(index, observed)
        self.extensions.append((begin, _mark(self.device)))
        return len(answered) - len(resumed)

    def drop_finished(self) -> None:
        """Drop the finished trajectories from the decode step: their cache rows, logits and device
        state go, the rest move to the front (waiting rows stay). The unread steps are read first
        (they are in the old row order)."""
        while self.readback.pending:
            self.read_step()
        keep = self.compactor.compact(torch.from_numpy(self.state.finished()).to(self.device), self.cache)
        assert keep is not None  # due() needs a live row
        self.turns.keep(keep)
        self.state.keep_step_rows(keep.cpu().numpy())
        self.readback.resize(keep.numel())
        self.logits = self.logits[keep]
        self.decode = self.decode.for_cache(self.cache)


def _output(prompts: list[Tensor], state: HostTrajectories, sampling: SamplingParams,
            stats: dict[str, float]) -> TurnsOutput:
    return TurnsOutput(
        prompts=[p.detach().cpu().to(torch.int64) for p in prompts],
        responses=[torch.tensor(ids, dtype=torch.int64) for ids in state.ids],
        response_masks=[torch.tensor(mask, dtype=torch.float32) for mask in state.mask],
        logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in state.logprobs],
        turns=list(state.turns), no_eos=list(state.no_eos), length_cut=list(state.length_cut),
        sampling=sampling, stats=stats,
    )


__all__ = ["POLL_WAIT_S", "READ_LAG", "TurnsOutput", "generate_turns"]
