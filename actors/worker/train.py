"""Training ops of the model worker: PPO actor and critic, ReMax and DPO actors (the group-based
outcome algorithms GRPO, RLOO, REINFORCE++, DAPO and GSPO are in actors.worker.outcome_train).

Every rank of the train call's mesh is given every row. It builds the packed batch and the
advantages of the WHOLE batch identically (a pure function of the rows, so whitening uses
whole-batch statistics without communication), then runs `ppo_epochs` x `ppo_minibatches`
optimizer steps through `ModelEngine.train_step`, which splits each minibatch over dp and
micro-batches and normalises the loss globally (actors.engine.model_engine).

Shapes: T tokens of B packed rows (prompt + response); per-token tensors are float32 [T] in the
convention of actors.rl.advantages (entry i is about token i), `mask` [T] marks response tokens.
Hyperparameters come from CallSpec.params (app/algorithms/* fill them; names as in veRL):
kl_coef, kl_estimator, gamma, lam, whiten, clip_eps, clip_eps_high, dual_clip, value_clip,
entropy_coef, kl_loss_coef (GRPO), loss_agg, ppo_epochs, ppo_minibatches, shuffle, seed,
temperature, micro_batches, no_eos_penalty, recompute_logprobs, policy_loss (ppo | gspo),
rollout_is (token | sequence | None) and rollout_is_threshold.

Logprobs: `logprobs` are the rollout's (generation time, possibly older weights); the behaviour
policy of the PPO ratio and of the KL penalty in the reward is `old_logprobs`, the actor's own
logprobs under its current weights: given by PPO's actor_inf call (both train calls then shape
the same rewards), otherwise recomputed here under the train layout (recompute_logprobs, the
default). With an identical actor and reference the KL is then exactly 0. Truncated importance
weights (actors.rl.importance) correct the policy loss for the gap between the two.

When nothing needs them before the step (no KL penalty in the reward) and there is one minibatch
and one epoch, the actor takes its old logprobs from its training forward (detached) instead of a
separate forward pass over every token: that step's weights are the ones the recomputation would
use, so the ratios are exactly 1 and the gradient is the recomputing path's
(`reuses_forward_logprobs`). Truncated importance weights (FP8 rollouts) are then computed per
micro-batch from the same detached logprobs (`forward_is_terms`). With more minibatches or
epochs the weights move between steps and the old logprobs are recomputed first.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from actors.engine import LossFn, SequenceBatch
from actors.rl import (
    LossSums,
    aggregate,
    combine_losses,
    dpo_loss,
    entropy_term,
    gspo_policy_loss,
    kl_loss,
    kl_penalty,
    masked_whiten,
    ppo_advantages,
    ppo_policy_loss,
    remax_advantages,
    sequence_logprob_sums,
    token_level_rewards,
    value_loss,
)
from actors.worker.behaviour import (
    behaviour_logprobs,
    forward_is_metrics,
    forward_is_terms,
    importance_weights,
    logprobs_before_step,
    reuses_forward_logprobs,
)
from actors.worker.calls import CallContext, micro_batching, shareable_prefixes
from actors.worker.data import cu_seqlens_of, merge_shards, pack_rows
from actors.worker.guards import check_update
from actors.worker.rollout import Rollout, load_rollout, prompt_batch


def masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def rollout_kl(ctx: CallContext, r: Rollout, behaviour: Tensor | None = None) -> Tensor | None:
    """Per-token KL(pi_old || pi_ref) [T] on response tokens, or None without ref logprobs.

    behaviour: the actor's logprobs under its current weights (`behaviour_logprobs`); default the
    actor_inf call's `old_logprobs`, else the rollout's (recompute_logprobs=False)."""
    if r.ref_logprobs is None:
        return None
    if behaviour is None:
        behaviour = r.old_logprobs if r.old_logprobs is not None else r.logprobs
    return kl_penalty(behaviour, r.ref_logprobs, str(ctx.params.get("kl_estimator", "k1"))) * r.mask


def rollout_metrics(ctx: CallContext, r: Rollout, kl: Tensor | None) -> dict[str, float]:
    out = {
        "rollout/reward_mean": float(r.raw_scores.mean()),
        "rollout/response_length_mean": sum(r.response_lengths) / len(r.response_lengths),
        "rollout/response_length_max": float(max(r.response_lengths)),
    }
    if kl is not None:
        out["actor/kl"] = masked_mean(kl, r.mask)
        out["actor/kl_coef"] = float(ctx.params.get("kl_coef", 0.0))
    return out


def ppo_returns(ctx: CallContext, r: Rollout) -> tuple[Tensor, Tensor, Tensor | None]:
    """(advantages [T] whitened as configured, returns [T], kl [T] or None): KL-shaped token
    rewards, then GAE with the critic's values."""
    if r.values is None:
        raise ValueError(f"call {ctx.call.name}: PPO needs 'values' from the critic inference call")
    p = ctx.params
    kl = rollout_kl(ctx, r)
    adv, ret = ppo_advantages(r.scores, r.values, r.mask, r.cu_seqlens, kl=kl, kl_coef=float(p.get("kl_coef", 0.0)),
                              gamma=float(p.get("gamma", 1.0)), lam=float(p.get("lam", 0.95)),
                              whiten=bool(p.get("whiten", True)))
    return adv, ret, kl


