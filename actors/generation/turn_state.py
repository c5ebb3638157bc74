"""The multi-turn decode loop's per-row state on the device, and the readback of each step.

Why: the loop (actors.generation.multiturn) must not make the device wait for the host. If the
host had to read step k's sampled ids before it could queue step k+1 (to know which rows end a
turn and pause), every stall of the host longer than one decode step (its numpy bookkeeping,
an environment thread holding the GIL, handing actions to the environments) would idle the GPU,
and with few rows a step is under a millisecond. So which rows sample, how many tokens each has
sampled this turn and in all, and which turns end are decided on the device (`DeviceTurns`);
the host queues steps ahead and reads each step's results up to a few steps later
(`StepReadback`), mirroring them in its own per-trajectory state to hand ended turns to the
environments. The host only writes device state when it resumes a trajectory (an observation
prefilled: `DeviceTurns.resume`) or drops finished ones (`DeviceTurns.keep`), both queued in
stream order behind the steps already queued.

Rows here are the decode step's rows (actors.generation.compaction may drop finished ones).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch
from torch import Tensor

from actors.generation.decoding import GenerationConfig

# Rows of a step's readback (float64 [READBACK_ROWS, n]): sampled ids (exact below 2**53), their
# logprobs, 1 where the row sampled at that step, 1 where its turn ended at that step.
READBACK_ROWS = 4


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
        self.buffers = [torch.empty((READBACK_ROWS, n), dtype=torch.float64, pin_memory=self.cuda)
                        for _ in range(slots)]
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
        self.buffers = [torch.empty((READBACK_ROWS, n), dtype=torch.float64, pin_memory=self.cuda)
                        for _ in self.buffers]
        self.next = 0


__all__ = ["READBACK_ROWS", "DeviceTurns", "StepReadback"]
