"""AdamW's hyperparameters and learning-rate schedule (plain values, sent to workers as dicts).

`ShardedAdamW` (actors.engine.optimizer) takes an `AdamWConfig`; `lr_at` is the schedule it
follows: linear warmup, then cosine decay to a floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters and the learning-rate schedule.

    total_steps: steps of the whole run for the cosine decay (None keeps lr constant after warmup).
    max_grad_norm: clip threshold for the global gradient norm (None disables clipping).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"AdamWConfig.lr={self.lr}: must be >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas={self.betas}: each must be in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"AdamWConfig eps={self.eps}, weight_decay={self.weight_decay}: eps > 0, decay >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"AdamWConfig.max_grad_norm={self.max_grad_norm}: must be > 0 or None")
        if self.warmup_steps < 0:
            raise ValueError(f"AdamWConfig.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.total_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(f"AdamWConfig.total_steps={self.total_steps}: must be >= warmup_steps={self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"AdamWConfig.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")


def adamw_config_from(owner: str, values: dict[str, object]) -> AdamWConfig:
    """An AdamWConfig from a plain dict (as sent over Ray); unknown keys raise naming `owner`."""
    allowed = set(AdamWConfig.__dataclass_fields__)
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"optim for {owner}: unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}")
    fields = dict(values)
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])  # type: ignore[arg-type]
    return AdamWConfig(**fields)  # type: ignore[arg-type]


def lr_at(config: AdamWConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr over warmup_steps,
    then cosine decay to lr * min_lr_ratio at total_steps (constant lr when total_steps is None)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.total_steps is None or config.total_steps == config.warmup_steps:
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


__all__ = ["AdamWConfig", "adamw_config_from", "lr_at"]
