"""The multi-turn decode loop's per-row state, on the host and on the device, and the readback
of each step.

Why: the loop (actors.generation.multiturn) must not make the device wait for the host. If the
host had to read step k's sampled ids before it could queue step k+1 (to know which rows end a
turn and pause), every stall of the host longer than one decode step (its numpy bookkeeping,
an environment thread holding the GIL, handing actions to the environments) would idle the GPU,
and with few rows a step is under a millisecond. So which rows sample, how many tokens each has
sampled this turn and in all, and which turns end are decided on the device (`DeviceTurns`);
the host queues steps ahead and reads each step's results up to a few steps later
(`StepReadback`), mirroring them in its own per-trajectory state to hand ended turns to the
environments (`HostTrajectories`: every trajectory's ids, masks, logprobs and where it
stands, by its global row). The host only writes device state when it resumes a trajectory (an
observation prefilled: `DeviceTurns.resume`) or drops finished ones (`DeviceTurns.keep`), both
queued in stream order behind the steps already queued.

`DeviceTurns` and `StepReadback` are ordered by the decode step's rows, which
actors.generation.compaction may shrink to the unfinished trajectories; `HostTrajectories` keeps
every trajectory by its global row and maps between the two (`step_rows`, `step_of`).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch
from torch import Tensor

from actors.generation.decoding import GenerationConfig
from actors.generation.turns import TurnResult

# Rows of a step's readback (float64 [READBACK_ROWS, n]): sampled ids (exact below 2**53), their
# logprobs, 1 where the row sampled at that step, 1 where its turn ended at that step.
READBACK_ROWS = 4


class HostTrajectories:
    """Host-side state of every row: what it sampled and observed, and where it stands, as of the
    last step read (`record`) and the answers served. Per-step bookkeeping is vectorised (numpy
    over the rows): it runs while the device decodes the steps queued after the one it reads.
    `lengths` and `used` of a waiting row equal the device's (it has not advanced since)."""

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

    def may_sample(self, unread: int) -> bool:
        """Whether a step queued now may sample for some row, as far as the host knows with
        `unread` steps queued and not yet read (each samples at most one token per row)."""
        rows = self.decoding_rows()
        left = np.minimum(self.config.max_new_tokens - self.turn_len[rows], self.budget - self.used[rows])
        return bool((left > unread).any())

    def decoding_rows(self) -> np.ndarray:
        return np.flatnonzero(self.decoding)

    def record(self, values: np.ndarray) -> list[int]:
        """Append one step's sampled tokens (values: float64 [READBACK_ROWS, n] over the step's rows,
        `turn_state.StepReadback`) to the rows that sampled; return the global rows whose turn
        ended (the device decided which: `DeviceTurns.advance`)."""
        sampled = np.flatnonzero(values[2] > 0)
        rows = self.step_rows[sampled]
        picked = values[0, sampled].astype(np.int64)
        self.turn_ids[rows, self.turn_len[rows]] = picked
        self.turn_logprobs[rows, self.turn_len[rows]] = values[1, sampled]
        self.turn_len[rows] += 1
        self.used[rows] += 1
        self.lengths[rows] += 1
        ended_step = np.flatnonzero(values[3] > 0)
        ended = self.step_rows[ended_step].tolist()
        stop = self.config.stop_token
        for row, token in zip(ended, values[0, ended_step].tolist()):
            self.no_eos[row] = stop is None or int(token) != stop
        return ended

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
        """The step now holds only its rows `keep` (in order): remap global and step rows."""
        self.step_rows = self.step_rows[keep]
        self.step_of[:] = -1
        self.step_of[self.step_rows] = np.arange(len(self.step_rows))


