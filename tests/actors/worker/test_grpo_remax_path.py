"""Audit of the GRPO / ReMax training path and of the rollout's logprobs: the worker's train ops
against plain loops.

GRPO's consecutive groups and KL loss, ReMax's greedy baseline (and its no-EOS penalty), the loss
and gradient independent of the micro-batch count, the configured KL estimator, whitening over the
whole batch before minibatching, sampling logprobs equal to the train layout's recomputation
(truncated sampling too, under dp/tp/pp), and a KL of exactly zero between identical actor and
reference; references from tests/actors/worker/ppo_audit.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from actors.worker import CallSpec, ModelWorker
from actors.worker.train import load_rollout, minibatch_rows, ppo_returns
from planning.layout import Layout, Mesh
from planning.plan import Placement
from tests.actors.worker.ppo_audit import (
    NO_EOS,
    ONE,
    RESPONSE_LENS,
    SCORES,
    SPEC,
    N,
    _per_response,
    aggregate,
    context,
    direct_outputs,
    expected_gae,
    expected_grpo,
    expected_token_rewards,
    generated_rollout,
    meta_returns,
    module,
    response_entries,
    rollout_columns,
    rows_of,
    run,
    serial_worker,
    shards_of,
    whiten,
)


# ---- GRPO -----------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_actor_group_advantages_and_kl_loss_match_plain_loops(scale_by_std: bool) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "grpo_actor", "group_size": 2, "scale_by_std": scale_by_std, "kl_loss_coef": 0.1,
              "kl_loss_estimator": "low_var_kl", "loss_agg": "seq-mean-token-mean", "no_eos_penalty": 0.5,
              "ppo_epochs": 1, "ppo_minibatches": 2}
    new, _ = direct_outputs(module(worker, "actor"), columns)
    ref_offsets = [0.3, -0.2, 0.0, 0.7, -0.5, 0.1, -0.9, 0.2, 0.4, -0.1]  # ref = new + offset
    columns["ref_logprobs"] = _per_response([x + d for x, d in zip([x for row in new for x in row], ref_offsets)])
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    scores = [s - 0.5 * float(e) for s, e in zip(SCORES, NO_EOS)]  # the no-EOS penalty comes first
    per_seq = expected_grpo(scores, 2, scale_by_std)
    # k3 = r - log r - 1 with r = pi_ref / pi (Schulman), clamped to [-10, 10] as veRL does.
    k3 = [[min(10.0, math.exp(ref - n) - (ref - n) - 1) for n, ref in zip(n_row, ref_row)]
          for n_row, ref_row in zip(new, rows_of(columns, "ref_logprobs"))]
    # Two minibatches of 2 rows each, averaged: with seq-mean aggregation every row weighs 1/2 in
    # its minibatch, so the average over minibatches is the plain mean over rows whatever the split.
    assert meta["actor/optimizer_steps"] == 2.0
    assert meta["actor/pg_loss"] == pytest.approx(-sum(per_seq) / N, abs=1e-5)
    assert meta["actor/kl_loss"] == pytest.approx(aggregate(k3, "seq-mean-token-mean"), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"] + 0.1 * meta["actor/kl_loss"], abs=1e-6)
    token_adv = [[a] * r for a, r in zip(per_seq, RESPONSE_LENS)]
    assert meta["actor/advantages_mean"] == pytest.approx(aggregate(token_adv, "token-mean"), abs=1e-5)
    assert meta["actor/kl_coef"] == 0.0  # GRPO puts KL in the loss, not in the reward


@pytest.mark.unit
def test_generation_repeats_each_prompt_on_consecutive_rows_as_grpo_groups_expect() -> None:
    worker = serial_worker()
    prompts = {"row_start": 0, "n": 3, "prompt_ids": [torch.tensor([1, 5, 9]), torch.tensor([1, 7]),
                                                       torch.tensor([1, 4, 4, 8])]}
    params = {"op": "generate", "max_new_tokens": 3, "n_samples": 2, "seed": 4}
    _, gen = run(worker, "actor", "generate", params, prompts, n=6)
    assert gen["prompt_index"] == [0, 0, 1, 1, 2, 2]
    for row, prompt in enumerate(gen["prompt_ids"]):
        assert prompt.tolist() == prompts["prompt_ids"][row // 2].tolist()


# ---- ReMax ----------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("with_ref", [False, True])
def test_remax_actor_advantage_is_reward_to_go_minus_the_greedy_score(with_ref: bool) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    greedy = [0.5, 0.0, 1.0, -1.0]
    if not with_ref:
        del columns["ref_logprobs"]
    shards = [*shards_of(columns), {"row_start": 0, "n": N, "greedy_rewards": greedy}]
    params = {"op": "remax_actor", "kl_coef": 0.2, "whiten": False, "loss_agg": "token-mean", "ppo_minibatches": 1}
    new, _ = direct_outputs(module(worker, "actor"), columns)
    meta, _ = run(worker, "actor", "train", params, *shards)
    advantages = []
    # The KL penalty is of the actor's recomputed logprobs (not the rollout's) against the ref.
    for i, lp in enumerate(new):
        kl = [a - b for a, b in zip(lp, rows_of(columns, "ref_logprobs")[i])] if with_ref else [0.0] * len(lp)
        rewards = [-0.2 * k for k in kl]
        rewards[-1] += SCORES[i]
        advantages.append([sum(rewards[t:]) - greedy[i] for t in range(len(rewards))])  # undiscounted
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(advantages, "token-mean"), abs=1e-5)
    assert meta["rollout/greedy_reward_mean"] == pytest.approx(sum(greedy) / N)
    assert ("actor/kl" in meta) == with_ref


@pytest.mark.unit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_count(agg: str) -> None:
    """Sums over micro-batches divided by the step's global count: 1 or 3 micro-batches give the
    same loss, statistics and gradient norm (lr = 0, so both calls see the same weights)."""
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.1, "whiten": True, "loss_agg": agg, "entropy_coef": 0.01,
              "ppo_minibatches": 1}
    one, _ = run(worker, "actor", "train", {**params, "micro_batches": 1}, *shards_of(columns))
    three, _ = run(worker, "actor", "train", {**params, "micro_batches": 3}, *shards_of(columns))
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert three[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key


@pytest.mark.unit
def test_reward_kl_penalty_uses_the_configured_estimator() -> None:
    columns = rollout_columns()
    ctx = context({"kl_coef": 0.2, "kl_estimator": "low_var_kl", "whiten": False, "gamma": 1.0, "lam": 1.0})
    _, returns, kl = ppo_returns(ctx, load_rollout(ctx, shards_of(columns), ["values"]))
    k3 = [[math.exp(ref - lp) - (ref - lp) - 1 for lp, ref in zip(lp_row, ref_row)]
          for lp_row, ref_row in zip(rows_of(columns, "logprobs"), rows_of(columns, "ref_logprobs"))]
    assert response_entries(kl) == [pytest.approx(row, abs=1e-5) for row in k3]
    # gamma = lam = 1: the return of token t is the undiscounted sum of the rewards from t on.
    for i, row in enumerate(response_entries(returns)):
        rewards = [-0.2 * k for k in k3[i]]
        rewards[-1] += SCORES[i]
        assert row == pytest.approx([sum(rewards[t:]) for t in range(len(rewards))], abs=1e-5)


# ---- whole-batch whitening under minibatches ------------------------------------------------------


@pytest.mark.unit
def test_advantages_are_whitened_over_the_whole_batch_before_minibatching() -> None:
    """Per-minibatch whitening would make each minibatch's mean advantage 0 (pg_loss 0 at ratio 1);
    whole-batch statistics give each minibatch the mean of its rows' whole-batch-whitened values."""
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.1, "gamma": 1.0, "lam": 0.95, "whiten": True, "seed": 3,
              "ppo_epochs": 1, "ppo_minibatches": 2}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    adv, _ = expected_gae(expected_token_rewards(columns, 0.1), rows_of(columns, "values"), 1.0, 0.95)
    white = whiten(adv)
    parts = minibatch_rows(context(params), N, 0)
    want = sum(-aggregate([white[i] for i in rows], "token-mean") for rows in parts) / len(parts)
    assert abs(want) > 1e-2  # the split is informative: per-minibatch whitening would give 0
    assert meta["actor/pg_loss"] == pytest.approx(want, abs=1e-5)


