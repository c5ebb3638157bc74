"""Checks shared by the commands that run one HF checkpoint under one layout (`generate`, `score`)."""

from __future__ import annotations

from pathlib import Path

from planning.layout import Layout
from planning.models import ModelSpec, validate_tp


def checkpoint_and_layout(model: str, layout_text: str) -> tuple[Path, ModelSpec, Layout]:
    """(checkpoint dir, its ModelSpec, the parsed layout), or a ValueError/FileNotFoundError naming
    the flag: no config.json, a layout that does not parse, tp not dividing the model, pp above
    its layer count. Run before any process or Ray worker starts."""
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json (expected an HF checkpoint directory)")
    layout = Layout.parse(layout_text)
    spec = ModelSpec.from_hf_config(model_dir)
    validate_tp(spec, layout.tp)
    if layout.pp > spec.n_layers:
        raise ValueError(f"--layout {layout_text}: pp={layout.pp} exceeds the model's {spec.n_layers} layers")
    return model_dir, spec, layout
