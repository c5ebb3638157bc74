"""The behaviour policy's logprobs of a train call, and the importance weights against the rollout's.

PPO's ratio and a KL penalty in the reward compare the policy with the actor's own logprobs under
its current weights ("old" logprobs), never the generation's: those come from PPO's actor_inf
call, are recomputed under the train layout, or, when nothing needs them before the only
optimizer step, are taken from that step's forward (`reuses_forward_logprobs`). The rollout's
logprobs (generation time, possibly older weights under bounded staleness) enter only through
truncated importance weights (params['rollout_is'], actors.rl.importance). Tensors are float32
[T] over the packed rows of `actors.worker.rollout.Rollout`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from actors.rl import truncated_is_terms, truncated_is_weights
from actors.worker.calls import CallContext, micro_batching
from actors.worker.rollout import Rollout, prompt_batch


def reuses_forward_logprobs(params: dict[str, Any]) -> bool:
    """Whether the actor may take its old logprobs from the training forward itself instead of a
    separate forward pass: with recomputation on, one minibatch and one epoch, the only
    optimizer step runs its forward on exactly the weights the recomputation would use, so the
    two are the same numbers (up to float summation order) and the extra pass over every token
    is wasted work. TRL (num_iterations=1, one step per generation) and veRL do the same.
    `train_actor` also needs no old logprobs computed beforehand; importance weights, when on,
    come from the same forward (`forward_is_terms`)."""
    return (bool(params.get("recompute_logprobs", True)) and int(params.get("ppo_minibatches", 1)) == 1
            and int(params.get("ppo_epochs", 1)) == 1)


def logprobs_before_step(ctx: CallContext, r: Rollout) -> Tensor | None:
    """The behaviour logprobs [T] when the advantages need them before the step (a KL penalty in
    the reward against a reference), else None (`train_actor` then takes or recomputes them)."""
    if r.ref_logprobs is not None and float(ctx.params.get("kl_coef", 0.0)) > 0:
        return behaviour_logprobs(ctx, r)
    return None


def behaviour_logprobs(ctx: CallContext, r: Rollout) -> Tensor:
    """The behaviour policy's logprobs [T]: the actor_inf call's `old_logprobs` when given, else
    recomputed by the actor under the train layout (params['recompute_logprobs'], default True:
    the first PPO ratio is then exactly 1), else the sampling logprobs from generation."""
    if r.old_logprobs is not None:
        return r.old_logprobs * r.mask
    if not bool(ctx.params.get("recompute_logprobs", True)):
        return r.logprobs
    engine = ctx.need_engine()
    batch = prompt_batch(ctx, r)
    temperature = float(ctx.params.get("temperature", 1.0))
    mb = micro_batching(ctx)
    logprobs = engine.forward_logprobs(batch, mb.n_micro, temperature, gather_dp=True, micro_batch_tokens=mb.tokens)
    return logprobs.float().cpu() * r.mask


def importance_weights(ctx: CallContext, r: Rollout, old: Tensor) -> tuple[Tensor | None, dict[str, float]]:
    """Truncated importance weights [T] of old over the rollout's logprobs (params['rollout_is']:
    'token' or 'sequence'; None: no correction) and their metrics actor/rollout_is_*."""
    level = ctx.params.get("rollout_is")
    if level is None:
        return None, {}
    weights, stats = truncated_is_weights(old, r.logprobs, r.mask, r.cu_seqlens, str(level),
                                          float(ctx.params.get("rollout_is_threshold", 2.0)))
    return weights, {f"actor/{k}": v for k, v in stats.items()}


# Statistics of the importance weights a reused forward computes per micro-batch (`forward_is_terms`):
# sums the engine divides by one global count, so their ratios are exact (`forward_is_metrics`).
_IS_SUMS = ("is_weight_sum", "is_tokens", "is_truncated_tokens")


def forward_is_terms(old: Tensor, data: dict[str, Tensor], level: str,
                     threshold: float) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Truncated importance weights [T_mb] of this forward's own detached logprobs `old` over the
    sampling logprobs (data["sample_logprobs"]), as `importance_weights` would compute them from
    a separate forward; with their sums over the micro-batch's response tokens (`_IS_SUMS`) and
    its largest weight before truncation. Sequence level needs whole rows in the micro-batch,
    which the engine's split guarantees."""
    mask = data["mask"]
    weights, raw = truncated_is_terms(old, data["sample_logprobs"], mask, data["cu_seqlens"], level, threshold)
    m = mask.float()
    sums = {"is_weight_sum": weights.sum(), "is_tokens": m.sum(),
            "is_truncated_tokens": ((raw > threshold) & (m > 0)).float().sum()}
    return weights, sums, {"rollout_is_max": raw.max() if raw.numel() else raw.new_zeros(())}


def forward_is_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` of one optimizer step with the `_IS_SUMS` statistics turned into
    actor/rollout_is_mean and actor/rollout_is_truncated (fractions of response tokens, as
    `truncated_is_weights` reports them; both sums carry the same divisor, so it cancels)."""
    out = {k: v for k, v in metrics.items() if k.removeprefix("actor/") not in _IS_SUMS}
    tokens = metrics["actor/is_tokens"]
    out["actor/rollout_is_mean"] = metrics["actor/is_weight_sum"] / tokens if tokens > 0 else 0.0
    out["actor/rollout_is_truncated"] = metrics["actor/is_truncated_tokens"] / tokens if tokens > 0 else 0.0
    return out


__all__ = ["behaviour_logprobs", "forward_is_metrics", "forward_is_terms", "importance_weights",
           "logprobs_before_step", "reuses_forward_logprobs"]
