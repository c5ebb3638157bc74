"""Tests of actors.rl.advantages and actors.rl.losses against plain per-sequence loop references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actors.rl.advantages import (
    AdaptiveKLController,
    FixedKLController,
    broadcast_to_tokens,
    discounted_gae,
    make_kl_controller,
    masked_whiten,
    ppo_advantages,
    remax_advantages,
    token_level_rewards,
)
from actors.rl.losses import (
    LossSums,
    aggregate,
    combine_losses,
    dpo_loss,
    entropy_term,
    kl_loss,
    kl_penalty,
    ppo_policy_loss,
    sequence_logprob_sums,
    sft_loss,
    value_loss,
)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)


def random_packed(seed: int, n_seqs: int = 5) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Packed batch of sequences = prompt (2-5 tokens) + response (1-7 tokens).

    Returns (cu_seqlens [B+1], response_mask [N] bool, per-sequence (prompt_len, response_len)).
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = [(int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen)))
              for _ in range(n_seqs)]
    lengths = [p + r for p, r in shapes]
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lengths), 0)), dtype=torch.int32)
    mask = torch.cat([torch.cat([torch.zeros(p), torch.ones(r)]) for p, r in shapes]).bool()
    return cu, mask, shapes


def response_spans(cu: torch.Tensor, shapes: list[tuple[int, int]]) -> list[range]:
    return [range(int(cu[i]) + p, int(cu[i]) + p + r) for i, (p, r) in enumerate(shapes)]


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop_reference(gamma: float, lam: float) -> None:
    cu, mask, shapes = random_packed(0)
    n = mask.numel()
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(len(shapes), generator=gen)
    kl, values = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    rewards = token_level_rewards(scores, mask, cu, kl=kl, kl_coef=0.1)
    advantages, returns = discounted_gae(rewards, values, mask, cu, gamma, lam)
    for i, span in enumerate(response_spans(cu, shapes)):
        ref_rewards = [-0.1 * float(kl[t]) for t in span]
        ref_rewards[-1] += float(scores[i])
        ref_adv = reference_gae(ref_rewards, [float(values[t]) for t in span], gamma, lam)
        assert torch.allclose(advantages[list(span)], torch.tensor(ref_adv), atol=1e-5)
        assert torch.allclose(returns[list(span)], torch.tensor(ref_adv) + values[list(span)], atol=1e-5)
        assert torch.allclose(rewards[list(span)], torch.tensor(ref_rewards), atol=1e-6)
    assert bool((advantages[~mask] == 0).all()) and bool((returns[~mask] == 0).all())


def test_ppo_advantages_composes_rewards_gae_and_whitening() -> None:
    cu, mask, shapes = random_packed(14)
    gen = torch.Generator().manual_seed(15)
    scores = torch.randn(len(shapes), generator=gen)
    kl, values = torch.randn(mask.numel(), generator=gen), torch.randn(mask.numel(), generator=gen)
    adv, returns = ppo_advantages(scores, values, mask, cu, kl=kl, kl_coef=0.2, gamma=0.99, lam=0.9)
    raw_adv, raw_returns = discounted_gae(token_level_rewards(scores, mask, cu, kl, 0.2), values, mask, cu, 0.99, 0.9)
    assert torch.allclose(returns, raw_returns) and torch.allclose(adv, masked_whiten(raw_adv, mask))
    assert abs(float(adv[mask].mean())) < 1e-5 and abs(float(adv[mask].std()) - 1) < 1e-3


def test_gae_rejects_sequence_without_response() -> None:
    cu = torch.tensor([0, 3, 6])
    mask = torch.tensor([0, 1, 1, 0, 0, 0]).bool()
    with pytest.raises(ValueError, match="sequences \\[1\\] have no response token"):
        discounted_gae(torch.zeros(6), torch.zeros(6), mask, cu)


def test_masked_whiten_matches_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    x, mask = torch.randn(40, generator=gen) * 3 + 1, torch.rand(40, generator=gen) > 0.3
    selected = x[mask]
    expected = (selected - selected.mean()) / torch.sqrt(selected.var(unbiased=True) + 1e-8)
    out = masked_whiten(x, mask)
    assert torch.allclose(out[mask], expected, atol=1e-5)
    assert bool((out[~mask] == 0).all())
    unshifted = masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(unshifted[mask], expected + selected.mean(), atol=1e-5)


def test_remax_and_broadcast() -> None:
    cu, mask, shapes = random_packed(3)
    gen = torch.Generator().manual_seed(4)
    scores, baseline = torch.randn(len(shapes), generator=gen), torch.randn(len(shapes), generator=gen)
    kl = torch.randn(mask.numel(), generator=gen)
    rewards = token_level_rewards(scores, mask, cu, kl=kl, kl_coef=0.05)
    adv, returns = remax_advantages(rewards, baseline, mask, cu)
    for i, span in enumerate(response_spans(cu, shapes)):
        r = [float(rewards[t]) for t in span]
        to_go = [sum(r[k:]) for k in range(len(r))]
        assert torch.allclose(returns[list(span)], torch.tensor(to_go), atol=1e-5)
        assert torch.allclose(adv[list(span)], torch.tensor(to_go) - baseline[i], atol=1e-5)
    tokens = broadcast_to_tokens(scores, mask, cu)
    for i, span in enumerate(response_spans(cu, shapes)):
        assert bool((tokens[list(span)] == scores[i]).all())
    assert bool((tokens[~mask] == 0).all())


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = lp - ref
    assert torch.allclose(kl_penalty(lp, ref, "k1"), d)
    assert torch.allclose(kl_penalty(lp, ref, "abs"), d.abs())
    assert torch.allclose(kl_penalty(lp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_penalty(lp, ref, "mse"), 0.5 * d * d)
    expected_k3 = torch.tensor([math.exp(-x) + x - 1 for x in d.tolist()])
    assert torch.allclose(kl_penalty(lp, ref, "low_var_kl"), expected_k3, atol=1e-6)
    assert bool((kl_penalty(lp, ref, "k3") >= 0).all())
    with pytest.raises(ValueError, match="'k9'.*allowed"):
        kl_penalty(lp, ref, "k9")


def reference_ppo(lp: list[float], old: list[float], adv: list[float], eps_low: float, eps_high: float,
                  dual: float | None) -> tuple[list[float], list[float]]:
    losses, clipped_flags = [], []
    for l, o, a in zip(lp, old, adv):
        ratio = math.exp(l - o)
        un, cl = -a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
        loss = max(un, cl)
        if dual is not None and a < 0:
            loss = min(loss, -a * dual)
        losses.append(loss)
        clipped_flags.append(1.0 if cl > un else 0.0)
    return losses, clipped_flags


@pytest.mark.parametrize("eps_high,dual", [(None, None), (0.28, None), (None, 3.0)])
def test_ppo_policy_loss_matches_reference(eps_high: float | None, dual: float | None) -> None:
    gen = torch.Generator().manual_seed(5)
    n = 64
    lp = (torch.randn(n, generator=gen) * 0.5 - 1).requires_grad_(True)
    old, adv = lp.detach() + torch.randn(n, generator=gen) * 0.6, torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.25
    out = ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high, dual_clip=dual)
    ref_losses, ref_clipped = reference_ppo(lp.tolist(), old.tolist(), adv.tolist(), 0.2,
                                            eps_high if eps_high is not None else 0.2, dual)
    idx = [i for i in range(n) if mask[i]]
    assert abs(float(out.loss.detach()) - sum(ref_losses[i] for i in idx)) < 1e-4
    assert float(out.count) == len(idx)
    assert abs(float(out.stats["pg_clipfrac"]) - sum(ref_clipped[i] for i in idx)) < 1e-6
    assert abs(float(out.stats["ppo_kl"]) - sum(float(old[i] - lp[i].detach()) for i in idx)) < 1e-4
    out.mean().backward()
    assert lp.grad is not None and bool((lp.grad[~mask] == 0).all())


def test_ppo_loss_at_old_policy_is_minus_mean_advantage() -> None:
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    out = ppo_policy_loss(lp, lp.detach(), adv, torch.ones(3))
    assert abs(float(out.mean().detach()) - float(-adv.mean())) < 1e-6
    assert float(out.stats["pg_clipfrac"]) == 0.0
    out.mean().backward()  # d/d lp of -A * exp(lp - old) at ratio 1 is -A / n
    assert torch.allclose(lp.grad, -adv / 3)


def test_value_loss_matches_reference() -> None:
    gen = torch.Generator().manual_seed(6)
    n = 50
    values = torch.randn(n, generator=gen).requires_grad_(True)
    old, returns = values.detach() + torch.randn(n, generator=gen) * 0.5, torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.2
    out = value_loss(values, old, returns, mask, clip_range=0.2)
    total, clipped = 0.0, 0.0
    for i in range(n):
        if not mask[i]:
            continue
        v, o, r = float(values[i].detach()), float(old[i]), float(returns[i])
        vc = o + min(max(v - o, -0.2), 0.2)
        total += 0.5 * max((v - r) ** 2, (vc - r) ** 2)
        clipped += 1.0 if (vc - r) ** 2 > (v - r) ** 2 else 0.0
    assert abs(float(out.loss.detach()) - total) < 1e-4 and float(out.stats["vf_clipfrac"]) == clipped
    unclipped = value_loss(values, old, returns, mask, clip_range=None)
    assert abs(float(unclipped.loss.detach()) - 0.5 * float(((values.detach() - returns)[mask] ** 2).sum())) < 1e-4


def test_seq_mean_token_mean_aggregation() -> None:
    cu, mask, shapes = random_packed(7)
    x = torch.randn(mask.numel(), generator=torch.Generator().manual_seed(8))
    total, count = aggregate(x, mask, "seq-mean-token-mean", cu)
    expected = sum(float(x[list(span)].mean()) for span in response_spans(cu, shapes))
    assert abs(float(total) - expected) < 1e-5 and float(count) == len(shapes)
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        aggregate(x, mask, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="'mean'.*allowed"):
        aggregate(x, mask, "mean")


def test_micro_batch_sums_give_exact_global_token_mean() -> None:
    """Splitting into micro-batches of unequal token counts and dividing by the global count
    reproduces the full-batch token mean (the aggregation contract the engine relies on)."""
    gen = torch.Generator().manual_seed(9)
    lp, old, adv = torch.randn(30, generator=gen), torch.randn(30, generator=gen), torch.randn(30, generator=gen)
    mask = torch.rand(30, generator=gen) > 0.4
    full = ppo_policy_loss(lp, old, adv, mask)
    parts = [ppo_policy_loss(lp[a:b], old[a:b], adv[a:b], mask[a:b]) for a, b in [(0, 7), (7, 22), (22, 30)]]
    combined = parts[0] + parts[1] + parts[2]
    assert isinstance(combined, LossSums)
    assert abs(float(combined.mean()) - float(full.mean())) < 1e-6
    assert combined.stat_means() == pytest.approx(full.stat_means(), abs=1e-6)


def test_dpo_loss_and_sequence_sums() -> None:
    cu, mask, shapes = random_packed(10, n_seqs=4)
    gen = torch.Generator().manual_seed(11)
    lp = torch.randn(mask.numel(), generator=gen).requires_grad_(True)
    sums = sequence_logprob_sums(lp, mask, cu)
    for i, span in enumerate(response_spans(cu, shapes)):
        assert abs(float(sums[i].detach()) - float(lp[list(span)].detach().sum())) < 1e-5
    chosen, rejected = sums[0::2], sums[1::2]  # pairs (0, 1) and (2, 3)
    ref_c, ref_r = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    out = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    expected = 0.0
    for c, r, rc, rr in zip(chosen.tolist(), rejected.tolist(), ref_c.tolist(), ref_r.tolist()):
        h = 0.5 * ((c - rc) - (r - rr))
        expected += -0.9 * math.log(1 / (1 + math.exp(-h))) - 0.1 * math.log(1 / (1 + math.exp(h)))
    assert abs(float(out.loss.detach()) - expected) < 1e-5 and float(out.count) == 2
    out.mean().backward()
    assert lp.grad is not None and bool((lp.grad[~mask] == 0).all())


def test_sft_and_kl_loss() -> None:
    gen = torch.Generator().manual_seed(12)
    logits, targets = torch.randn(12, 16, generator=gen), torch.randint(0, 16, (12,), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]).bool()
    out = sft_loss(lp, mask)
    assert abs(float(out.mean().detach()) - float(F.cross_entropy(logits[mask], targets[mask]))) < 1e-5
    ref = lp + 0.3
    kl = kl_loss(lp, ref, mask, estimator="k1")
    assert abs(float(kl.mean()) + 0.3) < 1e-5 and abs(kl.stat_means()["kl"] + 0.3) < 1e-5


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.1)
    assert fixed.update(5.0, 100) == 0.1
    adaptive = AdaptiveKLController(0.1, target_kl=1.0, horizon=1000)
    assert abs(adaptive.update(1.5, 100) - 0.1 * (1 + 0.2 * 0.1)) < 1e-12  # error clipped to +0.2
    before = adaptive.value
    assert abs(adaptive.update(0.9, 100) - before * (1 - 0.1 * 0.1)) < 1e-12
    assert isinstance(make_kl_controller("adaptive", 0.1, target_kl=6.0), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl: required"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="'pid'"):
        make_kl_controller("pid", 0.1)


def test_combine_losses_weights_terms_and_merges_stats() -> None:
    gen = torch.Generator().manual_seed(13)
    lp = torch.randn(20, generator=gen).requires_grad_(True)
    old, ref, adv, ent = (torch.randn(20, generator=gen) for _ in range(4))
    mask = torch.rand(20, generator=gen) > 0.3
    pg, kl, en = ppo_policy_loss(lp, old, adv, mask), kl_loss(lp, ref, mask), entropy_term(ent, mask)
    total = combine_losses([(1.0, pg), (0.1, kl), (-0.01, en)])
    expected = pg.loss.detach() + 0.1 * kl.loss.detach() - 0.01 * en.loss
    assert abs(float(total.loss.detach()) - float(expected)) < 1e-5 and float(total.count) == float(mask.sum())
    assert set(total.stats) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl", "entropy"}
    with pytest.raises(ValueError, match="appear in more than one term"):
        combine_losses([(1.0, kl), (1.0, kl)])


def test_maxima_combine_by_max_and_stay_out_of_the_sums() -> None:
    one = LossSums(torch.tensor(2.0), torch.tensor(4.0), {"s": torch.tensor(1.0)}, {"m": torch.tensor(3.0)})
    two = LossSums(torch.tensor(1.0), torch.tensor(2.0), {"s": torch.tensor(5.0)}, {"m": torch.tensor(7.0)})
    both = one + two
    assert float(both.loss) == 3.0 and float(both.count) == 6.0 and float(both.stats["s"]) == 6.0
    assert float(both.maxima["m"]) == 7.0
    assert combine_losses([(1.0, one)]).maxima == one.maxima
    with pytest.raises(ValueError, match="stats keys differ"):
        one + LossSums(torch.tensor(1.0), torch.tensor(2.0), {"s": torch.tensor(5.0)})
    with pytest.raises(ValueError, match="appear in more than one term"):
        other_max = LossSums(torch.tensor(0.0), torch.tensor(1.0), {}, {"m": torch.tensor(1.0)})
        combine_losses([(1.0, one), (1.0, other_max)])