# ---- the sampling distribution vs the train-side logprobs -----------------------------------------
@pytest.mark.unit
def test_sampling_logprobs_equal_the_train_layouts_recomputation_at_the_temperature() -> None:
    """No truncation: the generation logprobs, the actor's recomputed old logprobs and the ref's
    (same initial weights) are the same distribution, so the rollout KL and the logprob gap are 0."""
    worker = serial_worker()
    inputs = generated_rollout(worker, {"temperature": 0.7})
    params = {"op": "ppo_actor", "kl_coef": 0.1, "temperature": 0.7, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *inputs)
    assert meta["actor/old_logprob_diff"] < 1e-5
    assert abs(meta["actor/kl"]) < 1e-5
    assert meta["actor/pg_clipfrac"] == 0.0 and abs(meta["actor/ppo_kl"]) < 1e-5


@pytest.mark.unit
@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "top_k": 4}, {"temperature": 0.8, "top_p": 0.5}])
def test_truncated_sampling_keeps_the_rollout_kl_to_an_identical_ref_at_zero(sampling: dict[str, Any]) -> None:
    """Top-k/top-p sample from a truncated distribution; the rollout's logprobs must still be of
    the full temperature-scaled one the ref and the train layout use (before the fix the rollout
    KL to an identical ref was -log(kept mass), about 2.6 nats per token with top_k=4 here)."""
    worker = serial_worker()
    inputs = generated_rollout(worker, sampling)
    gen = inputs[0]
    columns = {"prompt_ids": gen["prompt_ids"], "response_ids": gen["response_ids"]}
    full, _ = direct_outputs(module(worker, "actor"), columns, temperature=sampling["temperature"])
    assert [t.tolist() for t in gen["logprobs"]] == [pytest.approx(row, abs=1e-5) for row in full]
    params = {"op": "ppo_actor", "kl_coef": 0.1, "temperature": sampling["temperature"], "ppo_minibatches": 1}
    for recompute in (True, False):
        meta, _ = run(worker, "actor", "train", {**params, "recompute_logprobs": recompute}, *inputs)
        assert abs(meta["actor/kl"]) < 1e-5 and meta["actor/old_logprob_diff"] < 1e-5
        assert meta["actor/pg_clipfrac"] == 0.0 and abs(meta["actor/ppo_kl"]) < 1e-5


