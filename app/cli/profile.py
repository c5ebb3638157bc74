"""`python -m app profile --out profile.json [--gpu PRESET] [--ranks 2] [--quick] [--inter-node] [--refit OLD.json]`.

Measures this machine (actors.worker.profiler: matmul FLOP/s, memory copy bandwidth, collectives
over local processes, an engine train step and decode steps against the cost model; on CUDA also
the pinned host <-> GPU copy rate and host RAM per GPU for optimizer offload, app.cli.host_link), prints a
short table of measured vs preset figures and writes the profile JSON. A config then plans with
it through `plan.profile: profile.json`: the measured HardwareSpec fields replace the preset's
(`HardwareSpec.with_profile`) and its "efficiency" block scales the op kinds (`OpEfficiency`).

Device: CUDA when available (bf16, one GPU per rank, NCCL), else CPU (fp32, gloo). The preset
defaults to the one matching the GPU's name ("cpu" on CPU). `--quick` finishes in seconds on
CPU; the full run is sized for about a minute on an H200.

`--inter-node` measures the link between two nodes instead (cluster.link_probe: one process on
each of the first two GPU nodes of the Ray cluster at RAY_ADDRESS, a broadcast between them)
and writes `inter_node_bw` into --out, keeping the figures already there: run it after the
single-node profile to complete it. `--refit OLD.json` measures nothing: it fits the factors of
an earlier profile again with the current cost model (app.cli.profile_refit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli.host_link import measure_host_link
from app.cli.profile_refit import fitted_efficiency, read_profile, refit_profile, validation
from app.config import check_out_path
from planning.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from planning.models import MODEL_PRESETS, ModelSpec, model_preset

if TYPE_CHECKING:  # torch-importing modules stay out of `python -m app plan`'s start-up
    from actors.worker import ProfileSettings

# GPU name fragment -> hardware preset, for the default --gpu.
PRESET_BY_DEVICE_NAME = (("H200", "h200-141g"), ("H100", "h100-80g"), ("A100", "a100-80g"))
# Spawned gloo processes on CPU: more than this only measures the scheduler.
MAX_CPU_RANKS = 8


def add_parser(subparsers: Any) -> None:
    """Register the `profile` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "profile", help="measure this machine's costs and write the profile JSON the planner reads",
        description="Microbenchmark this GPU (or CPU) and write a profile for `plan.profile`.",
    )
    parser.add_argument("--out", default="profile.json", metavar="PROFILE.json", help="where to write the profile")
    parser.add_argument("--gpu", default=None, metavar="PRESET",
                        help=f"hardware preset to compare with: {', '.join(HARDWARE_PRESETS)} (default: from the device)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="local processes for the collective benchmarks (default: 2 with 2+ GPUs, else 1)")
    parser.add_argument("--model", default=None, metavar="PRESET",
                        help="model shape of the engine and decode benchmarks (default: llama3.2-1b on GPU, tiny on CPU)")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks of that model to keep")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds on CPU")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--refit", default=None, metavar="OLD.json",
                        help="no measuring: fit the efficiency factors of profile OLD.json again with the current cost "
                             "model, from the measurements it stores, and write the result to --out")
    parser.add_argument("--inter-node", action="store_true",
                        help="measure the link between two nodes of the Ray cluster at RAY_ADDRESS (one GPU each) "
                             "and add inter_node_bw to --out")
    parser.set_defaults(run=run)


def resolve_arguments(args: argparse.Namespace, cuda_available: bool, gpu_count: int,
                      device_name: str) -> tuple[str, HardwareSpec, int, ModelSpec]:
    """(device, preset, ranks, model) from the arguments; ValueError naming the flag otherwise."""
    from actors.worker import cut_model

    device = args.device if args.device != "auto" else ("cuda" if cuda_available else "cpu")
    if device == "cuda" and not cuda_available:
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
    gpu = args.gpu if args.gpu is not None else ("cpu" if device == "cpu" else default_preset(device_name))
    if gpu not in HARDWARE_PRESETS:
        raise ValueError(f"--gpu {gpu!r}: unknown; allowed: {', '.join(HARDWARE_PRESETS)}")
    ranks = args.ranks if args.ranks is not None else (min(2, gpu_count) if device == "cuda" else 1)
    limit = gpu_count if device == "cuda" else MAX_CPU_RANKS
    if not 1 <= ranks <= limit:
        where = f"{gpu_count} visible GPUs" if device == "cuda" else "CPU processes"
        raise ValueError(f"--ranks {ranks}: must be in [1, {limit}] ({where})")
    model_name = args.model or ("llama3.2-1b" if device == "cuda" else "tiny")
    if model_name not in MODEL_PRESETS:
        raise ValueError(f"--model {model_name!r}: unknown; allowed: {', '.join(MODEL_PRESETS)}")
    base = model_preset(model_name)
    if not 1 <= args.layers <= base.n_layers:
        raise ValueError(f"--layers {args.layers}: must be in [1, {base.n_layers}] for {model_name}")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--out {args.out}: must be a file path in an existing directory")
    return device, hardware_preset(gpu), ranks, cut_model(base, args.layers)


