"""actors.rl.outcome against numbers worked out by hand (written next to each assertion).

The batch: 6 sequences answering prompts 7, 3, 7, 3, 7, 3 (groups interleaved, so only
prompt_index can find them) with scores 1, 0.5, 0, 0.5, 0, 1; response lengths 2, 1, 1, 2, 1, 1
behind 1-token prompts.
"""

from __future__ import annotations

import math

import pytest
import torch

from actors.rl.outcome import (
    group_index,
    group_mean_std,
    grpo_outcome_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

pytestmark = pytest.mark.unit

IDS = torch.tensor([7, 3, 7, 3, 7, 3])
SCORES = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.0, 1.0])
RESPONSE = (2, 1, 1, 2, 1, 1)


def packed() -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [7], response mask [14]): each row is 1 prompt token + its response."""
    lengths = [1 + r for r in RESPONSE]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    mask = torch.cat([torch.tensor([0.0] + [1.0] * r) for r in RESPONSE])
    return cu, mask


def test_groups_are_found_by_id_not_by_row_order() -> None:
    dense, counts = group_index(IDS)
    assert dense.tolist() == [0, 1, 0, 1, 0, 1] and counts.tolist() == [3, 3]  # numbered by first appearance
    mean, std, size = group_mean_std(SCORES, IDS)
    # prompt 7: 1, 0, 0 -> mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3; prompt 3: 0.5, 0.5, 1 ->
    # mean 2/3, var ((1/6)^2 * 2 + (1/3)^2) / 2 = 1/12.
    assert mean.tolist() == pytest.approx([1 / 3, 2 / 3] * 3)
    assert std.tolist() == pytest.approx([math.sqrt(1 / 3), math.sqrt(1 / 12)] * 3)
    assert size.tolist() == [3] * 6
    with pytest.raises(ValueError, match="group 5 has 1 member"):
        group_mean_std(SCORES, torch.tensor([7, 3, 7, 3, 7, 5]))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_advantages(scale_by_std: bool) -> None:
    adv = grpo_outcome_advantages(SCORES, IDS, eps=0.0, scale_by_std=scale_by_std)
    centred = [2 / 3, -1 / 6, -1 / 3, -1 / 6, -1 / 3, 1 / 3]
    std = [math.sqrt(1 / 3), math.sqrt(1 / 12)] * 3
    expected = [c / s for c, s in zip(centred, std)] if scale_by_std else centred
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    # The same rows in group-contiguous order give the same advantage per row.
    order = torch.tensor([0, 2, 4, 1, 3, 5])
    assert grpo_outcome_advantages(SCORES[order], IDS[order], 0.0, scale_by_std).tolist() == pytest.approx(
        [expected[i] for i in order.tolist()], abs=1e-6)


def test_rloo_leaves_each_sample_out_of_its_own_baseline() -> None:
    # row 0: 1 - mean(0, 0) = 1; row 2: 0 - mean(1, 0) = -0.5; row 1: 0.5 - mean(0.5, 1) = -0.25;
    # row 5: 1 - mean(0.5, 0.5) = 0.5.
    assert rloo_advantages(SCORES, IDS).tolist() == pytest.approx([1.0, -0.25, -0.5, -0.25, -0.5, 0.5])


def test_reinforce_pp_whitens_the_reward_to_go_over_the_batch() -> None:
    cu, mask = packed()
    # token rewards: score at each sequence's last response token, minus 0.1 on row 0's first token.
    rewards = torch.zeros(14)
    rewards[[2, 4, 6, 9, 11, 13]] = SCORES
    rewards[1] = -0.1
    adv = reinforce_pp_advantages(rewards, mask, cu, gamma=1.0)
    # reward-to-go per response token (8 of them): 0.9, 1, 0.5, 0, 0.5, 0.5, 0, 1 -> mean 0.55,
    # unbiased var = sum((x - 0.55)^2) / 7 = 0.96 / 7.
    returns = [0.9, 1.0, 0.5, 0.0, 0.5, 0.5, 0.0, 1.0]
    var = sum((x - 0.55) ** 2 for x in returns) / 7
    expected = [(x - 0.55) / math.sqrt(var + 1e-8) for x in returns]
    assert adv[mask.bool()].tolist() == pytest.approx(expected, abs=1e-5)
    assert adv[~mask.bool()].tolist() == [0.0] * 6


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens() -> None:
    cu, mask = packed()
    rewards = torch.zeros(14)
    rewards[[2, 4, 6, 9, 11, 13]] = SCORES
    rewards[1] = -0.1  # row 0 sums to 0.9: group 7 mean (0.9 + 0 + 0) / 3 = 0.3
    adv = reinforce_pp_baseline_advantages(rewards, IDS, mask, cu)
    per_row = [0.6, -1 / 6, -0.3, -1 / 6, -0.3, 1 / 3]  # group 3 mean 2/3
    tokens = [a for a, r in zip(per_row, RESPONSE) for _ in range(r)]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    assert adv[mask.bool()].tolist() == pytest.approx([(x - mean) / math.sqrt(var + 1e-8) for x in tokens], abs=1e-5)


def test_dapo_overlong_penalty_ramps_over_the_buffer() -> None:
    # max 8 tokens, buffer 4: no penalty up to 4 tokens, then -(L - 4) / 4 * 0.5.
    lengths = torch.tensor([2, 4, 5, 6, 8])
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="buffer=9"):
        overlong_penalty(lengths, 8, 9)
