"""The rule-based reward both systems of benchmarks/peer_bench.py score with, on decoded text.

This project names it `benchmarks/peer_reward.py:response_length` (reward.function); TRL gets the
same function per completion through `trl_reward_fn`. Importing this file imports nothing heavy,
since our workers import it by path to score.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def response_length(prompt: str, response: str, answer: str | None) -> float:
    """The response's length in characters, in hundreds (any deterministic function of the
    decoded text would do: the point is that both systems decode and score the same way)."""
    return len(response) / 100.0


def trl_reward_fn(token_counts: list[int]) -> Callable[..., list[float]]:
    """`response_length` as a TRL reward function (one call per generation batch); it appends
    the batch's completion tokens to `token_counts`, which is how the benchmark counts TRL's."""

    def response_length_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                               **kwargs: Any) -> list[float]:
        token_counts.append(sum(len(ids) for ids in completion_ids))
        return [response_length(p, c, None) for p, c in zip(prompts, completions)]

    return response_length_reward
