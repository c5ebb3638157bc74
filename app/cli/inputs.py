"""Checks shared by the commands that run one HF checkpoint under one layout (`generate`, `score`).

Everything here runs before torch is imported or any process or Ray worker starts; a bad flag
is a ConfigError naming the flag (exit status 2, one line).
"""

from __future__ import annotations

import math
from pathlib import Path

from app.config import ConfigError, check_model_dir, check_out_path
from planning.layout import Layout
from planning.models import ModelSpec, validate_tp


def checkpoint_and_layout(model: str, layout_text: str) -> tuple[Path, ModelSpec, Layout]:
    """(checkpoint dir, its ModelSpec, the parsed layout), or a ValueError/FileNotFoundError naming
    the flag: no config.json, weights missing, truncated or not matching the config, a layout
    that does not parse, tp not dividing the model, pp above its layer count."""
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json (expected an HF checkpoint directory)")
    try:
        spec = ModelSpec.from_hf_config(model_dir)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("--model", str(model_dir), "an HF model directory with a LLaMA-family config.json",
                          problem=f"unreadable config.json ({type(exc).__name__}: {exc})") from None
    check_model_dir("--model", model_dir, spec, critic=False)
    try:
        layout = Layout.parse(layout_text)
    except ValueError as exc:
        raise ConfigError("--layout", layout_text, "a layout like tp2,pp1 or dp2tp1pp1", problem=str(exc)) from None
    validate_tp(spec, layout.tp)
    if layout.pp > spec.n_layers:
        raise ValueError(f"--layout {layout_text}: pp={layout.pp} exceeds the model's {spec.n_layers} layers")
    return model_dir, spec, layout


def check_at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(flag, value, f"an integer >= {minimum}")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """--temperature >= 0 (0 = greedy), --top-p in (0, 1], --top-k >= 0 (0 = off)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError("--temperature", temperature, "a number >= 0 (0 = greedy)")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ConfigError("--top-p", top_p, "a number in (0, 1]")
    check_at_least("--top-k", top_k, 0)


def check_inputs(data: str, out: str) -> Path:
    """--data an existing file; --out a file in an existing directory. Returns the output path."""
    if not Path(data).is_file():
        raise ConfigError("--data", data, "an existing JSONL / Parquet file", problem="no such file")
    return check_out_path("--out", out)


__all__ = ["check_at_least", "check_inputs", "check_sampling", "checkpoint_and_layout"]
