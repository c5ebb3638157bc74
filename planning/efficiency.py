"""Efficiency factors of the cost model: the fraction of a GPU's peak figures (`HardwareSpec`)
each kind of op reaches, per hardware preset as fitted to measured runs, and their bounds.

The cost model (`planning.cost`, `planning.cost_terms`) multiplies the peaks by these; a
measured profile (`python -m app profile`) or a run's own calibration (`planning.calibrate`)
replaces a preset's factors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Ceiling of an efficiency factor. Profiles measure fractions of their own peaks (<= 1); a run's
# self-calibration (`planning.calibrate`) may find a machine faster than its preset says (> 1).
MAX_EFFICIENCY = 4.0

@dataclass(frozen=True)
class OpEfficiency:
    """Factors of the hardware peaks each kind of op reaches, in (0, MAX_EFFICIENCY]. 1.0 trusts
    the `HardwareSpec` figures as they are; a preset measured on its GPU has fitted factors
    (`PRESET_EFFICIENCY`), a profile that measured, say, decode at 70% of its HBM rate sets
    decode=0.7, and a calibration from a run's own call times may go above 1 where the figures
    are pessimistic."""

    gemm: float = 1.0  # prefill / forward / backward matmuls vs peak_flops
    decode: float = 1.0  # decode weight + KV streaming vs hbm_bw
    comm: float = 1.0  # collectives and p2p vs link bandwidths
    tp_comm: float = 1.0  # tp all-reduces inside real forward/backward steps, on top of comm
    optimizer: float = 1.0  # Adam step streaming vs hbm_bw
    elementwise: float = 1.0  # the non-matmul kernels of forward / backward passes vs hbm_bw

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= MAX_EFFICIENCY:
                raise ValueError(f"OpEfficiency.{f.name}={value!r}: must be a number in (0, {MAX_EFFICIENCY:g}]")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> OpEfficiency:
        known = {f.name for f in fields(OpEfficiency)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"OpEfficiency: unknown keys {unknown}; allowed: {sorted(known)}")
        return OpEfficiency(**{k: float(v) for k, v in data.items()})


# Efficiencies the engine's kernels reach on a preset's GPU, fitted to the first plans of measured
# runs (benchmarks/fit_efficiency.py; docs/benchmarks.md, issue 27): what a plan assumes before a
# run's own calibration (planning.calibrate) or a measured profile replaces them. A preset not
# listed takes 1.0: its peaks already fold typical efficiencies in.
# h200-141g: relative to its measured ceilings (785 TFLOP/s, 4.3 TB/s); fitted to 41 calls of 8
# runs (1B sweep, a 3B and an 8B actor, 2026-12-03): estimates within 3.9% at the median, 11.6% at
# worst (13.0% with each run left out of its own fit). gemm > 1 says the FLOP count at 785 TFLOP/s
# prices the passes a little slow; gemm and elementwise both scale with tokens, so whole-call
# times pin down their sum better than either (docs/benchmarks.md, issue 27, third step).
# elementwise 1.07 -> 1.30 (ninth step): with only the token count symbolic in the fused kernels
# (actors.engine.fusion) the peer bench's non-matmul GPU time fell by ~0.19 s of the training
# call's 1.43 s term (factor 1.23) and by 0.12 s of a forward's 0.48 s (1.42); 1.30 sits between.
# h100-80g: gemm kept at the H200's (the same tensor cores and power cap, and its measured matmul
# rate, 787 TFLOP/s, is the H200's); decode and elementwise fitted to 12 calls of 3 first plans on a
# lent H100 (0.5B, 1B, 3B; 2026-12-06): within 3.3% at the median, 11.5% at worst (12.5% with each
# run left out of its own fit). elementwise x hbm_bw is ~5.6 TB/s on both cards: the fused
# kernels run about as fast on the H100 as on the H200 although its HBM copies at 2.97 TB/s, not
# 4.3 (they are not bound by HBM alone). With the H200's factors the H100's first plans were off
# by 13% / 32% (docs/benchmarks.md, issue 27, eighteenth step).
PRESET_EFFICIENCY: dict[str, OpEfficiency] = {
    "h200-141g": OpEfficiency(gemm=1.12, decode=1.06, elementwise=1.30),
    "h100-80g": OpEfficiency(gemm=1.12, decode=1.16, elementwise=1.89),
}


def preset_efficiency(gpu: str) -> OpEfficiency:
    """The efficiency factors of hardware preset `gpu` (every factor 1.0 where none were fitted)."""
    return PRESET_EFFICIENCY.get(gpu, OpEfficiency())