def select_rows(batch: SequenceBatch, rows: Sequence[int]) -> SequenceBatch:
    """Sub-batch of the given rows, in that order (token and sequence data follow)."""
    cu = cu_seqlens_of(batch.lengths).tolist()
    index = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in rows])
    seq_index = torch.tensor(list(rows), dtype=torch.int64)
    prefix = None if batch.prefix_lengths is None else tuple(batch.prefix_lengths[i] for i in rows)
    return SequenceBatch(batch.tokens[index], tuple(batch.lengths[i] for i in rows),
                         {k: v[index] for k, v in batch.token_data.items()},
                         {k: v[seq_index] for k, v in batch.seq_data.items()}, prefix_lengths=prefix)


def rows_by_prefix(batch: SequenceBatch, rows: Sequence[int]) -> list[int]:
    """`rows` with the rows of one prompt next to each other (groups in order of first
    appearance, rows in their order inside a group), so that a micro-batch can hold each prompt
    once. A minibatch's loss sums over its rows: the order changes no result beyond rounding."""
    if batch.prefix_lengths is None:
        return list(rows)
    cu = cu_seqlens_of(batch.lengths).tolist()
    keys = {r: tuple(batch.tokens[cu[r]:cu[r] + batch.prefix_lengths[r]].tolist()) for r in rows}
    first: dict[tuple[int, ...], int] = {}
    for r in rows:
        first.setdefault(keys[r], len(first))
    return sorted(rows, key=lambda r: first[keys[r]])


