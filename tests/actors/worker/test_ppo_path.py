"""Audit of the PPO training path: the worker's train ops against plain loops.

GAE advantages and returns, minibatch partitions, the PPO actor's clipped surrogate and entropy
bonus, the critic's clipped value loss and the values op, each against the independent references
of tests/actors/worker/ppo_audit.py on its fixed rollout.
"""

from __future__ import annotations

import pytest
import torch

from actors.worker.train import load_rollout, minibatch_rows, ppo_returns
from tests.actors.worker.ppo_audit import (
    _per_response,
    aggregate,
    context,
    direct_outputs,
    direct_values,
    expected_gae,
    expected_token_rewards,
    module,
    response_entries,
    rollout_columns,
    rows_of,
    run,
    serial_worker,
    shards_of,
    surrogate,
    weights,
    whiten,
)

# ---- advantages (pure) ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("gamma,lam,do_whiten,penalty", [(1.0, 0.95, True, 0.0), (0.9, 0.7, False, 0.5),
                                                        (1.0, 1.0, True, 1.0)])
def test_ppo_advantages_and_returns_match_plain_gae(gamma: float, lam: float, do_whiten: bool, penalty: float) -> None:
    columns = rollout_columns()
    params = {"kl_coef": 0.1, "gamma": gamma, "lam": lam, "whiten": do_whiten, "no_eos_penalty": penalty}
    ctx = context(params)
    rollout = load_rollout(ctx, shards_of(columns), ["values"])
    adv, ret, kl = ppo_returns(ctx, rollout)
    rewards = expected_token_rewards(columns, 0.1, penalty)
    want_adv, want_ret = expected_gae(rewards, rows_of(columns, "values"), gamma, lam)
    if do_whiten:
        want_adv = whiten(want_adv)
    for got, want in ((adv, want_adv), (ret, want_ret)):
        for got_row, want_row in zip(response_entries(got), want):
            assert got_row == pytest.approx(want_row, abs=1e-5)
    # Prompt tokens carry nothing: every non-response entry is exactly 0.
    prompt = rollout.mask == 0
    assert bool((adv[prompt] == 0).all() and (ret[prompt] == 0).all() and (kl[prompt] == 0).all())
    want_kl = [[a - b for a, b in zip(lp, ref)] for lp, ref in zip(rows_of(columns, "logprobs"),
                                                                    rows_of(columns, "ref_logprobs"))]
    assert response_entries(kl) == [pytest.approx(row, abs=1e-6) for row in want_kl]


@pytest.mark.unit
def test_single_token_responses_give_whitened_score_minus_value() -> None:
    gen = torch.Generator().manual_seed(3)
    n = 5
    scores = [0.5, -1.0, 2.0, 0.0, 1.5]
    values = [0.1, 0.4, -0.3, 0.2, 1.0]
    columns = {"prompt_ids": [torch.randint(3, 60, (2 + i,), generator=gen) for i in range(n)],
               "response_ids": [torch.randint(3, 60, (1,), generator=gen) for _ in range(n)],
               "logprobs": [torch.tensor([-1.0]) for _ in range(n)], "rewards": scores,
               "values": [torch.tensor([v]) for v in values]}
    for gamma, lam in ((1.0, 0.95), (0.5, 0.3)):  # one step: gamma and lam cannot matter
        ctx = context({"gamma": gamma, "lam": lam, "whiten": True}, n_rows=n)
        rollout = load_rollout(ctx, [{"row_start": 0, "n": n, **columns}], ["values"])
        adv, ret, kl = ppo_returns(ctx, rollout)
        assert kl is None
        want = whiten([[s - v] for s, v in zip(scores, values)])
        assert adv[rollout.mask.bool()].tolist() == pytest.approx([w[0] for w in want], abs=1e-5)
        assert ret[rollout.mask.bool()].tolist() == pytest.approx(scores, abs=1e-6)  # A + V = score