class DeviceTurns:
    """Per step row, on the device: `active` int64 [n] (1: samples at the next step), `turn_len`
    int64 [n] (tokens sampled this turn), `used` int64 [n] (tokens after the prompt, observations
    included), `counts` int64 [n] (tokens sampled in all: which random draw comes next).

    Random draws: a row's j-th sampled token (over all its turns) uses entry j of the draw a
    single-turn call makes at step j (`GenerationConfig.step_uniforms`), so what a trajectory
    samples does not depend on when its environment answered, and a one-turn call samples what
    `generate` samples. `table` float32 [n, budget] holds them (None when greedy)."""

    def __init__(self, config: GenerationConfig, n: int, budget: int, device: torch.device) -> None:
        self.max_new, self.budget, self.stop = config.max_new_tokens, budget, config.stop_token
        self.table = None
        if not config.sampling.greedy:
            self.table = torch.stack([config.step_uniforms(j, n, device) for j in range(budget)], dim=1)
        self.active = torch.ones(n, dtype=torch.int64, device=device)
        self.turn_len = torch.zeros(n, dtype=torch.int64, device=device)
        self.used = torch.zeros(n, dtype=torch.int64, device=device)
        self.counts = torch.zeros(n, dtype=torch.int64, device=device)

    def uniforms(self) -> Tensor | None:
        """float32 [n] the draws of the rows' next tokens (None when greedy)."""
        if self.table is None:
            return None
        index = self.counts.clamp(max=self.budget - 1)[:, None]  # rows not sampling: any entry (ignored)
        return self.table.gather(1, index).squeeze(1)

    def advance(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """After a step sampled `tokens` (int64 [n]): count them for the rows that sampled, and end
        the turns that hit the stop token, the turn's max_new_tokens or the budget. Returns
        (sampled int64 [n]: 1 where the row sampled, ended bool [n]); an ended row's token still
        goes into the cache, and it does not sample again until `resume`."""
        sampled = self.active
        self.turn_len += sampled
        self.used += sampled
        self.counts += sampled
        over = (self.turn_len >= self.max_new) | (self.used >= self.budget)
        if self.stop is not None:
            over |= tokens == self.stop
        ended = over & sampled.bool()
        self.active = sampled.masked_fill(ended, 0)  # a new tensor: `sampled` stays this step's
        return sampled, ended

    def resume(self, rows: Tensor, observed: Tensor) -> None:
        """Rows (int64 [b], distinct) start a new turn after `observed` (int64 [b]) observation
        tokens were appended to their caches."""
        self.active[rows] = 1
        self.turn_len[rows] = 0
        self.used[rows] += observed

    def keep(self, keep: Tensor) -> None:
        """The step keeps only its rows `keep` (int64 [m], increasing): their state follows them."""
        self.table = self.table[keep] if self.table is not None else None
        for name in ("active", "turn_len", "used", "counts"):
            setattr(self, name, getattr(self, name)[keep])


class StepReadback:
    """Each queued step's results (float64 [READBACK_ROWS, n] on the device) copied to host memory
    without stopping the device, and read back in order.

    On CUDA each step's copy goes into its own page-locked buffer behind the step that wrote it,
    with an event after it; `pop` waits for that event alone, so the steps queued after it keep
    running. At most `slots` steps may be unread (a buffer is reused only after it was read).
    On CPU every op is synchronous and the buffers are plain tensors. `wait_s` adds the host's
    seconds blocked in `pop`: near the device's time when the device sets the pace."""

    def __init__(self, n: int, device: torch.device, slots: int) -> None:
        self.cuda = device.type == "cuda"
        self.buffers = self._buffers(n, slots)
        self.queue: deque[tuple[Tensor, torch.cuda.Event | None]] = deque()
        self.next = 0
        self.wait_s = 0.0

    @property
    def pending(self) -> int:
        """Steps pushed and not yet read."""
        return len(self.queue)

    def push(self, values: Tensor) -> None:
        """Queue the copy of one step's results (float64 [READBACK_ROWS, n], on the device)."""
        if len(self.queue) == len(self.buffers):
            raise RuntimeError(f"StepReadback: {len(self.buffers)} steps unread; pop one first")
        buffer = self.buffers[self.next]
        self.next = (self.next + 1) % len(self.buffers)
        buffer.copy_(values, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.queue.append((buffer, event))

    def pop(self) -> np.ndarray:
        """The oldest unread step's results, float64 [READBACK_ROWS, n] (a host copy)."""
        buffer, event = self.queue.popleft()
        if event is not None:
            started = time.perf_counter()
            event.synchronize()  # this step's copy only
            self.wait_s += time.perf_counter() - started
        return buffer.numpy().copy()

    def resize(self, n: int) -> None:
        """Buffers for steps of n rows (after the step dropped rows); every step must be read."""
        if self.queue:
            raise RuntimeError(f"StepReadback.resize: {len(self.queue)} steps unread")
        self.buffers = self._buffers(n, len(self.buffers))
        self.next = 0

    def _buffers(self, n: int, slots: int) -> list[Tensor]:
        return [torch.empty((READBACK_ROWS, n), dtype=torch.float64, pin_memory=self.cuda) for _ in range(slots)]


__all__ = ["READBACK_ROWS", "DeviceTurns", "HostTrajectories", "StepReadback"]
