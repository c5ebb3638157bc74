"""Rotary position embeddings of the LLaMA family: inverse frequencies (with Llama 3's scaling),
the cos / sin tables of a packed batch's positions, and the rotation of queries and keys.

Plain torch, no state: `actors.engine.model` caches the inverse frequencies per device and runs
`apply_rotary` eager or fused (actors.engine.fusion) like its other elementwise work.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from planning.models import ModelSpec


def rope_inv_freq(spec: ModelSpec, device: torch.device | str | None = None) -> Tensor:
    """float32 [head_dim/2] inverse frequencies, with Llama-3 scaling when the spec asks for it."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = dict(spec.rope_scaling) if spec.rope_scaling else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling.rope_type={rope_type!r}: unsupported; allowed: default, llama3")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (same arithmetic as transformers' _compute_llama3_parameters).
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim] for int64 positions [T]; angles in float32, then cast to `dtype`."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, D]: HF's "rotate half" layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, D] by position; cos/sin [T, D] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


__all__ = ["apply_rotary", "rope_cos_sin", "rope_inv_freq"]
