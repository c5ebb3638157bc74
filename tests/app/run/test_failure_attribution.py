"""Which operation a failure is reported against (app.run.collect.failure_of), without Ray workers.

A rule reward runs on a worker's model-free threads; when the user's function raises or returns
no score, the train call reading its rewards fails with the same exception (its input failed).
The report must name the reward call, the function, the sample's prompt index and what it
returned, not the consumer (a fuzz run reported `critic_train`). The worker side: score_rows
turns the function's failure into one RewardFunctionError naming all of that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray.exceptions import RayTaskError

from actors.worker.guards import RewardFunctionError, score_rows
from app.run.collect import SubmittedOp, failure_of

pytestmark = pytest.mark.unit


@dataclass
class Slot:
    name: str


class Workers:
    def __init__(self) -> None:
        self.slots = [Slot("worker-n0-g0"), Slot("worker-n0-g1")]


def test_a_reward_function_returning_text_names_itself_the_sample_and_the_value() -> None:
    def answers_in_words(prompt: str, response: str, answer: str | None) -> Any:
        return "four" if response == "y" else 1.0

    with pytest.raises(RewardFunctionError, match=r"reward function my:fn returned 'four' \(str\) for sample 11 "
                                                  r"\(prompt index 5\) of call rew_inf, iteration 2; expected a float"):
        score_rows(answers_in_words, "my:fn", ["a", "b"], ["x", "y"], [None, None], 10, "rew_inf", 2, {}, [5, 5])

    def broken(prompt: str, response: str, answer: str | None) -> float:
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match=r"reward function my:fn raised KeyError: 'answer' on sample 10 "
                                                  r"\(prompt index 4\) of call rew_inf, iteration 2"):
        score_rows(broken, "my:fn", ["a"], ["x"], [None], 10, "rew_inf", 2, {}, [4])


@pytest.mark.parametrize("consumer_first", [True, False])
def test_a_failed_reward_is_reported_against_the_reward_call(consumer_first: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gen = SubmittedOp(0, "actor_gen", "call", (0, 1), ("g0", "g1"))
    reward = SubmittedOp(0, "rew_inf", "call", (0, 1), ("r0", "r1"), model_free=True)
    train = SubmittedOp(0, "critic_train", "call", (0, 1), ("c0", "c1"))
    where = {ref: (op, rank) for op in (gen, reward, train) for rank, ref in zip(op.ranks, op.meta_refs)}
    cause = RewardFunctionError("reward function my:fn returned 'four' (str) for sample 3 (prompt index 1) of call "
                                "rew_inf, iteration 0; expected a float, a bool or a dict with a numeric 'score'")
    error = RayTaskError("ModelWorker.run_call", "Traceback ...", cause)
    failed = {"r0", "c0"}  # the reward raised on rank 0; the critic's train call read its rewards there
    first = "c0" if consumer_first else "r0"
    remaining = sorted(failed - {first}) + ["c1"]

    def wait(refs: list[str], num_returns: int = 1, timeout: float | None = None) -> tuple[list[str], list[str]]:
        return [r for r in refs if r in failed], [r for r in refs if r not in failed]

    def get(ref: str, timeout: float | None = None) -> Any:
        if ref in failed:
            raise error
        return {}

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    failure = failure_of(Workers(), [gen, reward, train], (first, error), remaining, where)
    assert failure.op == "call 'rew_inf' of iteration 0" and not failure.recoverable
    assert str(failure).startswith("call 'rew_inf' of iteration 0 failed on worker worker-n0-g0 (rank 0): "
                                   "RewardFunctionError: reward function my:fn returned 'four' (str) for sample 3 "
                                   "(prompt index 1)")
