"""What each algorithm reads from the config, and the checks that involve more than one field.

The algorithm families (pure Python, shared by the graph builder in app.config.problem and the
settings of app.algorithms):
  KL in the reward  ppo, remax, rloo, reinforce_pp, reinforce_pp_baseline: ppo.kl_coef shapes the
                    per-token rewards; the reference call runs when it is > 0 (always for ppo)
  KL as a loss      grpo, dapo, gspo: grpo.kl_loss_coef (the reference call runs when > 0);
                    ppo.kl_coef must stay unset or 0
  grouped           grpo, rloo, reinforce_pp_baseline, dapo, gspo: batch.group_size >= 2 samples
                    per prompt, advantages from each prompt's group
Every failure is a `ConfigError` naming the field (checked in `validate_config`, before any run).

app.config.experiment calls `check_training_fields` while validating, so this module sits below
it and never imports it: the functions take any `ConfigFields`, the part of an `ExperimentConfig`
they read (a structural type, which `ExperimentConfig` satisfies).
"""

from __future__ import annotations

from typing import Protocol

from app.config.errors import ConfigError
from app.config.sections import DAPOConfig, GRPOConfig, PPOConfig, SamplingConfig

ALGORITHMS = ("ppo", "grpo", "dpo", "remax", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo")
KL_IN_REWARD = ("ppo", "remax", "rloo", "reinforce_pp", "reinforce_pp_baseline")
KL_AS_LOSS = ("grpo", "dapo", "gspo")
GROUPED = ("grpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo")
SAMPLES_PER_PROMPT = GROUPED + ("reinforce_pp",)  # generation samples batch.group_size per prompt
DAPO_CLIP_EPS_HIGH = 0.28


# What these functions read of an `app.config.experiment.ExperimentConfig`, as structural types
# (see the module docstring); the sections of app.config.sections are used as they are.
class BatchFields(Protocol):
    @property
    def prompts(self) -> int: ...
    @property
    def gen_len(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def ppo_minibatches(self) -> int: ...


class RunFields(Protocol):
    @property
    def max_staleness(self) -> int: ...


class PlanFields(Protocol):
    @property
    def recalibrate_after(self) -> int | None: ...


class ConfigFields(Protocol):
    """The fields of an `app.config.experiment.ExperimentConfig` the algorithm checks read."""

    @property
    def algorithm(self) -> str: ...
    @property
    def batch(self) -> BatchFields: ...
    @property
    def run(self) -> RunFields: ...
    @property
    def plan(self) -> PlanFields: ...
    @property
    def ppo(self) -> PPOConfig: ...
    @property
    def grpo(self) -> GRPOConfig: ...
    @property
    def dapo(self) -> DAPOConfig: ...
    @property
    def sampling(self) -> SamplingConfig: ...


def samples_per_prompt(cfg: ConfigFields) -> int:
    """Sequences generated per prompt: batch.group_size for the outcome algorithms, else 1."""
    return cfg.batch.group_size if cfg.algorithm in SAMPLES_PER_PROMPT else 1


def uses_ref(cfg: ConfigFields) -> bool:
    """Whether a loss reads the reference's logprobs (else its call is pruned from the graph)."""
    if cfg.algorithm in ("ppo", "dpo"):
        return True
    if cfg.algorithm in KL_AS_LOSS:
        return cfg.grpo.kl_loss_coef > 0
    return cfg.ppo.kl_coef > 0


def rollout_is_level(cfg: ConfigFields) -> str | None:
    """ppo.rollout_is resolved: 'token' / 'sequence', or None (auto: token when stale, or when
    the rollout samples from FP8 weights and the logprobs are recomputed in bf16)."""
    level = cfg.ppo.rollout_is
    if level == "auto":
        fp8_gap = cfg.sampling.lossy_rollout and cfg.ppo.recompute_logprobs
        return "token" if cfg.run.max_staleness > 0 or fp8_gap else None
    return None if level == "none" else level


def generation_rounds(cfg: ConfigFields) -> float:
    """Expected generation rounds per iteration: DAPO's dynamic sampling keeps 1 - expected_drop_rate
    of the groups, so it generates 1 / (1 - rate) rounds on average (at most max_gen_rounds)."""
    d = cfg.dapo
    if cfg.algorithm != "dapo" or not d.dynamic_sampling:
        return 1.0
    return min(float(d.max_gen_rounds), 1.0 / (1.0 - d.expected_drop_rate))


def check_training_fields(cfg: ConfigFields) -> None:
    """Cross-field checks of the algorithm sections; raises ConfigError naming the field."""
    a, b = cfg.algorithm, cfg.batch
    if a in KL_AS_LOSS and "kl_coef" in cfg.ppo.model_fields_set and cfg.ppo.kl_coef != 0:
        # These put no KL penalty into the rewards: a non-zero ppo.kl_coef would be ignored silently.
        raise ConfigError("ppo.kl_coef", cfg.ppo.kl_coef, f"unset or 0 for {a}, whose KL is a loss term: set "
                          "grpo.kl_loss_coef (default 0.001) instead")
    if a in GROUPED and b.group_size < 2:
        raise ConfigError("batch.group_size", b.group_size, f">= 2 for {a}: its advantages compare the samples "
                          "of one prompt")
    seqs = b.prompts * samples_per_prompt(cfg)
    if a != "dpo" and seqs % b.ppo_minibatches:
        raise ConfigError("batch.ppo_minibatches", b.ppo_minibatches, f"a divisor of the {seqs} sequences per iteration")
    if a == "dapo" and cfg.dapo.overlong_buffer > b.gen_len:
        raise ConfigError("dapo.overlong_buffer", cfg.dapo.overlong_buffer, f"<= batch.gen_len={b.gen_len}")
    k = cfg.run.max_staleness
    if k and a == "dpo":
        raise ConfigError("run.max_staleness", k, "0 for dpo, which generates nothing")
    if k and not cfg.ppo.recompute_logprobs:
        raise ConfigError("run.max_staleness", k, "0 unless ppo.recompute_logprobs is true (the ratio and the "
                          "importance weights are taken against the current policy)")
    if k and a == "dapo" and cfg.dapo.dynamic_sampling:
        raise ConfigError("run.max_staleness", k, "0 with dapo.dynamic_sampling (its rounds wait on the rewards); "
                          "or set dapo.dynamic_sampling=false")
    if k and cfg.plan.recalibrate_after is not None:
        raise ConfigError("plan.recalibrate_after", cfg.plan.recalibrate_after,
                          "unset when run.max_staleness > 0 (a plan switch needs no iteration in flight, and "
                          "bounded staleness always keeps a rollout ahead)")
    if rollout_is_level(cfg) is not None and not cfg.ppo.recompute_logprobs:
        raise ConfigError("ppo.rollout_is", cfg.ppo.rollout_is, "none when ppo.recompute_logprobs is false "
                          "(the weights compare the recomputed logprobs with the rollout's)")


__all__ = [
    "ALGORITHMS", "ConfigFields", "DAPO_CLIP_EPS_HIGH", "GROUPED", "KL_AS_LOSS", "KL_IN_REWARD", "SAMPLES_PER_PROMPT",
    "check_training_fields", "generation_rounds", "rollout_is_level", "samples_per_prompt", "uses_ref",
]