@pytest.mark.unit
def test_minibatches_partition_rows_deterministically_per_seed_epoch_and_iteration() -> None:
    params = {"ppo_minibatches": 3, "seed": 5}
    first = [minibatch_rows(context(params, n_rows=10), 10, epoch) for epoch in range(3)]
    again = [minibatch_rows(context(params, n_rows=10), 10, epoch) for epoch in range(3)]
    assert first == again  # every rank computes the same split without talking
    for parts in first:
        assert sorted(r for part in parts for r in part) == list(range(10))
        assert sorted(len(part) for part in parts) == [3, 3, 4]
    assert first[0] != first[1]  # reshuffled per epoch
    assert minibatch_rows(context(params, 10, iteration=1), 10, 0) != first[0]
    assert minibatch_rows(context({**params, "seed": 6}, 10), 10, 0) != first[0]
    unshuffled = minibatch_rows(context({**params, "shuffle": False}, 10), 10, 0)
    assert unshuffled == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="ppo_minibatches=3 leaves fewer than dp=2 rows"):
        minibatch_rows(context(params, n_rows=5, dp=2), 5, 0)


# ---- PPO actor ------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_actor_lr0_ratio_is_one_and_pg_loss_is_minus_mean_advantage(agg: str) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    before = weights(worker, "actor")
    params = {"op": "ppo_actor", "kl_coef": 0.1, "gamma": 1.0, "lam": 0.95, "whiten": False, "loss_agg": agg,
              "ppo_epochs": 2, "ppo_minibatches": 1, "clip_eps": 0.2}
    meta, data = run(worker, "actor", "train", params, *shards_of(columns))
    assert data is None
    adv, _ = expected_gae(expected_token_rewards(columns, 0.1), rows_of(columns, "values"), 1.0, 0.95)
    assert meta["actor/optimizer_steps"] == 2.0
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(adv, agg), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"], abs=1e-7)
    assert meta["actor/pg_clipfrac"] == 0.0 and meta["actor/pg_clipfrac_lower"] == 0.0
    assert abs(meta["actor/ppo_kl"]) < 1e-5 and meta["actor/grad_norm"] > 0
    assert meta["actor/advantages_mean"] == pytest.approx(aggregate(adv, "token-mean"), abs=1e-5)
    # actor/kl: k1 of the rollout (sampling logprobs minus ref logprobs) over response tokens.
    kl = [[a - b for a, b in zip(lp, ref)] for lp, ref in zip(rows_of(columns, "logprobs"),
                                                                rows_of(columns, "ref_logprobs"))]
    assert meta["actor/kl"] == pytest.approx(aggregate(kl, "token-mean"), abs=1e-6)
    new, _ = direct_outputs(module(worker, "actor"), columns)
    diff = [[abs(a - b) for a, b in zip(x, y)] for x, y in zip(new, rows_of(columns, "logprobs"))]
    assert meta["actor/old_logprob_diff"] == pytest.approx(aggregate(diff, "token-mean"), abs=1e-5)
    after = weights(worker, "actor")
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr = 0