def default_preset(device_name: str) -> str:
    """The hardware preset whose GPU model appears in `device_name` (e.g. 'NVIDIA H200')."""
    for fragment, preset in PRESET_BY_DEVICE_NAME:
        if fragment in device_name.upper():
            return preset
    raise ValueError(f"--gpu: no preset matches the device {device_name!r}; "
                     f"pass one of {', '.join(HARDWARE_PRESETS)} to compare against")


def run(args: argparse.Namespace) -> int:
    """Validate, measure, print the table, write the JSON."""
    check_out_path("--out", args.out)  # before minutes of measuring
    import torch

    from actors.worker import ProfileSettings

    if args.inter_node:
        return run_inter_node(args)
    if args.refit is not None:
        return run_refit(args)

    cuda = torch.cuda.is_available()
    gpu_count = torch.cuda.device_count() if cuda else 0
    device, preset, ranks, model = resolve_arguments(args, cuda, gpu_count,
                                                     torch.cuda.get_device_name(0) if cuda else "cpu")
    settings = ProfileSettings.choose(device, model, args.quick)
    try:
        profile = build_profile(settings, preset, ranks)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(f"profile ran out of device memory ({' '.join(str(exc).split())[:200]}); "
                         "try --quick or a smaller --model") from None
    print(format_table(profile, preset))
    write_profile(profile, args.out)
    print(f"wrote {args.out}; use it with plan.profile={args.out}")
    return 0


def run_refit(args: argparse.Namespace) -> int:
    """`--refit OLD.json`: the stored measurements fitted again (app.cli.profile_refit)."""
    old = read_profile(args.refit)
    profile = refit_profile(old, args.refit)
    print(format_table(profile, hardware_preset(profile["preset"])))
    print(f"efficiency before: {old.get('efficiency')}")
    write_profile(profile, args.out)
    print(f"wrote {args.out}; use it with plan.profile={args.out}")
    return 0


def run_inter_node(args: argparse.Namespace) -> int:
    """`--inter-node`: time the link between two Ray nodes; add `inter_node_bw` to --out."""
    import ray

    from actors.worker import ProfileSettings
    from cluster.link_probe import measure_inter_node
    from cluster.resources import RayStartOptions, connect, probe_cuda, select_nodes

    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--out {args.out}: must be a file path in an existing directory")
    if not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        raise ValueError("--inter-node: needs a Ray cluster of two or more GPU nodes; set RAY_ADDRESS to its head "
                         "(e.g. RAY_ADDRESS=10.0.0.1:6379)")
    started_ray = not ray.is_initialized()
    try:
        info = connect(RayStartOptions(hardware="cpu"))  # a preset given: no detection task
        ends = select_nodes(info.nodes, 2, 1)
        cuda = args.device != "cpu" and all(probe_cuda(ends).values())
        if args.device == "cuda" and not cuda:
            raise ValueError("--device cuda: torch sees no CUDA device on the first two GPU nodes; use --device cpu")
        settings = ProfileSettings.choose("cuda" if cuda else "cpu", model_preset("tiny"), args.quick)
        timing = measure_inter_node(settings.comm_bytes, virtual=not cuda, warmup=settings.warmup, reps=settings.reps)
    finally:
        if started_ray:
            ray.shutdown()
    profile = json.loads(out.read_text()) if out.is_file() else {}
    profile["inter_node_bw"] = timing.bandwidth
    profile.setdefault("measurements", {})["inter_node"] = {
        **asdict(timing), "bandwidth": timing.bandwidth, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_profile(profile, out)
    print(f"inter-node link {timing.nodes[0]} -> {timing.nodes[1]} ({timing.backend}, {timing.nbytes} bytes): "
          f"{timing.bandwidth / 1e9:.4g} GB/s, fixed cost {timing.small_allreduce_s * 1e6:.0f} us")
    print(f"wrote inter_node_bw to {out}; use it with plan.profile={out}")
    return 0


# ---- the profile JSON ------------------------------------------------------------------------------


def machine_info(settings: ProfileSettings, ranks: int) -> dict[str, Any]:
    """What was measured on: device name, torch (and CUDA) version, host, rank count."""
    import torch

    cuda = settings.device == "cuda"
    return {
        "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu"),
        "device_type": settings.device,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ranks": ranks,
    }


