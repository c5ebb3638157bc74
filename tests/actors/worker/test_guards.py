"""Unit tests of the worker-side guards (reward time limit, non-finite values), the progress
probe a stalled worker answers from its second thread, and the engine skipping an update whose
loss is not finite (single process, no torch.distributed)."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from actors.engine import AdamWConfig, ModelEngine, ParallelGroups, SequenceBatch
from actors.rl import LossSums
from actors.worker.guards import NonFiniteError, RewardFunctionError, RewardTimeoutError, check_update, score_rows
from actors.worker.progress import activity
from planning.models import ModelSpec

pytestmark = pytest.mark.unit

SPEC = ModelSpec("guard-test", "llama", vocab_size=64, hidden_size=16, intermediate_size=32, n_layers=1, n_heads=2,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
PROMPTS, RESPONSES, ANSWERS = ["a", "b", "c"], ["x", "y", "z"], [None, None, None]


def test_reward_scores_pass_and_a_slow_call_times_out_naming_the_sample() -> None:
    params = {"reward_timeout_s": 0.5}
    assert score_rows(lambda p, r, a: 1.0 if r == "y" else 0, "fn", PROMPTS, RESPONSES, ANSWERS, 10, "rew", 3,
                      params) == [0.0, 1.0, 0.0]

    def slow(prompt: str, response: str, answer: str | None) -> float:
        time.sleep(5.0 if response == "z" else 0.0)
        return 0.5

    started = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"reward function mine: sample 12 .*iteration 3.*0.5 s \(reward.timeout_s\)"):
        score_rows(slow, "mine", PROMPTS, RESPONSES, ANSWERS, 10, "rew_inf", 3, params)
    assert time.monotonic() - started < 3.0
    assert score_rows(lambda p, r, a: 1, "fn", PROMPTS, RESPONSES, ANSWERS, 0, "rew", 0, params) == [1.0] * 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_stops_or_passes_through(bad: float) -> None:
    def fn(prompt: str, response: str, answer: str | None) -> float:
        return bad if response == "y" else 1.0

    with pytest.raises(NonFiniteError, match=r"reward function mod:fn returned .* for sample 6 \(call rew_inf, iteration 2\)"):
        score_rows(fn, "mod:fn", PROMPTS, RESPONSES, ANSWERS, 5, "rew_inf", 2, {})
    scores = score_rows(fn, "mod:fn", PROMPTS, RESPONSES, ANSWERS, 5, "rew_inf", 2, {"on_nonfinite": "skip"})
    assert scores[0] == 1.0 and not math.isfinite(scores[1])


def test_check_update_names_loss_or_gradient_norm() -> None:
    assert check_update({"loss": 0.3, "grad_norm": 2.0}, "actor_train", 4, {}) == 0.0
    with pytest.raises(NonFiniteError, match="call actor_train of iteration 4: loss is nan"):
        check_update({"loss": math.nan, "grad_norm": math.nan}, "actor_train", 4, {})
    with pytest.raises(NonFiniteError, match="gradient norm is inf"):
        check_update({"loss": 1.0, "grad_norm": math.inf}, "critic_train", 4, {"on_nonfinite": "stop"})
    assert check_update({"loss": math.nan}, "actor_train", 4, {"on_nonfinite": "skip"}) == 1.0
    with pytest.raises(ValueError, match="on_nonfinite"):
        check_update({"loss": math.nan}, "actor_train", 4, {"on_nonfinite": "ignore"})


def test_the_engine_skips_an_update_with_a_non_finite_loss() -> None:
    torch.manual_seed(0)
    engine = ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", seed=1, optim_config=AdamWConfig(lr=1e-2))
    batch = SequenceBatch(torch.randint(0, 64, (6,)), (3, 3))
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    def nan_loss(out: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
        return LossSums(out.sum() * math.nan, torch.tensor(6.0))

    metrics = engine.train_step(batch, nan_loss)
    assert metrics["skipped"] == 1.0 and engine.optimizer.steps_done == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    with pytest.raises(NonFiniteError, match="loss is nan"):
        check_update(metrics, "actor_train", 0, {})
    metrics = engine.train_step(batch, lambda out, data: LossSums(out.sum(), torch.tensor(6.0)))
    assert metrics["skipped"] == 0.0 and engine.optimizer.steps_done == 1


def test_optimizer_state_round_trips_per_parameter() -> None:
    engine = ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", seed=1, optim_config=AdamWConfig(lr=1e-2))
    batch = SequenceBatch(torch.randint(0, 64, (6,)), (3, 3))
    engine.train_step(batch, lambda out, data: LossSums(out.sum(), torch.tensor(6.0)))
    state = engine.optimizer.per_parameter_state()
    other = ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", seed=2, optim_config=AdamWConfig(lr=1e-2))
    other.optimizer.load_per_parameter_state(state, engine.optimizer.steps_done)
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(other.optimizer, kind), getattr(engine.optimizer, kind))
    assert other.optimizer.steps_done == 1
    state["exp_avg"].pop(next(iter(state["exp_avg"])))
    with pytest.raises(ValueError, match="exp_avg"):
        other.optimizer.load_per_parameter_state(state, 1)


class Busy:
    """Stands in for a worker whose call thread is busy (sleeping, or waiting in a collective)."""

    def work(self, seconds: float, started: threading.Event) -> None:
        started.set()
        time.sleep(seconds)


def test_activity_reports_the_method_and_where_the_call_thread_is() -> None:
    worker, started = Busy(), threading.Event()
    assert activity(worker) == {"busy": False}
    thread = threading.Thread(target=worker.work, args=(1.0, started), daemon=True)
    thread.start()
    started.wait()
    found = activity(worker)
    assert found["busy"] and found["method"] == "work" and not found["in_collective"]
    assert "test_guards.py" in found["where"]
    thread.join()


def test_the_time_limit_holds_per_row_not_per_call() -> None:
    """A call's rows run as one sweep on the helper thread; the limit still applies to each row:
    three rows of 0.3 s under a 0.5 s limit pass, the slow row of a later call is named."""
    def steady(prompt: str, response: str, answer: str | None) -> float:
        time.sleep(0.3)
        return 1.0

    assert score_rows(steady, "fn", PROMPTS, RESPONSES, ANSWERS, 0, "rew", 0, {"reward_timeout_s": 0.5}) == [1.0] * 3
    calls: list[str] = []

    def second_is_slow(prompt: str, response: str, answer: str | None) -> float:
        calls.append(response)
        time.sleep(1.0 if response == "y" else 0.0)
        return 1.0

    with pytest.raises(RewardTimeoutError, match=r"sample 4 \(prompt index 8\)"):
        score_rows(second_is_slow, "fn", PROMPTS, RESPONSES, ANSWERS, 3, "rew", 0, {"reward_timeout_s": 0.3}, [7, 8, 9])
    time.sleep(1.0)  # the abandoned helper finishes "y" and scores no further row
    assert calls == ["x", "y"]
    # The next call of this thread gets a fresh helper.
    assert score_rows(lambda p, r, a: 2.0, "fn", PROMPTS, RESPONSES, ANSWERS, 0, "rew", 0, {}) == [2.0] * 3


def test_rows_are_judged_in_order_and_a_raising_row_ends_the_sweep() -> None:
    calls: list[str] = []

    def nan_then_slow(prompt: str, response: str, answer: str | None) -> float:
        calls.append(response)
        if response == "x":
            return math.nan
        time.sleep(1.0)
        return 1.0

    # Row 10 is non-finite, row 11 overruns: the earlier fault is the one reported.
    with pytest.raises(NonFiniteError, match="returned nan for sample 10"):
        score_rows(nan_then_slow, "fn", PROMPTS, RESPONSES, ANSWERS, 10, "rew", 0, {"reward_timeout_s": 0.2})
    calls.clear()

    def raises_on_y(prompt: str, response: str, answer: str | None) -> float:
        calls.append(response)
        if response == "y":
            raise KeyError("missing")
        return 1.0

    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'missing' on sample 11 \(prompt index 11\)"):
        score_rows(raises_on_y, "mod:fn", PROMPTS, RESPONSES, ANSWERS, 10, "rew_inf", 1, {})
    assert calls == ["x", "y"]  # row 12 was never called
