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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


class RewardRunner:
    """Calls a reward function on a helper thread with a deadline per call. Each calling thread
    has its own helper (the worker scores rewards on several model-free threads at once, and a
    call must not wait behind another's); a call that overran leaves its helper behind and the
    next call of that thread gets a fresh one."""

    def __init__(self) -> None:
        self._local = threading.local()

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        future = pool.submit(fn, *args)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            pool.shutdown(wait=False)
            self._local.pool = None
            raise


RUNNER = RewardRunner()


def score_rows(fn: Callable[..., Any], name: str, prompts: Sequence[str], responses: Sequence[str],
               answers: Sequence[str | None], first_row: int, call: str, iteration: int,
               params: dict[str, Any], prompt_indices: Sequence[int] | None = None) -> list[float]:
    """fn(prompt, response, answer) per row as floats, each call within params['reward_timeout_s'];
    a non-finite score stops (or, with on_nonfinite=skip, passes through to the skipped update).
    A function that raises or returns no score raises RewardFunctionError naming it, the call,
    the row, its prompt index (`prompt_indices`, one per row; the row when not given) and what it
    raised or returned: an exception raised by code, so the run ends with it."""
    timeout_s = float(params.get("reward_timeout_s", DEFAULT_REWARD_TIMEOUT_S))
    policy = nonfinite_policy(params)
    scores = []
    for k, (prompt, response, answer) in enumerate(zip(prompts, responses, answers)):
        row = first_row + k
        index = prompt_indices[k] if prompt_indices is not None else row
        where = f"sample {row} (prompt index {index}) of call {call}, iteration {iteration}"
        try:
            raw = RUNNER.call(fn, (prompt, response, answer), timeout_s)
        except FutureTimeout:
            raise RewardTimeoutError(f"reward function {name}: {where} took more than {timeout_s:g} s "
                                     "(reward.timeout_s)") from None
        except Exception as exc:  # the user's function failed: name it and the sample, not a consumer
            raise RewardFunctionError(f"reward function {name} raised {type(exc).__name__}: "
                                      f"{_short(str(exc))} on {where}") from exc
        try:
            score = reward_score(raw, name)
        except ValueError:
            raise RewardFunctionError(f"reward function {name} returned {_short(repr(raw))} ({type(raw).__name__}) "
                                      f"for {where}; expected a float, a bool or a dict with a numeric 'score'") from None
        if not math.isfinite(score) and policy == "stop":
            raise NonFiniteError(f"reward function {name} returned {score} for sample {row} (call {call}, iteration "
                                 f"{iteration}); set run.on_nonfinite=skip to skip such updates")
        scores.append(score)
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
    "DEFAULT_REWARD_TIMEOUT_S", "NonFiniteError", "ON_NONFINITE", "RUNNER", "RewardFunctionError", "RewardRunner",
    "RewardTimeoutError",
    "check_update", "nonfinite_policy", "score_rows",
]
