"""PPO (Ouyang et al. 2022 / veRL recipe): what each call of the PPO graph computes, and with which
hyperparameters. The worker-side code is actors.worker.calls and actors.worker.train; this
module only fills `CallSpec.params` (the op name selects the computation and its loss).

Calls of `planning.algorithm_graphs.ppo_graph`, the op each runs and the data keys it produces:

  actor_gen    generate      prompt_ids, response_ids, logprobs (full temperature-scaled distribution), no_eos,
                             prompt_index (+ prompt, answer, decoded response with a tokenizer)
  rew_inf      rule_reward   rewards: fn(prompt, response, answer) per sequence (`module:function`)
               model_reward  rewards: the reward model's scalar head at the last token
  ref_inf      logprobs      ref_logprobs per response token (at the sampling temperature)
  critic_inf   values        values: V(state before each response token)
  actor_inf    logprobs      old_logprobs: the actor's own logprobs of the rollout under its current
                             weights (the behaviour policy of the ratio and of the KL penalty)
  actor_train  ppo_actor     KL-shaped rewards (kl_coef * k1/k2/k3 estimate of old vs ref, fixed or
                             adaptive coefficient), GAE with the critic's values, advantage whitening,
                             then ppo_epochs x ppo_minibatches steps of the clipped surrogate
                             (actors.rl.losses.ppo_policy_loss, + entropy bonus, x truncated importance
                             weights with rollout_is); metrics actor/pg_loss, actor/pg_clipfrac,
                             actor/ppo_kl, actor/kl, actor/grad_norm, actor/lr, actor/rollout_is_*, rollout/*
  critic_train ppo_critic    the same GAE returns; clipped value loss (actors.rl.losses.value_loss);
                             metrics critic/vf_loss, critic/vf_clipfrac, critic/grad_norm
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planning.dataflow import MFC

OUTPUT_KEYS: dict[str, tuple[str, ...]] = {
    "generate": ("prompt_ids", "response_ids", "logprobs", "no_eos", "prompt_index"),
    "rule_reward": ("rewards",),
    "model_reward": ("rewards",),
    "logprobs": ("ref_logprobs",),
    "values": ("values",),
    "ppo_actor": (),
    "ppo_critic": (),
}
KL_ESTIMATORS = ("k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
IS_LEVELS = ("token", "sequence")


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r}: {allowed}")


@dataclass(frozen=True)
class RolloutSettings:
    """How generation samples and how responses are scored (shared by PPO, GRPO and ReMax).

    tokenizer: 'module:Class' or an HF directory (decodes responses for rule rewards and logs);
    reward_fn: 'module:function' or 'file.py:function'; None scores with the reward model.
    env: multi-turn rollouts (the environments score the trajectories; reward_fn is not used).
    reward_text: a reward model with another tokenizer than the actor's reads the text: the
    arguments of the bridge the workers build (app.data.RewardText, named by its 'bridge' entry;
    app.run.tokenizer_check); None: it reads the actor's token ids as they are.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    tokenizer: str | None = None
    reward_fn: str | None = None
    compile_decode: bool = False
    fp8_weights: bool = False  # sampling.fp8: decode with FP8 MLP and head copies
    kv_cache_dtype: str = "auto"  # sampling.kv_cache_dtype
    compact_fraction: float = 0.75  # sampling.compact_fraction: finished rows leave the decode step
    # Multi-turn rollouts (app.algorithms.multiturn.env_params): what the worker builds the
    # environments from, and the token budget; None: single-turn generation.
    env: dict[str, Any] | None = None
    reward_text: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.temperature >= 0, "sampling.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        _check(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0 (0 = off)")
        _check(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _check(0 <= self.compact_fraction < 1, "sampling.compact_fraction", self.compact_fraction,
               "must be in [0, 1) (0 keeps finished rows in the decode step)")
        _check(self.reward_fn is None or ":" in self.reward_fn, "reward.function", self.reward_fn,
               "expected 'module:function' or 'file.py:function'")

    @property
    def logprob_temperature(self) -> float:
        """Temperature of train/ref logprobs: the sampling one (1 under greedy, which has none)."""
        return self.temperature if self.temperature > 0 else 1.0

    def generate_params(self, greedy: bool = False) -> dict[str, Any]:
        return {"op": "generate", "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed, "greedy": greedy,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id, "tokenizer": self.tokenizer,
                "compile": self.compile_decode, "fp8": self.fp8_weights,
                "kv_cache_dtype": self.kv_cache_dtype, "compact_fraction": self.compact_fraction,
                **({"env": self.env} if self.env else {})}

    def reward_params(self, in_prefix: str = "", out_key: str = "rewards") -> dict[str, Any]:
        if self.env:  # the environments' rewards, carried by the generation's rows
            return {"op": "env_reward", "out_key": out_key}
        if self.reward_fn is None:
            text = {"reward_text": self.reward_text} if self.reward_text else {}
            return {"op": "model_reward", "in_prefix": in_prefix, "out_key": out_key, **text}
        return {"op": "rule_reward", "reward_fn": self.reward_fn, "tokenizer": self.tokenizer,
                "in_prefix": in_prefix, "out_key": out_key}


@dataclass(frozen=True)
class PPOHyperparams:
    """PPO's knobs, veRL names. value_clip None turns value clipping off; clip_eps_high (DAPO) and
    dual_clip None keep the symmetric single clip. micro_batches None: the pipeline depth."""

    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    whiten: bool = True
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    shuffle: bool = True
    seed: int = 0
    no_eos_penalty: float = 0.0
    recompute_logprobs: bool = True
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        _check(self.kl_coef >= 0, "ppo.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.kl_estimator in KL_ESTIMATORS, "ppo.kl_estimator", self.kl_estimator,
               f"allowed: {', '.join(KL_ESTIMATORS)}")
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "ppo.gamma/lam", (self.gamma, self.lam), "must be in [0, 1]")
        _check(self.clip_eps > 0, "ppo.clip_eps", self.clip_eps, "must be > 0")
        _check(self.clip_eps_high is None or self.clip_eps_high > 0, "ppo.clip_eps_high", self.clip_eps_high, "must be > 0")
        _check(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", self.dual_clip, "must be > 1 or None")
        _check(self.value_clip is None or self.value_clip > 0, "ppo.value_clip", self.value_clip, "must be > 0 or None")
        _check(self.entropy_coef >= 0, "ppo.entropy_coef", self.entropy_coef, "must be >= 0")
        _check(self.loss_agg in LOSS_AGGREGATIONS, "ppo.loss_agg", self.loss_agg, f"allowed: {', '.join(LOSS_AGGREGATIONS)}")
        _check(self.ppo_epochs >= 1, "batch.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _check(self.ppo_minibatches >= 1, "batch.ppo_minibatches", self.ppo_minibatches, "must be >= 1")
        _check(self.micro_batches is None or self.micro_batches >= 1, "micro_batches", self.micro_batches, "must be >= 1")
        _check(self.no_eos_penalty >= 0, "ppo.no_eos_penalty", self.no_eos_penalty, "must be >= 0")
        _check(self.rollout_is is None or self.rollout_is in IS_LEVELS, "ppo.rollout_is", self.rollout_is,
               f"allowed: {', '.join(IS_LEVELS)} or None")
        _check(self.rollout_is_threshold >= 1, "ppo.rollout_is_threshold", self.rollout_is_threshold, "must be >= 1")
        _check(self.rollout_is is None or self.recompute_logprobs, "ppo.rollout_is", self.rollout_is,
               "None when recompute_logprobs is False")

    def shared_train_params(self, kl_coef: float, temperature: float) -> dict[str, Any]:
        """Params both train calls read (they compute the same advantages and returns)."""
        out = {"kl_coef": kl_coef, "kl_estimator": self.kl_estimator, "gamma": self.gamma, "lam": self.lam,
               "whiten": self.whiten, "loss_agg": self.loss_agg, "ppo_epochs": self.ppo_epochs,
               "ppo_minibatches": self.ppo_minibatches, "shuffle": self.shuffle, "seed": self.seed,
               "temperature": temperature, "no_eos_penalty": self.no_eos_penalty}
        if self.micro_batches is not None:
            out["micro_batches"] = self.micro_batches
        return out

    def actor_params(self, kl_coef: float, temperature: float) -> dict[str, Any]:
        return {**self.shared_train_params(kl_coef, temperature), "op": "ppo_actor", "clip_eps": self.clip_eps,
                "clip_eps_high": self.clip_eps_high, "dual_clip": self.dual_clip,
                "entropy_coef": self.entropy_coef, "recompute_logprobs": self.recompute_logprobs,
                "rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold}

    def critic_params(self, kl_coef: float, temperature: float) -> dict[str, Any]:
        return {**self.shared_train_params(kl_coef, temperature), "op": "ppo_critic", "value_clip": self.value_clip}


def inference_params(mfc: MFC, rollout: RolloutSettings) -> dict[str, Any]:
    """ref logprobs, the actor's own (old_logprobs), critic values or the reward call (rule or model)."""
    if mfc.role == "reward":
        return rollout.reward_params()
    if mfc.role == "critic":
        return {"op": "values"}
    out_key = "old_logprobs" if mfc.role == "actor" else "ref_logprobs"
    return {"op": "logprobs", "temperature": rollout.logprob_temperature, "out_key": out_key}


def call_params(mfc: MFC, rollout: RolloutSettings, hp: PPOHyperparams, kl_coef: float) -> dict[str, Any]:
    """CallSpec.params of one call of the PPO graph; kl_coef: this iteration's KL weight."""
    if mfc.kind == "generate":
        return rollout.generate_params()
    if mfc.kind == "inference":
        return inference_params(mfc, rollout)
    if mfc.role == "critic":
        return hp.critic_params(kl_coef, rollout.logprob_temperature)
    if mfc.role != "actor":
        raise ValueError(f"PPO call {mfc.name}: trains role {mfc.role!r}; only actor and critic train")
    return hp.actor_params(kl_coef, rollout.logprob_temperature)


__all__ = ["IS_LEVELS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "OUTPUT_KEYS", "PPOHyperparams", "RolloutSettings", "call_params",
           "inference_params"]
