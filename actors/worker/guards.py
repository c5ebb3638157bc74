"""Guards on what a call produces: reward functions under a time limit, non-finite values.

The driver puts two params into every call (app.run.recovery.guard_params):
  on_nonfinite      "stop" (default): a NaN or infinite reward, loss or gradient norm raises
                    `NonFiniteError` naming the call, the iteration and the source (the reward
                    function and the sample's row; the loss; the gradient norm). The optimizer
                    has skipped that update (actors.engine.optimizer), so no weight is corrupted.
                    "skip": the update is skipped and counted (`<prefix>/skipped_updates`).
  reward_timeout_s  the longest one call of a rule-based reward function may take; longer
                    raises `RewardTimeoutError` naming the function and the row (the call keeps
                    running on an abandoned thread: a Python function cannot be interrupted).
A reward function that raises, or returns no score (a string, a dict without 'score'), raises
`RewardFunctionError` naming the function, the call, the sample's row and prompt index and what it
raised or returned.

Losses and gradient norms are reduced over the mesh before they are checked, so every rank of a
train call raises together and none waits in a collective for a peer that stopped.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from actors.worker.data import reward_score

ON_NONFINITE = ("stop", "skip")
DEFAULT_REWARD_TIMEOUT_S = 30.0


class NonFiniteError(ValueError):
    """A NaN or infinite value where the run needs a finite one; the message names its source."""


class RewardTimeoutError(TimeoutError):
    """A reward function call took longer than reward.timeout_s."""


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not a score: the message names the
    function, the call, the sample's row and prompt index, and what it raised or returned."""


def nonfinite_policy(params: dict[str, Any]) -> str:
    policy = str(params.get("on_nonfinite", "stop"))
    if policy not in ON_NONFINITE:
        raise ValueError(f"params['on_nonfinite']={policy!r}: allowed: {', '.join(ON_NONFINITE)}")
    return policy


@dataclass
class RewardSweep:
    """A batch of reward calls as one helper thread works through it, in row order: what each
    finished call gave (`results`: (True, value), or (False, the exception) for the call that
    raised, which ends the sweep), the row being scored and when it started (time.monotonic()),
    and `timed_out`: the row that overran the time limit, if one did."""

    results: list[tuple[bool, Any]] = field(default_factory=list)
    row: int = 0
    started: float = 0.0
    timed_out: int | None = None


