"""Truncated importance weights (actors.rl.importance) and GSPO's sequence-level loss, by hand.

Batch: two sequences, 1 prompt token each; sequence 0 has 2 response tokens, sequence 1 has 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from actors.rl.importance import truncated_is_terms, truncated_is_weights
from actors.rl.losses import gspo_policy_loss, ppo_policy_loss

pytestmark = pytest.mark.unit

CU = torch.tensor([0, 3, 5])
MASK = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
OLD = torch.tensor([0.0, -1.0, -1.0, 0.0, -2.0])
ROLLOUT = torch.tensor([0.0, -1.5, -0.5, 0.0, -2.7])


def test_token_level_weights_are_truncated_ratios() -> None:
    weights, stats = truncated_is_weights(OLD, ROLLOUT, MASK, CU, "token", threshold=1.5)
    # exp(0.5) = 1.649 -> 1.5; exp(-0.5) = 0.607; exp(0.7) = 2.014 -> 1.5; prompts 0.
    assert weights.tolist() == pytest.approx([0.0, 1.5, math.exp(-0.5), 0.0, 1.5])
    assert stats["rollout_is_mean"] == pytest.approx((3.0 + math.exp(-0.5)) / 3)
    assert stats["rollout_is_max"] == pytest.approx(math.exp(0.7), rel=1e-5)
    assert stats["rollout_is_truncated"] == pytest.approx(2 / 3)


def test_sequence_level_weight_is_the_product_of_the_token_ratios() -> None:
    weights, stats = truncated_is_weights(OLD, ROLLOUT, MASK, CU, "sequence", threshold=1.5)
    # sequence 0: exp(0.5 - 0.5) = 1 on both tokens; sequence 1: exp(0.7) -> 1.5.
    assert weights.tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.5])
    assert stats["rollout_is_truncated"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_is='geometric'"):
        truncated_is_weights(OLD, ROLLOUT, MASK, CU, "geometric")


def test_ppo_loss_is_weighted_token_by_token() -> None:
    lp = OLD.clone().requires_grad_(True)
    adv = torch.tensor([0.0, 1.0, -2.0, 0.0, 0.5])
    weights = torch.tensor([0.0, 1.5, 0.5, 0.0, 1.0])
    out = ppo_policy_loss(lp, OLD, adv, MASK, is_weights=weights)
    # at ratio 1 each token's loss is -A * w: -1.5 + 1.0 - 0.5 = -1.0 over 3 tokens
    assert float(out.loss.detach()) == pytest.approx(-1.0) and float(out.count) == 3.0
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, -1.5, 1.0, 0.0, -0.5])


def test_gspo_uses_one_clipped_ratio_per_sequence() -> None:
    lp = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5], requires_grad=True)
    old = torch.tensor([0.0, -1.2, -1.6, 0.0, -0.5])
    adv = torch.tensor([0.0, -1.0, -1.0, 0.0, 2.0])
    out = gspo_policy_loss(lp, old, adv, MASK, CU, clip_eps=0.05, clip_eps_high=0.05)
    # sequence 0: mean log ratio (0.2 - 0.4) / 2 = -0.1, s = 0.905 < 0.95 with A < 0: the clipped
    # term 0.95 is the larger loss on both tokens (clip active, no gradient); sequence 1: s = 1,
    # loss -2. seq-mean-token-mean: 0.95 + (-2) over 2 sequences.
    assert float(out.loss.detach()) == pytest.approx(0.95 - 2.0, abs=1e-6) and float(out.count) == 2.0
    assert float(out.stats["pg_clipfrac"]) == pytest.approx(1.0)
    assert float(out.stats["ppo_kl"]) == pytest.approx(0.1, abs=1e-6)  # -(-0.1) for seq 0, 0 for seq 1
    out.loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, -2.0])


def test_gspo_unclipped_gradient_flows_through_each_token_with_the_sequence_ratio() -> None:
    lp = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5], requires_grad=True)
    old = torch.tensor([0.0, -1.2, -1.6, 0.0, -0.5])
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0])
    out = gspo_policy_loss(lp, old, adv, MASK, CU, clip_eps=0.2, clip_eps_high=0.2)
    s = math.exp(-0.1)
    out.loss.backward()
    # d/d lp_t of mean over the sequence's 2 tokens of (-A s) with d s_t / d lp_t = s: -s / 2 each.
    assert lp.grad.tolist() == pytest.approx([0.0, -s / 2, -s / 2, 0.0, 0.0], abs=1e-6)


def test_terms_are_the_weights_before_and_after_truncation_without_statistics() -> None:
    weights, raw = truncated_is_terms(OLD, ROLLOUT, MASK, CU, "token", threshold=1.5)
    assert weights.tolist() == pytest.approx(truncated_is_weights(OLD, ROLLOUT, MASK, CU, "token", 1.5)[0].tolist())
    assert raw.tolist() == pytest.approx([0.0, math.exp(0.5), math.exp(-0.5), 0.0, math.exp(0.7)], rel=1e-6)
    weights, raw = truncated_is_terms(OLD, ROLLOUT, MASK, CU, "sequence", threshold=1.5)
    assert raw.tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, math.exp(0.7)], rel=1e-6)
