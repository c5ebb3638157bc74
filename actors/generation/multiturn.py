"""Multi-turn generation: trajectories that pause for an environment and resume on their own cache.

    out = generate_turns(model, prompts, config, budget, source, groups)

Every trajectory keeps its KV cache slots for the whole call (prompt + `budget` tokens). Each decode
step samples one token for every trajectory that is decoding; a trajectory whose turn ends (its
stop token, `config.max_new_tokens` tokens this turn, or the budget spent) is handed to the
`TurnSource` (actors.generation.turns) with the ids it sampled this turn and paused: the steps that
follow keep their static shape, but a paused row's length does not advance (`step_increment` 0),
so the slot its step writes is overwritten later. When the source answers with observation ids,
they are prefilled at the trajectory's current length through a `CacheExtension` (one packed
forward for every trajectory answered at that moment; no re-prefill of the history) and its next
turn starts from that forward's last logits. The source steps environments on its own threads,
so decoding goes on while some trajectories wait; when every live trajectory waits, the loop
blocks in `poll` until one answer arrives.

Finished trajectories leave the decode step: once the live ones (decoding or waiting) are at
most `config.compact_fraction` of the step's rows, their cache rows move to the front and a step
over them alone goes on (`actors.generation.compaction`). The host keeps every row's state by its
global row (`_Trajectories`); `step_rows` / `step_of` map between those and the step's rows, which
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

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from actors.engine import ParallelGroups, broadcast_from_first
from actors.generation.cache_extension import CacheExtension, extension_batch
from actors.generation.compaction import RowCompactor
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig, attend_length, prepare_cache
from actors.generation.fp8_weights import Fp8DecodeWeights
from actors.generation.kv_cache import FusedQKV, HeadMajorKVCache
from actors.generation.prefill import prefill
from actors.generation.sampling import SamplingParams, sample_tensor_parallel
from actors.generation.turns import TurnResult, TurnSource

POLL_WAIT_S = 0.05  # longest single wait in `poll` while every live trajectory waits


@dataclass(frozen=True)
class TurnsOutput:
    """One multi-turn call, B trajectories.

    prompts[i]: int64 [p_i]; responses[i]: int64 [r_i], sampled and observation ids interleaved;
    response_masks[i]: float32 [r_i], 1 where the actor sampled the id, 0 on observations;
    logprobs[i]: float32 [r_i], sampling logprobs (0 on observations); turns[i]: turns sampled;
    no_eos[i]: the last turn ended without the stop token; length_cut[i]: the budget ended it.
    stats: loop counters (decode steps, observation prefills and their device seconds, seconds
    blocked waiting for answers with no row decoding, in all and the longest such wait, times the
    step dropped finished trajectories ("compactions"), and on
    CUDA the seconds the host waited for each step's sampled tokens: near the call's decode time
    when the device sets the pace, near zero when the host does).
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