@pytest.mark.unit
def test_ppo_actor_clipped_surrogate_on_sampling_logprobs_matches_plain_loop() -> None:
    """recompute_logprobs=False: the ratio is exp(new - sampling logprob); with known offsets on
    the old logprobs the clip, clip-higher and dual-clip branches are all exercised."""
    worker = serial_worker()
    columns = rollout_columns()
    new, _ = direct_outputs(module(worker, "actor"), columns)
    offsets = [0.0, 0.5, -0.5, 0.1, -1.5, 1.5, -0.1, 0.5, -1.5, 0.3]  # old = new + offset: ratio = exp(-offset)
    flat_new = [x for row in new for x in row]
    columns["logprobs"] = _per_response([x + d for x, d in zip(flat_new, offsets)])
    params = {"op": "ppo_actor", "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95, "whiten": True, "clip_eps": 0.2,
              "clip_eps_high": 0.28, "dual_clip": 3.0, "recompute_logprobs": False, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    adv, _ = expected_gae(expected_token_rewards(columns, 0.05), rows_of(columns, "values"), 1.0, 0.95)
    losses, clipped, lower = surrogate(new, rows_of(columns, "logprobs"), whiten(adv), 0.2, 0.28, 3.0)
    assert aggregate(clipped, "token-mean") > 0 and aggregate(lower, "token-mean") > 0  # the fixture covers both
    assert meta["actor/pg_loss"] == pytest.approx(aggregate(losses, "token-mean"), abs=1e-5)
    assert meta["actor/pg_clipfrac"] == pytest.approx(aggregate(clipped, "token-mean"), abs=1e-6)
    assert meta["actor/pg_clipfrac_lower"] == pytest.approx(aggregate(lower, "token-mean"), abs=1e-6)
    assert meta["actor/ppo_kl"] == pytest.approx(sum(offsets) / len(offsets), abs=1e-5)  # mean(old - new)
    assert meta["actor/old_logprob_diff"] == 0.0  # the old logprobs ARE the sampling ones here


@pytest.mark.unit
def test_entropy_bonus_enters_with_a_minus_sign_and_is_the_response_tokens_entropy() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.0, "whiten": False, "entropy_coef": 0.01, "temperature": 0.8}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    _, entropy = direct_outputs(module(worker, "actor"), columns, temperature=0.8)
    assert meta["actor/entropy"] == pytest.approx(aggregate(entropy, "token-mean"), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"] - 0.01 * meta["actor/entropy"], abs=1e-6)


@pytest.mark.unit
def test_an_entropy_only_step_raises_the_entropy() -> None:
    """GRPO with equal scores in every group: zero advantages, so the only gradient is the entropy
    bonus's, and a step must increase the policy's entropy on those tokens (sign check)."""
    worker = serial_worker(lr=1e-2)
    columns = {**rollout_columns(), "rewards": [1.0, 1.0, 0.0, 0.0]}
    _, before = direct_outputs(module(worker, "actor"), columns)
    params = {"op": "grpo_actor", "group_size": 2, "entropy_coef": 1.0, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    _, after = direct_outputs(module(worker, "actor"), columns)
    assert meta["actor/pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert aggregate(after, "token-mean") > aggregate(before, "token-mean") + 1e-3


# ---- PPO critic -----------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("value_clip", [0.2, None])
def test_ppo_critic_value_loss_clips_around_the_old_values(value_clip: float | None) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    current = direct_values(module(worker, "critic"), columns)
    offsets = [0.0, 0.5, -0.5, 0.05, -0.3, 0.3, 0.1, -0.05, 0.6, -0.6]  # old = current + offset
    columns["values"] = _per_response([v + d for v, d in zip([x for row in current for x in row], offsets)])
    params = {"op": "ppo_critic", "kl_coef": 0.1, "gamma": 0.95, "lam": 0.9, "whiten": True,
              "value_clip": value_clip, "ppo_epochs": 1, "ppo_minibatches": 1}
    meta, data = run(worker, "critic", "train", params, *shards_of(columns))
    assert data is None
    old = rows_of(columns, "values")
    _, returns = expected_gae(expected_token_rewards(columns, 0.1), old, 0.95, 0.9)  # targets from OLD values
    losses, clip_active = [], []
    for v_row, o_row, r_row in zip(current, old, returns):
        loss_row, clip_row = [], []
        for v, o, ret in zip(v_row, o_row, r_row):
            unclipped = (v - ret) ** 2
            clipped = unclipped if value_clip is None else (o + min(max(v - o, -value_clip), value_clip) - ret) ** 2
            loss_row.append(0.5 * max(unclipped, clipped))
            clip_row.append(float(clipped > unclipped))
        losses.append(loss_row)
        clip_active.append(clip_row)
    if value_clip is not None:
        assert aggregate(clip_active, "token-mean") > 0  # the fixture exercises the clipped branch
    assert meta["critic/vf_loss"] == pytest.approx(aggregate(losses, "token-mean"), abs=1e-5)
    assert meta["critic/vf_clipfrac"] == pytest.approx(aggregate(clip_active, "token-mean"), abs=1e-6)
    assert meta["critic/vpred"] == pytest.approx(aggregate(current, "token-mean"), abs=1e-5)
    assert meta["critic/returns_mean"] == pytest.approx(aggregate(returns, "token-mean"), abs=1e-5)
    assert meta["critic/values_mean"] == pytest.approx(aggregate(old, "token-mean"), abs=1e-6)


@pytest.mark.unit
def test_values_op_gives_v_before_each_response_token() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    _, shard = run(worker, "critic", "inference", {"op": "values"}, *shards_of(columns))
    want = direct_values(module(worker, "critic"), columns)
    assert [t.tolist() for t in shard["values"]] == [pytest.approx(row, abs=1e-5) for row in want]
