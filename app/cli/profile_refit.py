"""`python -m app profile --refit OLD.json --out NEW.json`: a profile's efficiency factors fitted
again, with the current cost model, to the measurements the profile stores. No device needed.

A profile's factors are what makes the cost model of its day reproduce the measured steps, so
when the model's terms change (issue 27 counted the optimizer step's bytes as the engine moves
them, 126 per parameter where 28 were assumed) old factors would be applied to new terms: the
optimizer factor 0.21 that made 28 bytes match would price the step 4.5x too slow. The refit
reads the stored timings (engine forward+backward, optimizer step, decode steps, collectives and
the tp step), rebuilds the profiled model and sizes, and writes the factors and the validation
table anew; the hardware figures and raw measurements are kept as measured, with a
`measurements.refit` note saying when and from what.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.cli.profile import fitted_efficiency, validation
from planning.hardware import hardware_preset
from planning.models import model_preset

CUT_MODEL_NAME = re.compile(r"^(?P<preset>.+)-(?P<layers>\d+)l$")


def refit_profile(profile: dict[str, Any], source: str) -> dict[str, Any]:
    """The profile with "efficiency" and "measurements.validation" refitted; raises ValueError
    naming the field when the stored measurements cannot be read back."""
    from actors.worker import ProfileSettings, cut_model
    from actors.worker.profiler import CollectiveTiming, EngineTiming

    measured = _field(profile, "measurements", dict, source)
    engine = _field(measured, "engine", dict, source, "measurements.")
    machine = _field(measured, "machine", dict, source, "measurements.")
    preset = hardware_preset(_field(profile, "preset", str, source))
    model = _profiled_model(_field(measured, "model", dict, source, "measurements."), source)
    settings = replace(ProfileSettings.choose(machine.get("device_type", "cuda"), cut_model(*model),
                                              bool(measured.get("quick", False))),
                       train_seqs=int(engine["train_seqs"]), train_seq_len=int(engine["train_seq_len"]),
                       decode_batch=int(engine["decode_batch"]), decode_prompt_len=int(engine["decode_prompt_len"]),
                       decode_steps=tuple(int(n) for n in engine["decode_steps"]))
    timing = EngineTiming(*(float(engine[f.name]) for f in fields(EngineTiming)))
    stored = measured.get("collectives")
    collectives = None
    if isinstance(stored, dict):
        known = {f.name for f in fields(CollectiveTiming)}
        values = {k: v for k, v in stored.items() if k in known}
        if values.get("tp_fwd_bwd_s") is None:
            values["tp_fwd_bwd_s"] = math.nan  # JSON has no NaN: a tp step not measured is null
        collectives = CollectiveTiming(**values)
    hw = preset.with_profile_fields(profile)
    efficiency = fitted_efficiency(hw, settings, timing, collectives)
    note = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "from": source,
            "efficiency_before": profile.get("efficiency")}
    return {**profile, "efficiency": efficiency,
            "measurements": {**measured, "validation": validation(preset, hw, efficiency, settings, timing, collectives),
                             "refit": note}}


def read_profile(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--refit {path}: not a readable profile JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--refit {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _profiled_model(model: dict[str, Any], source: str) -> tuple[Any, int]:
    """(preset spec, layers) of the cut model a profile timed, e.g. 'llama3.2-1b-2l'."""
    match = CUT_MODEL_NAME.match(str(model.get("name", "")))
    if match is None:
        raise ValueError(f"{source}: measurements.model.name={model.get('name')!r}: expected '<preset>-<N>l', "
                         "as `python -m app profile` writes it")
    spec, layers = model_preset(match["preset"]), int(match["layers"])
    if model.get("hidden_size") not in (None, spec.hidden_size):
        raise ValueError(f"{source}: measurements.model.hidden_size={model['hidden_size']}: preset "
                         f"{match['preset']} has {spec.hidden_size}")
    return spec, layers


def _field(data: dict[str, Any], key: str, kind: type, source: str, prefix: str = "") -> Any:
    value = data.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{source}: {prefix}{key}={value!r}: expected a {kind.__name__}, as `python -m app profile` "
                         "writes it")
    return value


__all__ = ["read_profile", "refit_profile"]