def _truncated_generation_ranks(rank: int, world_size: int) -> list[float] | None:
    """Generate with top-k under dp2, tp2 and pp2 on 2 gloo ranks; on rank 0, the largest gap
    between each layout's rollout logprobs and a serial full-distribution forward of those rows."""
    from actors.worker import placement_group_sets

    torch.set_num_threads(1)
    both = Mesh(0, 2, 2)
    layouts = {"dp": Layout(dp=2), "tp": Layout(tp=2), "pp": Layout(pp=2)}
    worker = ModelWorker(rank, world_size, "cpu")
    worker.ensure_groups([s for layout in layouts.values() for s in placement_group_sets(Placement(both, layout))])
    prompts = {"row_start": 0, "n": N, "prompt_ids": [torch.tensor([1, 5 + i, 9, 3 + 2 * i][: 2 + i % 3])
                                                      for i in range(N)]}
    params = {"op": "generate", "max_new_tokens": 4, "seed": 3, "temperature": 0.9, "top_k": 3}
    shards = {}
    for name, layout in layouts.items():
        placement = Placement(both, layout)
        worker.load_model(f"actor_{name}", SPEC, False, placement, None, 0, False, {})
        _, shard = worker.run_call(CallSpec("gen", f"actor_{name}", "generate", placement, 0, N, params), prompts)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, shard)
        shards[name] = [s for s in gathered if s is not None]
    if rank != 0:
        return None
    serial = ModelWorker(0, 1, "cpu")
    serial.load_model("actor", SPEC, False, ONE, None, 0, False, {})
    gaps = []
    for name, parts in shards.items():
        columns = {k: [row for part in sorted(parts, key=lambda s: s["row_start"]) for row in part[k]]
                   for k in ("prompt_ids", "response_ids", "logprobs")}
        assert len(columns["logprobs"]) == N, name
        full, _ = direct_outputs(module(serial, "actor"), columns, temperature=0.9)
        gaps.append(max(abs(a - b) for got, want in zip(columns["logprobs"], full) for a, b in zip(got.tolist(), want)))
    return gaps