def build_profile(settings: ProfileSettings, preset: HardwareSpec, ranks: int) -> dict[str, Any]:
    """Run every microbenchmark and return the profile JSON object: the measured HardwareSpec
    fields at top level, "efficiency", "preset" and "measurements" (raw numbers, the cost model's
    seconds at the preset and at the profile beside the measured ones, machine, date)."""
    from actors.worker import measure_engine, measure_hardware

    timing = measure_engine(settings)  # first: spawned collective processes leave load behind on CPU
    hardware = measure_hardware(settings, ranks)
    link = measure_host_link(settings.device, settings.quick, settings.warmup, settings.reps)
    host_fields = {} if link is None else {"host_bw": link["host_bw"], "host_mem_bytes": link["host_mem_bytes"]}
    hw = replace(preset, **hardware.fields)
    collectives = hardware.collectives
    efficiency = fitted_efficiency(hw, settings, timing, collectives)
    h = settings.model.hidden_size
    measurements = {
        "machine": machine_info(settings, ranks),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": settings.quick,
        "model": {"name": settings.model.name, "hidden_size": h, "n_layers": settings.model.n_layers,
                  "vocab_size": settings.model.vocab_size},
        "matmul": {"square_size": settings.matmul_size, "square_flops": hardware.square_flops,
                   "llm_shape": [settings.gemm_tokens, h, 4 * h], "llm_flops": hardware.llm_flops,
                   "square_vs_preset": hardware.square_flops / preset.peak_flops,
                   "llm_vs_preset": hardware.llm_flops / preset.peak_flops},
        "copy": {"bytes": settings.copy_bytes, "bandwidth": hardware.fields["hbm_bw"]},
        "host_link": link,  # pinned host <-> GPU copies and host RAM per GPU (None on CPU)
        "collectives": None if collectives is None else {
            **asdict(collectives), "broadcast_bw": collectives.broadcast_bw, "allreduce_bw": collectives.allreduce_bw,
            # JSON has no NaN: a tp step the model could not be split for is recorded as null.
            "tp_fwd_bwd_s": collectives.tp_fwd_bwd_s if math.isfinite(collectives.tp_fwd_bwd_s) else None},
        "engine": {**asdict(timing), "train_seqs": settings.train_seqs, "train_seq_len": settings.train_seq_len,
                   "decode_batch": settings.decode_batch, "decode_prompt_len": settings.decode_prompt_len,
                   "decode_steps": list(settings.decode_steps)},
        "validation": validation(preset, hw, efficiency, settings, timing, collectives),
    }
    return {**hardware.fields, **host_fields, "efficiency": efficiency, "preset": preset.name,
            "measurements": measurements}


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    """Write the profile JSON (indented, so a person can read and diff it)."""
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")


# ---- the table ---------------------------------------------------------------------------------------


def format_table(profile: dict[str, Any], preset: HardwareSpec) -> str:
    """Measured vs preset hardware figures, the efficiency factors and the cost-model check."""
    meas = profile["measurements"]
    machine = meas["machine"]
    units = {"peak_flops": (1e12, "TFLOP/s"), "hbm_bw": (1e9, "GB/s"), "mem_bytes": (2**30, "GiB"),
             "intra_node_bw": (1e9, "GB/s"), "collective_latency_s": (1e-6, "us"), "host_bw": (1e9, "GB/s"),
             "host_mem_bytes": (2**30, "GiB")}
    lines = [f"profile of {machine['device']} ({machine['device_type']}, {machine['dtype']}, "
             f"{machine['ranks']} rank(s)) against preset {preset.name}",
             f"{'figure':<28}{'measured':>12}{'preset':>12}{'ratio':>8}"]
    for key, (scale, unit) in units.items():
        if key in profile:
            ours, theirs = profile[key], getattr(preset, key)
            lines.append(f"{key + ' (' + unit + ')':<28}{ours / scale:>12.4g}{theirs / scale:>12.4g}{ours / theirs:>8.2f}")
    llm = meas["matmul"]
    lines.append(f"{'llm gemm ' + 'x'.join(map(str, llm['llm_shape'])):<28}{llm['llm_flops'] / 1e12:>12.4g}"
                 f"{preset.peak_flops / 1e12:>12.4g}{llm['llm_vs_preset']:>8.2f}")
    lines.append("efficiency: " + "  ".join(f"{k} {v:.3f}" for k, v in profile["efficiency"].items()))
    lines.append(f"{'cost model check (s)':<28}{'measured':>12}{'preset':>12}{'profile':>10}")
    for key, row in meas["validation"].items():
        lines.append(f"{key:<28}{row['measured_s']:>12.4g}{row['preset_s']:>12.4g}{row['profile_s']:>10.4g}")
    return "\n".join(lines)


__all__ = ["add_parser", "build_profile", "default_preset", "format_table", "machine_info", "resolve_arguments", "run",
           "write_profile"]
