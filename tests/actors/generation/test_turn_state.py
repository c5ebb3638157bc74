"""Unit tests of actors.generation.turn_state: the device decides which rows sample and which turns
end (stop token, the turn's token limit, the budget), resumes and dropped rows carry their state,
and each step's results are read back in order, at most `slots` unread. CPU."""

from __future__ import annotations

import pytest
import torch

from actors.generation.decoding import GenerationConfig
from actors.generation.sampling import SamplingParams
from actors.generation.turn_state import READBACK_ROWS, DeviceTurns, StepReadback

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_turns_end_at_the_stop_token_the_turn_limit_and_the_budget() -> None:
    config = GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0), eos_token_id=7)
    turns = DeviceTurns(config, n=3, budget=5, device=CPU)
    sampled, ended = turns.advance(torch.tensor([7, 4, 4]))  # row 0 hits the stop token
    assert sampled.tolist() == [1, 1, 1] and ended.tolist() == [True, False, False]
    sampled, ended = turns.advance(torch.tensor([4, 4, 4]))  # row 0 paused: its token is ignored
    assert sampled.tolist() == [0, 1, 1] and ended.tolist() == [False, False, False]
    sampled, ended = turns.advance(torch.tensor([7, 5, 5]))  # rows 1, 2: third token of the turn
    assert sampled.tolist() == [0, 1, 1] and ended.tolist() == [False, True, True]
    assert turns.counts.tolist() == [1, 3, 3] and turns.active.tolist() == [0, 0, 0]
    # Row 1 resumes after 1 observed token: 3 sampled + 1 observed, one more token reaches the budget.
    turns.resume(torch.tensor([1]), torch.tensor([1]))
    assert turns.active.tolist() == [0, 1, 0] and turns.turn_len.tolist()[1] == 0
    sampled, ended = turns.advance(torch.tensor([4, 4, 4]))
    assert sampled.tolist() == [0, 1, 0] and ended.tolist() == [False, True, False]
    assert turns.used.tolist() == [1, 5, 3]


def test_draws_follow_each_rows_own_count_and_the_kept_rows() -> None:
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), seed=2)
    turns = DeviceTurns(config, n=3, budget=4, device=CPU)
    table = torch.stack([config.step_uniforms(j, 3, CPU) for j in range(4)], dim=1)  # [3, 4]
    assert torch.equal(turns.uniforms(), table[:, 0])
    turns.active = torch.tensor([1, 0, 1])
    turns.advance(torch.tensor([1, 1, 1]))
    assert torch.equal(turns.uniforms(), torch.stack([table[0, 1], table[1, 0], table[2, 1]]))
    turns.keep(torch.tensor([1, 2]))  # row 0 dropped: rows 1 and 2 keep their draws and counts
    assert torch.equal(turns.uniforms(), torch.stack([table[1, 0], table[2, 1]]))
    assert turns.counts.tolist() == [0, 1] and turns.active.tolist() == [0, 1]
    greedy = DeviceTurns(GenerationConfig(max_new_tokens=4, sampling=SamplingParams(temperature=0.0)), n=2,
                         budget=4, device=CPU)
    assert greedy.uniforms() is None


def test_readback_returns_steps_in_order_and_refuses_too_many_unread() -> None:
    readback = StepReadback(n=2, device=CPU, slots=2)
    steps = [torch.full((READBACK_ROWS, 2), float(k), dtype=torch.float64) for k in range(3)]
    readback.push(steps[0])
    readback.push(steps[1])
    assert readback.pending == 2
    with pytest.raises(RuntimeError, match="2 steps unread"):
        readback.push(steps[2])
    first = readback.pop()
    readback.push(steps[2])  # the freed buffer is reused; what was read stays as read
    assert first.tolist() == steps[0].tolist()
    assert readback.pop().tolist() == steps[1].tolist() and readback.pop().tolist() == steps[2].tolist()
    with pytest.raises(RuntimeError, match="unread"):
        readback.push(steps[0])
        readback.resize(1)
    readback.pop()
    readback.resize(1)
    readback.push(torch.ones((READBACK_ROWS, 1), dtype=torch.float64))
    assert readback.pop().shape == (READBACK_ROWS, 1)