@pytest.mark.dist
def test_truncated_sampling_logprobs_are_full_distribution_under_dp_tp_and_pp() -> None:
    from tests.dist_harness import run_distributed

    gaps, _ = run_distributed(_truncated_generation_ranks, 2, timeout_s=300.0)
    assert max(gaps) < 1e-5, gaps


@pytest.mark.unit
def test_remax_greedy_baseline_gets_the_same_no_eos_penalty() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    columns["no_eos"] = [True, False, True, False]
    greedy = [0.5, 0.0, 1.0, -1.0]
    greedy_no_eos = [True, True, False, False]
    shards = [*shards_of(columns), {"row_start": 0, "n": N, "greedy_rewards": greedy, "greedy_no_eos": greedy_no_eos}]
    params = {"op": "remax_actor", "kl_coef": 0.0, "whiten": False, "loss_agg": "token-mean", "ppo_minibatches": 1,
              "no_eos_penalty": 0.7}
    meta, _ = run(worker, "actor", "train", params, *shards)
    advantages = []
    for i, lp in enumerate(rows_of(columns, "logprobs")):
        score = SCORES[i] - 0.7 * columns["no_eos"][i]
        baseline = greedy[i] - 0.7 * greedy_no_eos[i]
        advantages.append([score - baseline] * len(lp))  # kl_coef 0: reward only at the last token
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(advantages, "token-mean"), abs=1e-5)
    assert meta["rollout/greedy_reward_mean"] == pytest.approx(sum(greedy) / N)  # unpenalised, like reward_mean


# ---- the KL penalty of the reward is taken from the recomputed logprobs --------------------------


@pytest.mark.unit
@pytest.mark.parametrize("op", ["ppo", "remax_actor", "outcome_actor"])
def test_identical_actor_and_ref_give_a_kl_of_exactly_zero(op: str) -> None:
    """The reward's KL penalty compares the actor's logprobs under its current weights (PPO: the
    actor_inf call's old_logprobs; the critic-free ops: recomputed in the train call) with the
    ref's, computed by the same code on the same layout: bit for bit equal, so KL == 0.0. The
    generation's own logprobs come from another path (KV cache, decode kernels; bf16 on a GPU):
    here they are rounded to bf16 as such a path gives them, and must not enter the KL."""
    worker = serial_worker()
    gen, ref, extra = generated_rollout(worker, {"temperature": 1.0})
    _, old = run(worker, "actor", "inference", {"op": "logprobs", "out_key": "old_logprobs"}, gen)
    gen = {**gen, "logprobs": [t.to(torch.bfloat16).float() for t in gen["logprobs"]]}
    gap = max(float((a - b).abs().max()) for a, b in zip(gen["logprobs"], old["old_logprobs"]))
    assert gap > 1e-4  # the rollout's logprobs are not the recomputed ones
    common = {"kl_coef": 0.1, "ppo_minibatches": 1, "kl_estimator": "k1", "lam": 1.0}
    greedy = {"row_start": 0, "n": N, "greedy_rewards": [0.0] * N}
    group = {"row_start": 0, "n": N, "prompt_index": [0, 0, 1, 1]}
    if op == "ppo":
        meta, _ = run(worker, "actor", "train", {**common, "op": "ppo_actor"}, gen, ref, extra, old)
        critic, _ = run(worker, "critic", "train", {**common, "op": "ppo_critic"}, gen, ref, extra, old)
        assert critic["critic/returns_mean"] == pytest.approx(meta_returns(extra), abs=0.0)
    elif op == "remax_actor":
        meta, _ = run(worker, "actor", "train", {**common, "op": op}, gen, ref, extra, greedy)
    else:
        params = {**common, "op": op, "advantage": "rloo", "group_size": 2}
        meta, _ = run(worker, "actor", "train", params, gen, ref, extra, group)
    assert meta["actor/kl"] == 0.0