class _Trajectories:
    """Host-side state of every row: what it sampled and observed, and where it stands. Per-step
    bookkeeping is vectorised (numpy over the rows): it runs while the device decodes the next
    step, and must stay shorter than that step."""

    def __init__(self, prompt_lengths: list[int], config: GenerationConfig, budget: int) -> None:
        n = len(prompt_lengths)
        self.config, self.budget = config, budget
        self.decoding = np.ones(n, dtype=bool)
        self.waiting = np.zeros(n, dtype=bool)
        self.lengths = np.array(prompt_lengths, dtype=np.int64)  # cached tokens per row (= cache.lengths)
        self.used = np.zeros(n, dtype=np.int64)  # tokens after the prompt
        self.turn_len = np.zeros(n, dtype=np.int64)
        self.turn_ids = np.zeros((n, config.max_new_tokens), dtype=np.int64)  # this turn's samples
        self.turn_logprobs = np.zeros((n, config.max_new_tokens), dtype=np.float32)
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.mask: list[list[float]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.turns = [0] * n
        self.no_eos = [False] * n
        self.length_cut = [False] * n
        self.step_rows = np.arange(n)  # the global row of each decode step row
        self.step_of = np.arange(n)  # the step row of each global row (-1: dropped, finished)
        self._uploaded: tuple[bytes, Tensor] | None = None  # the decoding mask on the device
        self._host: Tensor | None = None

    def host_buffer(self, device: torch.device) -> Tensor:
        """float64 [2, n] host memory (n: the step's rows) the sampled tokens and logprobs are
        copied into each step: pinned on CUDA, so the copy does not wait for the decode step queued
        after it (it is read before the next step's copy is queued, so one buffer serves every step)."""
        if self._host is None:
            self._host = torch.empty((2, len(self.step_rows)), dtype=torch.float64,
                                     pin_memory=device.type == "cuda")
        return self._host

    def decoding_rows(self) -> np.ndarray:
        return np.flatnonzero(self.decoding)

    def active_on(self, device: torch.device) -> Tensor:
        """int64 [n] 1 for the step rows decoding, on `device`; uploaded only when the rows changed,
        from pinned memory without waiting (a pageable upload every step would wait for the device)."""
        decoding = self.decoding[self.step_rows]
        key = decoding.tobytes()
        if self._uploaded is None or self._uploaded[0] != key:
            host = torch.from_numpy(decoding.astype(np.int64))
            if device.type == "cuda":
                host = host.pin_memory()
            self._uploaded = (key, host.to(device, non_blocking=True))
        return self._uploaded[1]

    def record(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> list[int]:
        """Append each decoding row's sampled token (rows: global; tokens/logprobs: [n], every step
        row); return the rows whose turn ended."""
        picked = tokens[self.step_of[rows]]
        self.turn_ids[rows, self.turn_len[rows]] = picked
        self.turn_logprobs[rows, self.turn_len[rows]] = logprobs[self.step_of[rows]]
        self.turn_len[rows] += 1
        self.used[rows] += 1
        self.lengths[rows] += 1
        stop = self.config.stop_token
        hit_stop = picked == stop if stop is not None else np.zeros(len(rows), dtype=bool)
        over = (self.turn_len[rows] >= self.config.max_new_tokens) | (self.used[rows] >= self.budget)
        ended = rows[hit_stop | over]
        for row, hit in zip(ended.tolist(), hit_stop[hit_stop | over].tolist()):
            self.no_eos[row] = not hit
        return ended.tolist()

    def end_turn(self, row: int) -> list[int]:
        """Close the row's turn (it now waits); returns the ids it sampled in that turn."""
        n = int(self.turn_len[row])
        sampled = self.turn_ids[row, :n].tolist()
        self.ids[row] += sampled
        self.mask[row] += [1.0] * n
        self.logprobs[row] += self.turn_logprobs[row, :n].tolist()
        self.turn_len[row] = 0
        self.turns[row] += 1
        self.decoding[row], self.waiting[row] = False, True
        if self.used[row] >= self.budget:
            self.length_cut[row] = True
        return sampled

    def answer(self, result: TurnResult) -> list[int] | None:
        """Take the source's answer; the observation ids to prefill, or None when the row ends.
        An observation that does not fit the budget with room for one more sampled token ends
        the trajectory (counted as cut by length) rather than being cut itself."""
        row = result.row
        self.waiting[row] = False
        if result.done or not result.observation_ids:
            return None
        observation = [int(t) for t in result.observation_ids]
        if int(self.used[row]) + len(observation) + 1 > self.budget:
            self.length_cut[row] = True
            return None
        self.ids[row] += observation
        self.mask[row] += [0.0] * len(observation)
        self.logprobs[row] += [0.0] * len(observation)
        self.used[row] += len(observation)
        self.lengths[row] += len(observation)
        self.decoding[row] = True
        return observation

    def live(self) -> bool:
        return bool(self.decoding.any() or self.waiting.any())

    def finished(self) -> np.ndarray:
        """bool [B]: the trajectories their environment (or the budget) ended."""
        return ~(self.decoding | self.waiting)

    def live_count(self) -> int:
        return int((self.decoding | self.waiting).sum())

    def steps_left(self) -> int:
        """At most how many more tokens a live trajectory samples (its budget left)."""
        live = ~self.finished()
        return int((self.budget - self.used[live]).max()) if live.any() else 0

    def keep_step_rows(self, keep: np.ndarray) -> None:
        """The step now holds only its rows `keep` (in order): remap, and drop the buffers sized
        for the old step."""
        self.step_rows = self.step_rows[keep]
        self.step_of[:] = -1
        self.step_of[self.step_rows] = np.arange(len(self.step_rows))
        self._uploaded = self._host = None


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
                   source: TurnSource | None, groups: ParallelGroups | None = None) -> TurnsOutput:
    """Multi-turn generation for prompts (1-D token tensors); see the module docstring.

    config.max_new_tokens: sampled tokens per turn; budget: tokens per trajectory after its prompt
    (sampled and observed); source: the environments (None on tp ranks other than 0).
    """
    if groups is not None and groups.layout.pp > 1:
        raise ValueError(f"multi-turn generation runs at pp=1; the layout has pp={groups.layout.pp}")
    tp_group = groups.tp_group if groups is not None else None
    if source is None and (tp_group is None or dist.get_rank(tp_group) == 0):
        raise ValueError("generate_turns: tp rank 0 (or a serial call) needs a TurnSource")
    if budget < 2:
        raise ValueError(f"generate_turns: budget={budget}; needs at least 2 tokens after the prompt")
    device = next(model.parameters()).device
    # One spare slot: a finished row's idle decode steps write at its length, which may be the budget.
    sizing = dataclasses.replace(config, max_new_tokens=budget + 1)
    prompt_tokens, batch, cache = prepare_cache(model, prompts, sizing, device)
    logits = prefill(model, prompts, prompt_tokens, batch, cache)  # [B, V_local]; each distinct prompt once
    cache.qkv = FusedQKV(model) if config.fuse_qkv else None
    cache.fp8 = Fp8DecodeWeights(model) if config.fp8_weights else None
    decode = DecodeStep(model, cache, config.use_cuda_graph, config.compile_decode)
    state = _Trajectories([p.numel() for p in prompts], config, budget)
    draws = _RowDraws(config, len(prompts), budget, device)
    compactor = RowCompactor(len(prompts), config)
    stats = {"decode_steps": 0.0, "wait_s": 0.0, "max_wait_s": 0.0, "device_wait_s": 0.0}
    extensions: list[tuple[object, object]] = []  # device time of each observation prefill
    while state.live():
        rows = state.decoding_rows()
        if len(rows):
            logits = _decode_step(decode, logits, rows, state, config, draws, tp_group, cache, source, stats)
            stats["decode_steps"] += 1
        waited = time.perf_counter()
        idle = not state.decoding.any()
        found = source.poll(POLL_WAIT_S if idle else 0.0) if source is not None else None
        if idle:  # every live row waits: the device idles (one gap per such poll)
            gap = time.perf_counter() - waited
            stats["wait_s"] += gap
            stats["max_wait_s"] = max(stats["max_wait_s"], gap)
        answered = [(r.row, int(state.lengths[r.row]), state.answer(r))
                    for r in broadcast_from_first(found, tp_group) or []]
        resumed = [(row, start, ids) for row, start, ids in answered if ids is not None]
        if resumed:
            begin = _mark(device)
            step_rows = [int(state.step_of[row]) for row, _, _ in resumed]  # waiting rows are never dropped
            ext = _extend(model, cache, step_rows, [ids for _, _, ids in resumed], [s for _, s, _ in resumed], device)
            logits = logits.clone()  # the decode step's output buffer is reused by the next step
            logits[torch.tensor(step_rows, device=device)] = ext.to(logits.dtype)
            extensions.append((begin, _mark(device)))
        # The live count falls only when an answer ends a trajectory: check then, not every step.
        if len(resumed) < len(answered) and compactor.due(state.live_count(), state.steps_left()):
            logits, decode = _drop_finished(compactor, state, cache, decode, logits, draws)
    stats["extensions"], stats["extend_s"] = float(len(extensions)), _seconds(extensions, device)
    stats["compactions"] = float(compactor.compactions)
    del decode, cache
    return _output(prompts, state, config.sampling, stats)


def _drop_finished(compactor: RowCompactor, state: _Trajectories, cache: HeadMajorKVCache, decode: DecodeStep,
                   logits: Tensor, draws: _RowDraws) -> tuple[Tensor, DecodeStep]:
    """Drop the finished trajectories from the decode step: their cache rows, logits and draws go,
    the rest move to the front (paused rows stay); returns the kept rows' logits [n, V_local] and
    the step over them."""
    keep = compactor.compact(torch.from_numpy(state.finished()).to(logits.device), cache)
    assert keep is not None  # due() needs a live row
    draws.keep(keep)
    state.keep_step_rows(keep.cpu().numpy())
    return logits[keep], decode.for_cache(cache)


class _RowDraws:
    """The random numbers of each row's sampled tokens: its j-th token (over all its turns) uses
    entry j of the draw a single-turn call makes at step j (`GenerationConfig.step_uniforms`), so
    what a trajectory samples does not depend on when its environment answered, and a one-turn
    call samples what `generate` samples. table float32 [B, budget] (None when greedy); counts
    int64 [B] tokens sampled per row so far, on the device."""

    def __init__(self, config: GenerationConfig, n: int, budget: int, device: torch.device) -> None:
        self.table = None
        if not config.sampling.greedy:
            self.table = torch.stack([config.step_uniforms(j, n, device) for j in range(budget)], dim=1)
        self.counts = torch.zeros(n, dtype=torch.int64, device=device)
        self.budget = budget

    def uniforms(self) -> Tensor | None:
        if self.table is None:
            return None
        index = self.counts.clamp(max=self.budget - 1)[:, None]  # finished rows: any entry (ignored)
        return self.table.gather(1, index).squeeze(1)

    def advance(self, active: Tensor) -> None:
        self.counts += active

    def keep(self, keep: Tensor) -> None:
        """The step keeps only its rows `keep` (int64 [n]): their draws follow them."""
        self.table = self.table[keep] if self.table is not None else None
        self.counts = self.counts[keep]


def _decode_step(decode: DecodeStep, logits: Tensor, rows: np.ndarray, state: _Trajectories,
                 config: GenerationConfig, draws: _RowDraws, tp_group: ProcessGroup | None, cache: object,
                 source: TurnSource | None, stats: dict[str, float]) -> Tensor:
    """Sample for the decoding rows (global rows), feed their tokens (paused rows do not advance),
    hand the rows whose turn ended to the source. logits: [n, V_local] over the step's n rows;
    returns the next step's, the same shape.

    Order, so the device never waits for the host: the sampled tokens are copied to the host
    (asynchronously) and the next decode step is queued before the host reads them; the host's
    bookkeeping then runs while the device decodes. stats["device_wait_s"] adds the host's wait."""
    device = logits.device
    active = state.active_on(device)  # the rows sampling now
    sampled = sample_tensor_parallel(logits, config.sampling, draws.uniforms(), tp_group)
    # Tokens and logprobs in one float64 row pair (ids < 2**53 are exact) into pinned memory.
    host = state.host_buffer(device)
    host.copy_(torch.stack([sampled.tokens.double(), sampled.logprobs.double()]), non_blocking=True)
    copied = torch.cuda.Event() if device.type == "cuda" else None
    if copied is not None:
        copied.record()
    draws.advance(active)
    cache.step_increment.copy_(active)
    next_input = torch.where(active.bool(), sampled.tokens, torch.full_like(sampled.tokens, config.pad_token_id))
    # Every row's sampled token (the last of an ended turn too) is written to the cache here.
    out = decode(next_input, attend_length(int(state.lengths[state.step_rows].max()), 0, config, cache.max_len))
    if copied is not None:
        waited = time.perf_counter()
        copied.synchronize()  # the copy only: the decode step queued after it keeps running
        stats["device_wait_s"] += time.perf_counter() - waited
    values = host.numpy()
    ended = state.record(rows, values[0].astype(np.int64), values[1].astype(np.float32))
    for row in ended:
        action = state.end_turn(row)
        if source is not None:
            source.submit(row, action, last=state.length_cut[row])
    return out


def _output(prompts: list[Tensor], state: _Trajectories, sampling: SamplingParams,
            stats: dict[str, float]) -> TurnsOutput:
    return TurnsOutput(
        prompts=[p.detach().cpu().to(torch.int64) for p in prompts],
        responses=[torch.tensor(ids, dtype=torch.int64) for ids in state.ids],
        response_masks=[torch.tensor(mask, dtype=torch.float32) for mask in state.mask],
        logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in state.logprobs],
        turns=list(state.turns), no_eos=list(state.no_eos), length_cut=list(state.length_cut),
        sampling=sampling, stats=stats,
    )


__all__ = ["POLL_WAIT_S", "TurnsOutput", "generate_turns"]
