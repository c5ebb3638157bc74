"""A profile's efficiency factors fitted to its timings: when `python -m app profile` measures
(`fitted_efficiency`, `validation`) and again, with the current cost model, from the timings a
profile stores (`python -m app profile --refit OLD.json --out NEW.json`: no device needed).

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
from dataclasses import asdict, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planning.efficiency import OpEfficiency, preset_efficiency
from planning.hardware import HardwareSpec, hardware_preset
from planning.models import model_preset

if TYPE_CHECKING:  # torch-importing modules stay out of `python -m app plan`'s start-up
    from actors.worker import CollectiveTiming, EngineTiming, ProfileSettings

CUT_MODEL_NAME = re.compile(r"^(?P<preset>.+)-(?P<layers>\d+)l$")


def refit_profile(profile: dict[str, Any], source: str) -> dict[str, Any]:
    """The profile with "efficiency" and "measurements.validation" refitted; raises ValueError
    naming the field when the stored measurements cannot be read back."""
    from actors.worker import CollectiveTiming, EngineTiming, ProfileSettings, cut_model

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


def fitted_efficiency(hw: HardwareSpec, settings: ProfileSettings, timing: EngineTiming,
                      collectives: CollectiveTiming | None) -> dict[str, float]:
    """The profile's "efficiency" block: gemm, decode and optimizer fitted to the engine's timings
    through the cost model, comm from the bare collectives, tp_comm from the engine's tp step
    (comm and tp_comm left out where not measured: the loader's 1.0 stays)."""
    from actors.worker import MIN_EFFICIENCY, fit_efficiency, fit_tp_comm

    efficiency = asdict(fit_efficiency(hw, settings, timing))
    del efficiency["elementwise"]  # not profiled apart from gemm: fitted to whole calls (PRESET_EFFICIENCY)
    if collectives is None:
        del efficiency["comm"], efficiency["tp_comm"]
        return efficiency
    # intra_node_bw is the broadcast rate; all-reduces reach this share of it.
    efficiency["comm"] = min(1.0, max(MIN_EFFICIENCY, collectives.allreduce_bw / collectives.broadcast_bw))
    if math.isfinite(collectives.tp_fwd_bwd_s):
        # The tp all-reduces as they perform inside the engine's steps (fitted on the tp run).
        efficiency["tp_comm"] = fit_tp_comm(hw, OpEfficiency.from_dict(efficiency), settings, collectives.ranks,
                                            collectives.tp_fwd_bwd_s)
    else:
        del efficiency["tp_comm"]
    return efficiency


def validation(preset: HardwareSpec, hw: HardwareSpec, efficiency: dict[str, float], settings: ProfileSettings,
               timing: EngineTiming, collectives: CollectiveTiming | None) -> dict[str, dict[str, float]]:
    """Per profiled step: measured seconds beside the cost model's at the preset (with its fitted
    efficiencies, `preset_efficiency`) and at the profile."""
    from actors.worker import predicted_seconds, predicted_tp_fwd_bwd_s

    preset_eff, profile_eff = preset_efficiency(preset.name), OpEfficiency.from_dict(efficiency)
    observed = {"fwd_bwd_s": timing.fwd_bwd_s, "optimizer_s": timing.optimizer_s,
                "decode_step_s": timing.decode_step_s(settings.decode_steps)}
    at_preset = predicted_seconds(preset, preset_eff, settings)
    at_profile = predicted_seconds(hw, profile_eff, settings)
    if collectives is not None and math.isfinite(collectives.tp_fwd_bwd_s):
        tp_key = f"tp{collectives.ranks}_fwd_bwd_s"
        observed[tp_key] = collectives.tp_fwd_bwd_s
        at_preset[tp_key] = predicted_tp_fwd_bwd_s(preset, preset_eff, settings, collectives.ranks)
        at_profile[tp_key] = predicted_tp_fwd_bwd_s(hw, profile_eff, settings, collectives.ranks)
    return {key: {"measured_s": observed[key], "preset_s": at_preset[key], "profile_s": at_profile[key]}
            for key in observed}


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


__all__ = ["fitted_efficiency", "read_profile", "refit_profile", "validation"]
