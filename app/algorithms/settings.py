"""Per call of an algorithm's dataflow graph, the `CallSpec.params` that tell a ModelWorker what to
compute (op name, sampling, hyperparameters, loss choice), from the experiment config.

    settings = settings_from_config(cfg, tokenizer="app.data.toy_task:CharTokenizer",
                                    reward_fn="app.data.rewards:toy_reward", eos_token_id=2)
    params = call_params(settings, mfc, kl_coef=kl_controller.value)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import app.algorithms.dpo as dpo
import app.algorithms.grpo as grpo
import app.algorithms.outcome as outcome
import app.algorithms.ppo as ppo
import app.algorithms.remax as remax
from app.algorithms.dpo import DPOHyperparams
from app.algorithms.grpo import GRPOHyperparams
from app.algorithms.outcome import OUTCOME_RUNTIME, OutcomeHyperparams
from app.algorithms.ppo import PPOHyperparams, RolloutSettings
from app.config import DAPO_CLIP_EPS_HIGH, rollout_is_level, samples_per_prompt
from planning.dataflow import MFC

RUNTIME_ALGORITHMS = ("ppo", "grpo", "remax", "dpo", *OUTCOME_RUNTIME)
# The algorithms whose generation can be multi-turn (rollout.env): ReMax's greedy baseline and
# DPO's offline pairs have no place for an environment.
MULTI_TURN_ALGORITHMS = ("ppo", "grpo", *OUTCOME_RUNTIME)
ENV_SESSIONS = "app.envs.sessions:EnvSessions"  # what the workers build environments with (by name)


@dataclass(frozen=True)
class AlgorithmSettings:
    """Everything the calls of one algorithm need besides the per-iteration KL coefficient.

    dynamic_sampling_rounds: DAPO's dynamic sampling, at most this many generation rounds per
    iteration (app.run.dynamic_sampling); None: off."""

    algorithm: str
    rollout: RolloutSettings
    ppo: PPOHyperparams
    grpo: GRPOHyperparams | None = None
    dpo: DPOHyperparams | None = None
    outcome: OutcomeHyperparams | None = None
    dynamic_sampling_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in RUNTIME_ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: the runtime runs {', '.join(RUNTIME_ALGORITHMS)}")
        if self.algorithm == "grpo" and self.grpo is None:
            raise ValueError("algorithm='grpo': settings.grpo (GRPOHyperparams) is required")
        if self.algorithm == "dpo" and self.dpo is None:
            raise ValueError("algorithm='dpo': settings.dpo (DPOHyperparams) is required")
        if self.algorithm in OUTCOME_RUNTIME and (self.outcome is None or self.outcome.algorithm != self.algorithm):
            raise ValueError(f"algorithm={self.algorithm!r}: settings.outcome (OutcomeHyperparams of it) is required")


def call_params(settings: AlgorithmSettings, mfc: MFC, kl_coef: float) -> dict[str, Any]:
    """CallSpec.params of `mfc` under `settings`; kl_coef: the KL weight of this iteration."""
    if settings.algorithm == "ppo":
        return ppo.call_params(mfc, settings.rollout, settings.ppo, kl_coef)
    if settings.algorithm == "grpo":
        assert settings.grpo is not None
        return grpo.call_params(mfc, settings.rollout, settings.ppo, settings.grpo)
    if settings.algorithm == "dpo":
        assert settings.dpo is not None
        return dpo.call_params(mfc, settings.dpo)
    if settings.outcome is not None:
        return outcome.call_params(mfc, settings.rollout, settings.ppo, settings.outcome, kl_coef)
    return remax.call_params(mfc, settings.rollout, settings.ppo, kl_coef)


def settings_from_config(cfg: Any, tokenizer: str | None, reward_fn: str | None, eos_token_id: int | None,
                         pad_token_id: int = 0) -> AlgorithmSettings:
    """Settings from an `app.config.ExperimentConfig` (sections sampling, ppo, batch, run).

    tokenizer / reward_fn: resolved specs ('module:attr' or a directory; None = reward model).
    """
    s, p, b = cfg.sampling, cfg.ppo, cfg.batch
    rollout = RolloutSettings(max_new_tokens=b.gen_len, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              seed=cfg.run.seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              tokenizer=tokenizer, reward_fn=reward_fn, compile_decode=s.compile,
                              fp8_weights=s.fp8, kv_cache_dtype=s.kv_cache_dtype,
                              compact_fraction=s.compact_fraction,
                              env=env_params(cfg, tokenizer))
    clip_high = p.clip_eps_high
    if clip_high is None and cfg.algorithm == "dapo":
        clip_high = DAPO_CLIP_EPS_HIGH  # DAPO's clip-higher unless set
    hp = PPOHyperparams(kl_coef=p.kl_coef, kl_estimator=p.kl_estimator, gamma=p.gamma, lam=p.lam, clip_eps=p.clip_eps,
                        clip_eps_high=clip_high, dual_clip=p.dual_clip, value_clip=p.value_clip_eps, whiten=p.adv_norm,
                        entropy_coef=p.entropy_coef, loss_agg=p.loss_agg, ppo_epochs=b.ppo_epochs,
                        ppo_minibatches=b.ppo_minibatches, seed=cfg.run.seed, no_eos_penalty=p.no_eos_penalty,
                        recompute_logprobs=p.recompute_logprobs, rollout_is=rollout_is_level(cfg),
                        rollout_is_threshold=p.rollout_is_threshold)
    group = None
    if cfg.algorithm == "grpo":
        g = cfg.grpo
        group = GRPOHyperparams(group_size=b.group_size, kl_loss_coef=g.kl_loss_coef,
                                kl_loss_estimator=g.kl_loss_estimator, scale_by_std=g.scale_by_std)
    pairs = None
    if cfg.algorithm == "dpo":
        pairs = DPOHyperparams(beta=cfg.dpo.beta, label_smoothing=cfg.dpo.label_smoothing, epochs=b.ppo_epochs,
                               minibatches=b.ppo_minibatches, seed=cfg.run.seed)
    rounds = cfg.dapo.max_gen_rounds if cfg.algorithm == "dapo" and cfg.dapo.dynamic_sampling else None
    return AlgorithmSettings(cfg.algorithm, rollout, hp, group, pairs, outcome_settings(cfg), rounds)


def env_params(cfg: Any, tokenizer: str | None) -> dict[str, Any] | None:
    """What a generation worker builds its environments from (`app.envs.sessions.EnvSessions`'s
    arguments, plain values) and the trajectory's token budget; None without `rollout.env`."""
    r = cfg.rollout
    if r.env is None:
        return None
    if tokenizer is None:
        raise ValueError("rollout.env: multi-turn rollouts need the data tokenizer (data.tokenizer) on the workers")
    kwargs = {
        "env": r.env, "env_kwargs": dict(r.env_kwargs), "tokenizer": tokenizer, "chat_template": cfg.data.chat_template,
        "observation_role": r.observation_role, "max_turns": r.max_turns,
        "max_observation_tokens": r.max_observation_tokens, "env_timeout_s": r.env_timeout_s,
        "env_workers": r.env_workers, "reward_discount": r.reward_discount,
        "max_prompt_tokens": cfg.data.max_prompt_len or cfg.batch.prompt_len,
    }
    return {"sessions": ENV_SESSIONS, "budget": r.response_budget(cfg.batch.gen_len), "kwargs": kwargs}


def outcome_settings(cfg: Any) -> OutcomeHyperparams | None:
    """The OutcomeHyperparams of an outcome algorithm's config (None for the others)."""
    if cfg.algorithm not in OUTCOME_RUNTIME:
        return None
    g, d = cfg.grpo, cfg.dapo
    kl_loss = g.kl_loss_coef if cfg.algorithm in ("dapo", "gspo") else 0.0
    clip = (cfg.gspo.clip_eps, cfg.gspo.clip_eps_high) if cfg.algorithm == "gspo" else (None, None)
    overlong = (d.overlong_buffer, d.overlong_penalty) if cfg.algorithm == "dapo" else (0, 1.0)
    return OutcomeHyperparams(cfg.algorithm, samples_per_prompt(cfg), kl_loss, g.kl_loss_estimator, g.scale_by_std,
                              clip[0], clip[1], overlong[0], overlong[1])


__all__ = [
    "AlgorithmSettings", "ENV_SESSIONS", "MULTI_TURN_ALGORITHMS", "RUNTIME_ALGORITHMS", "call_params", "env_params",
    "outcome_settings", "settings_from_config",
]