def minibatch_rows(ctx: CallContext, n_rows: int, epoch: int) -> list[list[int]]:
    """Row indices of each minibatch of one epoch: a seeded shuffle (same on every rank) cut
    into ppo_minibatches near-equal parts, each with at least dp rows."""
    p = ctx.params
    n_mb = int(p.get("ppo_minibatches", 1))
    dp = ctx.groups.layout.dp
    if n_mb < 1 or n_rows // n_mb < dp:
        raise ValueError(f"call {ctx.call.name}: ppo_minibatches={n_mb} leaves fewer than dp={dp} rows of "
                         f"{n_rows} per minibatch")
    order = list(range(n_rows))
    if bool(p.get("shuffle", True)):
        random.Random(int(p.get("seed", 0)) * 7919 + ctx.call.iteration * 131 + epoch).shuffle(order)
    return [order[k * n_rows // n_mb:(k + 1) * n_rows // n_mb] for k in range(n_mb)]


def run_epochs(ctx: CallContext, batch: SequenceBatch, loss_fn: LossFn, prefix: str,
               with_entropy: bool = False) -> dict[str, float]:
    """ppo_epochs x ppo_minibatches optimizer steps; metrics averaged over steps as prefix/<name>."""
    engine = ctx.need_engine()
    temperature = float(ctx.params.get("temperature", 1.0))
    mb = micro_batching(ctx)
    totals: dict[str, float] = {}
    steps, skipped = 0, 0.0
    for epoch in range(int(ctx.params.get("ppo_epochs", 1))):
        for rows in minibatch_rows(ctx, len(batch.lengths), epoch):
            metrics = engine.train_step(select_rows(batch, rows_by_prefix(batch, rows)), loss_fn, mb.n_micro,
                                        temperature, with_entropy,
                                        micro_batch_tokens=mb.tokens)
            skipped += check_update(metrics, ctx.call.name, ctx.call.iteration, ctx.params)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            steps += 1
    # The KL loss term's statistic is "kl"; actor/kl is the rollout's KL to the reference.
    renamed = {"kl": "kl_loss"}
    out = {f"{prefix}/{renamed.get(key, key)}": value / steps for key, value in totals.items()
           if key not in ("count", "loss")}
    out[f"{prefix}/loss"] = totals.get("loss", 0.0) / steps
    out[f"{prefix}/optimizer_steps"] = float(steps)
    out[f"{prefix}/skipped_updates"] = skipped
    return out


POLICY_LOSSES = ("ppo", "gspo")


def policy_loss_fn(params: dict[str, Any], old_from_forward: bool = False) -> LossFn:
    """Clipped PPO surrogate, or GSPO's sequence-level one (params['policy_loss']), weighted by the
    truncated importance weights when given (+ entropy bonus, + a KL loss) on one micro-batch.

    old_from_forward: the old logprobs are this forward's own, detached (`reuses_forward_logprobs`),
    so every ratio is exactly 1; the statistic old_logprob_diff then compares them with the
    sampling logprobs (token data "sample_logprobs") as the recomputing path does afterwards, and
    with params['rollout_is'] set the importance weights come from them too (`forward_is_terms`).
    """
    kind = str(params.get("policy_loss", "ppo"))
    if kind not in POLICY_LOSSES:
        raise ValueError(f"params['policy_loss']={kind!r}: allowed: {', '.join(POLICY_LOSSES)}")
    clip_eps = float(params.get("clip_eps", 0.2))
    clip_high = None if params.get("clip_eps_high") is None else float(params["clip_eps_high"])
    dual = None if params.get("dual_clip") is None else float(params["dual_clip"])
    agg = str(params.get("loss_agg", "token-mean"))
    entropy_coef = float(params.get("entropy_coef", 0.0))
    kl_coef = float(params.get("kl_loss_coef", 0.0))
    estimator = str(params.get("kl_loss_estimator", "low_var_kl"))
    is_level = params.get("rollout_is") if old_from_forward else None
    is_threshold = float(params.get("rollout_is_threshold", 2.0))

    def loss(logprobs: Tensor, data: dict[str, Tensor]) -> LossSums:
        cu, mask, weights = data["cu_seqlens"], data["mask"], data.get("is_weights")
        old = logprobs.detach() if old_from_forward else data["old_logprobs"]
        is_sums: dict[str, Tensor] = {}
        maxima: dict[str, Tensor] = {}
        if is_level is not None:
            weights, is_sums, maxima = forward_is_terms(old, data, str(is_level), is_threshold)
        if kind == "gspo":
            pg = gspo_policy_loss(logprobs, old, data["advantages"], mask, cu, clip_eps, clip_high, agg, weights)
        else:
            pg = ppo_policy_loss(logprobs, old, data["advantages"], mask, clip_eps, clip_high, dual, agg, cu, weights)
        terms = [(1.0, pg)]
        if entropy_coef > 0:
            terms.append((-entropy_coef, entropy_term(data["entropy"], mask, agg, cu)))
        if kl_coef > 0:
            terms.append((kl_coef, kl_loss(logprobs, data["ref_logprobs"], mask, estimator, agg, cu)))
        total = combine_losses(terms)
        if not old_from_forward:
            return total
        diff, _ = aggregate((old - data["sample_logprobs"]).abs(), mask, agg, cu)
        return LossSums(total.loss, total.count, {**total.stats, "old_logprob_diff": diff, **is_sums},
                        {**total.maxima, **maxima})

    return loss


def train_actor(ctx: CallContext, r: Rollout, advantages: Tensor, extra: dict[str, float],
                old: Tensor | None = None) -> tuple[dict, None]:
    """Policy optimisation on `advantages` [T] (shared by every actor op); old: the behaviour
    logprobs [T] when the caller already has them (`behaviour_logprobs`). Otherwise they are
    the actor_inf call's, taken from the training forward (`reuses_forward_logprobs`; the
    importance weights then too), or recomputed first."""
    reuse = old is None and r.old_logprobs is None and reuses_forward_logprobs(ctx.params)
    token_data = {"mask": r.mask, "advantages": advantages * r.mask}
    is_metrics: dict[str, float] = {}
    if reuse:
        token_data["sample_logprobs"] = r.logprobs
    else:
        old = behaviour_logprobs(ctx, r) if old is None else old
        token_data["old_logprobs"] = old
        weights, is_metrics = importance_weights(ctx, r, old)
        if weights is not None:
            token_data["is_weights"] = weights
    if r.ref_logprobs is not None:
        token_data["ref_logprobs"] = r.ref_logprobs
    if float(ctx.params.get("kl_loss_coef", 0.0)) > 0 and r.ref_logprobs is None:
        raise ValueError(f"call {ctx.call.name}: kl_loss_coef > 0 needs 'ref_logprobs' from the ref call")
    batch = prompt_batch(ctx, r, token_data)
    with_entropy = float(ctx.params.get("entropy_coef", 0.0)) > 0
    metrics = run_epochs(ctx, batch, policy_loss_fn(ctx.params, old_from_forward=reuse), "actor", with_entropy)
    if reuse and ctx.params.get("rollout_is") is not None:
        metrics = forward_is_metrics(metrics)
    if old is not None:
        metrics["actor/old_logprob_diff"] = masked_mean((old - r.logprobs).abs(), r.mask)
    return {**extra, **metrics, **is_metrics, "actor/advantages_mean": masked_mean(advantages, r.mask)}, None


def run_ppo_actor(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    r = load_rollout(ctx, inputs, ["values"])
    advantages, _, kl = ppo_returns(ctx, r)
    return train_actor(ctx, r, advantages, rollout_metrics(ctx, r, kl))


def run_ppo_critic(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    """Clipped value loss towards the GAE returns (computed exactly as the actor computes them)."""
    r = load_rollout(ctx, inputs, ["values"])
    _, returns, _ = ppo_returns(ctx, r)
    assert r.values is not None
    clip = ctx.params.get("value_clip", 0.2)
    agg = str(ctx.params.get("loss_agg", "token-mean"))

    def loss(values: Tensor, data: dict[str, Tensor]) -> LossSums:
        return value_loss(values, data["old_values"], data["returns"], data["mask"],
                          None if clip is None else float(clip), agg, data["cu_seqlens"])

    batch = prompt_batch(ctx, r, {"mask": r.mask, "old_values": r.values, "returns": returns})
    metrics = run_epochs(ctx, batch, loss, "critic")
    metrics["critic/returns_mean"] = masked_mean(returns, r.mask)
    metrics["critic/values_mean"] = masked_mean(r.values, r.mask)
    return metrics, None


def run_remax_actor(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    """ReMax: REINFORCE on KL-shaped rewards with the greedy response's reward as baseline."""
    r = load_rollout(ctx, inputs, ["greedy_rewards"])
    cols = merge_shards(inputs, range(ctx.call.n_rows), ["greedy_rewards"], optional=["greedy_no_eos"])
    raw_baseline = torch.tensor([float(x) for x in cols["greedy_rewards"]], dtype=torch.float32)
    baseline = raw_baseline
    # The greedy response is scored like the sampled one: the same no-EOS penalty, else the
    # baseline would sit above the penalised sampled scores and bias every advantage down.
    penalty = float(ctx.params.get("no_eos_penalty", 0.0))
    if penalty and "greedy_no_eos" in cols:
        baseline = baseline - penalty * torch.tensor([float(x) for x in cols["greedy_no_eos"]])
    old = logprobs_before_step(ctx, r)
    kl = rollout_kl(ctx, r, old)
    token_rewards = token_level_rewards(r.scores, r.mask, r.cu_seqlens, kl=kl,
                                        kl_coef=float(ctx.params.get("kl_coef", 0.0)))
    advantages, _ = remax_advantages(token_rewards, baseline, r.mask, r.cu_seqlens)
    if bool(ctx.params.get("whiten", False)):
        advantages = masked_whiten(advantages, r.mask, shift_mean=False)
    extra = rollout_metrics(ctx, r, kl)
    extra["rollout/greedy_reward_mean"] = float(raw_baseline.mean())  # unpenalised, like rollout/reward_mean
    return train_actor(ctx, r, advantages, extra, old)


# ---- DPO ----------------------------------------------------------------------------------------
# Rows 2i (prompt + chosen) and 2i + 1 (prompt + rejected) form pair i. Batches carry
# group_size=2, so the engine's dp and micro-batch splits keep each pair together (the loss of a
# pair needs both sequences' logprob sums in one micro-batch).


def dpo_loss_fn(beta: float, label_smoothing: float) -> LossFn:
    """DPO loss on one micro-batch of whole pairs; count = pairs (the engine divides by all of them)."""

    def loss(logprobs: Tensor, data: dict[str, Tensor]) -> LossSums:
        # logprobs [T_mb] -> summed response logprobs per sequence [B_mb]; even = chosen, odd = rejected.
        sums = sequence_logprob_sums(logprobs, data["mask"], data["cu_seqlens"])
        ref = data["ref_logps"]  # [B_mb] the reference's summed response logprobs
        return dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta, label_smoothing)

    return loss


def load_pairs(ctx: CallContext, inputs: Sequence[dict | None]) -> SequenceBatch:
    """Every pair of the call packed, with the response mask [T] and the reference sums [B]."""
    n_rows = ctx.call.n_rows
    if n_rows % 2:
        raise ValueError(f"call {ctx.call.name}: n_rows={n_rows}; DPO rows come in chosen/rejected pairs (even)")
    cols = merge_shards(inputs, range(n_rows), ["prompt_ids", "response_ids", "ref_logprobs"])
    tokens, lengths, mask = pack_rows(cols["prompt_ids"], cols["response_ids"])
    ref_logps = torch.stack([t.float().sum() for t in cols["ref_logprobs"]])
    # A pair's two answers follow one prompt: a micro-batch holds it once (actors.engine.shared_prefix).
    return SequenceBatch(tokens, tuple(lengths), {"mask": mask}, {"ref_logps": ref_logps}, group_size=2,
                         prefix_lengths=shareable_prefixes(ctx, [t.numel() for t in cols["prompt_ids"]]))


def pair_minibatches(ctx: CallContext, n_pairs: int, epoch: int) -> list[list[int]]:
    """Row indices of each minibatch of one epoch: the pairs are shuffled and cut like PPO rows
    (`minibatch_rows`, at least dp pairs each), then each pair p expands to rows 2p, 2p + 1."""
    return [[row for pair in pairs for row in (2 * pair, 2 * pair + 1)]
            for pairs in minibatch_rows(ctx, n_pairs, epoch)]


def run_dpo_actor(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, None]:
    """DPO (params beta, label_smoothing, ppo_epochs, ppo_minibatches): one optimizer step per
    minibatch of pairs; metrics averaged over steps as actor/<name> (dpo_loss, reward_margin,
    rewards_chosen, rewards_rejected, reward_accuracy, grad_norm, lr)."""
    engine = ctx.need_engine()
    batch = load_pairs(ctx, inputs)
    loss_fn = dpo_loss_fn(float(ctx.params.get("beta", 0.1)), float(ctx.params.get("label_smoothing", 0.0)))
    temperature = float(ctx.params.get("temperature", 1.0))
    mb = micro_batching(ctx)
    totals: dict[str, float] = {}
    steps, skipped = 0, 0.0
    for epoch in range(int(ctx.params.get("ppo_epochs", 1))):
        for rows in pair_minibatches(ctx, len(batch.lengths) // 2, epoch):
            minibatch = replace(select_rows(batch, rows), group_size=2)
            step_metrics = engine.train_step(minibatch, loss_fn, mb.n_micro, temperature, micro_batch_tokens=mb.tokens)
            skipped += check_update(step_metrics, ctx.call.name, ctx.call.iteration, ctx.params)
            for key, value in step_metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            steps += 1
    metrics = {f"actor/{key}": value / steps for key, value in totals.items() if key != "count"}
    metrics["actor/optimizer_steps"] = float(steps)
    metrics["actor/skipped_updates"] = skipped
    metrics["actor/pairs"] = float(len(batch.lengths) // 2)
    # Answer tokens per sequence (the driver's throughput counts them like generated tokens).
    metrics["rollout/response_length_mean"] = float(batch.token_data["mask"].sum()) / len(batch.lengths)
    return metrics, None


__all__ = [
    "POLICY_LOSSES", "masked_mean", "minibatch_rows", "policy_loss_fn", "ppo_returns",
    "rollout_kl", "rollout_metrics", "run_ppo_actor", "run_ppo_critic", "run_remax_actor", "select_rows",
    "train_actor",
    "dpo_loss_fn", "load_pairs", "pair_minibatches", "run_dpo_actor",
]