class RewardRunner:
    """Calls a reward function on a helper thread with a deadline per call. Each calling thread
    has its own helper (the worker scores rewards on several model-free threads at once, and a
    call must not wait behind another's); a call that overran leaves its helper behind and the
    next call of that thread gets a fresh one.

    A call's rows go to the helper as one task (`sweep`), not one task each: handing a row over
    and back costs ~0.1 ms of thread switching, 0.05 s for the peer bench's 512 rows of a call
    whose function takes microseconds (docs/benchmarks.md, issue 27, eleventh step). The waiting
    thread sleeps until the current row's deadline, so the limit still holds per row."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _pool(self) -> ThreadPoolExecutor:
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return pool

    def sweep(self, fn: Callable[..., Any], arg_rows: Sequence[tuple[Any, ...]], timeout_s: float) -> RewardSweep:
        """fn(*args) for each row of arg_rows in order, each call within timeout_s: the sweep
        stops after a call that raised or, leaving the helper thread behind, at one that overran."""
        sweep, lock = RewardSweep(started=time.monotonic()), threading.Lock()

        def run_rows() -> None:
            for args in arg_rows:
                try:
                    outcome: tuple[bool, Any] = (True, fn(*args))
                except Exception as exc:  # noqa: BLE001 (user code: the caller raises it, naming the row)
                    outcome = (False, exc)
                with lock:  # the result and the next row's start together: len(results) == row
                    if sweep.timed_out is not None:  # too late: the caller has given up on the sweep
                        return
                    sweep.results.append(outcome)
                    sweep.row, sweep.started = sweep.row + 1, time.monotonic()
                if not outcome[0]:
                    return

        pool = self._pool()
        future = pool.submit(run_rows)
        while True:
            with lock:
                deadline = sweep.started + timeout_s
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
                return sweep
            except FutureTimeout:
                with lock:
                    if time.monotonic() < sweep.started + timeout_s:
                        continue  # a later row has started: wait for its deadline
                    sweep.timed_out = sweep.row
                pool.shutdown(wait=False)
                self._local.pool = None
                return sweep


RUNNER = RewardRunner()


def score_rows(fn: Callable[..., Any], name: str, prompts: Sequence[str], responses: Sequence[str],
               answers: Sequence[str | None], first_row: int, call: str, iteration: int,
               params: dict[str, Any], prompt_indices: Sequence[int] | None = None) -> list[float]:
    """fn(prompt, response, answer) per row as floats, each call within params['reward_timeout_s'];
    a non-finite score stops (or, with on_nonfinite=skip, passes through to the skipped update).
    A function that raises or returns no score raises RewardFunctionError naming it, the call,
    the row, its prompt index (`prompt_indices`, one per row; the row when not given) and what it
    raised or returned: an exception raised by code, so the run ends with it. Rows are checked in
    order, so the first row at fault is the one named."""
    timeout_s = float(params.get("reward_timeout_s", DEFAULT_REWARD_TIMEOUT_S))
    policy = nonfinite_policy(params)

    def where(k: int) -> str:
        row = first_row + k
        index = prompt_indices[k] if prompt_indices is not None else row
        return f"sample {row} (prompt index {index}) of call {call}, iteration {iteration}"

    sweep = RUNNER.sweep(fn, list(zip(prompts, responses, answers)), timeout_s)
    scores = []
    for k, (ok, raw) in enumerate(sweep.results):
        if not ok:  # the user's function failed: name it and the sample, not a consumer
            raise RewardFunctionError(f"reward function {name} raised {type(raw).__name__}: "
                                      f"{_short(str(raw))} on {where(k)}") from raw
        try:
            score = reward_score(raw, name)
        except ValueError:
            raise RewardFunctionError(f"reward function {name} returned {_short(repr(raw))} ({type(raw).__name__}) "
                                      f"for {where(k)}; expected a float, a bool or a dict with a numeric "
                                      "'score'") from None
        if not math.isfinite(score) and policy == "stop":
            raise NonFiniteError(f"reward function {name} returned {score} for sample {first_row + k} (call {call}, "
                                 f"iteration {iteration}); set run.on_nonfinite=skip to skip such updates")
        scores.append(score)
    if sweep.timed_out is not None:
        raise RewardTimeoutError(f"reward function {name}: {where(sweep.timed_out)} took more than {timeout_s:g} s "
                                 "(reward.timeout_s)")
    return scores


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_update(metrics: dict[str, float], call: str, iteration: int, params: dict[str, Any]) -> float:
    """1.0 when this optimizer step had a non-finite loss or gradient norm (and was skipped),
    else 0.0; with on_nonfinite=stop such a step raises NonFiniteError naming the source."""
    bad = [(source, metrics[key]) for key, source in (("loss", "loss"), ("grad_norm", "gradient norm"))
           if key in metrics and not math.isfinite(float(metrics[key]))]
    if not bad:
        return 0.0
    if nonfinite_policy(params) == "stop":
        source, value = bad[0]
        raise NonFiniteError(f"call {call} of iteration {iteration}: {source} is {value} (the update was skipped); "
                             "set run.on_nonfinite=skip to skip such updates and go on")
    return 1.0


__all__ = [
    "DEFAULT_REWARD_TIMEOUT_S",
    "ON_NONFINITE",
    "RUNNER",
    "NonFiniteError",
    "RewardFunctionError",
    "RewardRunner",
    "RewardSweep",
    "RewardTimeoutError",
    "check_update",
    "nonfinite_policy",
    "score_rows",
]
