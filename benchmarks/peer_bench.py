"""This project's GRPO against TRL's GRPOTrainer on identical work, side by side in one call.

The work (issue 13): one GPU, Llama-3.2-1B shape with random weights (bf16), 64 prompts x 8
samples, 128-token prompts, 512 new tokens, one optimizer step per batch, no KL term (TRL
beta=0, our grpo.kl_loss_coef=0), temperature 1. Both systems read the same HF directory
(weights, config, a byte-level BPE tokenizer with the model's 128,256-token vocabulary; built
offline by benchmarks/peer_setup.py) and the same prompt file, and score with the same rule on
the decoded text (benchmarks/peer_reward.py). Ours runs through `python -m app train`'s
machinery (the Ray driver), TRL through GRPOTrainer with HF generation (benchmarks/peer_trl.py).
The table gives seconds per step and completion tokens per second of the timed steps (a warm-up
step each is left out: ours 1 + 3 iterations, TRL 1 + 2 steps), the ratio, and our calls' times;
on the GPU also the step's floor at the measured ceilings (benchmarks/peer_floor.py: every row
whole, and each prompt once) and our step against both. On the GPU our side is planned with, and
the floor priced at, the hardware preset of the card it runs on (by its name: h200-141g,
h100-80g; `--gpu` names another).

    python3 benchmarks/peer_bench.py              # GPU, about 6 minutes; writes out/peer/run-NNN/ (or --out)
    python3 benchmarks/peer_bench.py --tiny       # seconds on CPU: a tiny model, 4 prompts x 4, 16 + 16 tokens

Every run writes into a fresh directory `<out>/run-NNN/` (benchmarks/run_dirs.py; `<out>/latest`
links to the newest), so the same command can run again: peer_bench.txt (the table),
peer_bench.json (every number), realray-grpo.yaml (our config), realray-run/ (our run.dir;
realray-run-b/ when the compiled run failed and ran again uncompiled) and trl/ (TRL's
output_dir). The inputs are shared by the runs: `<out>/inputs/` (`<out>/inputs-tiny/` with
--tiny, or --inputs), rebuilt in place with the same seed, so every run reads the same files.

TRL on the GPU host (offline; it has torch, transformers and accelerate): from the project root
here, `bash ../shared/gpu/prepare-wheels.sh trl==1.16.0 datasets==5.2.0 dill multiprocess`
fills the git-ignored .whl/; benchmarks/run_gpu.sh installs it there (`ONLY=peer`). Without an
importable TRL the table says so and still measures ours.

`--also LABEL:KEY=VALUE[,...]` adds a row of ours with more overrides, run after the first in the
same call (its run.dir realray-LABEL-run/), e.g. `--also fp8:sampling.fp8=true,sampling.kv_cache_dtype=fp8`
for FP8 rollouts beside the bf16 row and TRL.

`--mean-len N` plants an EOS in the random weights (benchmarks/peer_setup.py): responses end at
geometric lengths of mean about N instead of all running to 512, as on a task whose answers end.
Both systems stop at it; ours drops finished rows from the decode step (sampling.compact_fraction),
TRL's HF generate keeps them to the batch's end. The floor is not printed then (it assumes
every row whole). Both sides then train at learning rate 1e-12 instead of 1e-6: the plant scales
the attention and MLP output projections down to ~2e-5 an entry, and one Adam step at 1e-6 (which
moves every entry by about the learning rate) undoes it; the first H200 run with it sampled
~500-token responses on both sides after the warm-up step. The work of a step is the same.

Our side runs what a user runs: the plan's own micro-batching and no allocator setting.
`--micro-batches N` forces N actor micro-batches instead, and `--expandable-segments` sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the bench's settings before 2026-12-02).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from benchmarks.peer_floor import H200, floor_lines, target_lines
from benchmarks.peer_setup import PeerInputs, build_inputs
from benchmarks.peer_trl import SideResult, TrlSettings, run_trl
from benchmarks.run_dirs import fresh_run_dir
from cluster.resources import preset_for_gpu_name
from planning.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from planning.models import ModelSpec


@dataclass(frozen=True)
class Work:
    """One step's work: prompts x group samples, prompt and response lengths."""

    prompts: int
    group: int
    prompt_len: int
    gen_len: int

    @property
    def sequences(self) -> int:
        return self.prompts * self.group

    def describe(self) -> str:
        return (f"{self.prompts} prompts x {self.group} samples, {self.prompt_len}-token prompts, "
                f"{self.gen_len} new tokens")


LEARNING_RATE = 1e-6  # both sides
PLANTED_EOS_LEARNING_RATE = 1e-12  # both sides with --mean-len (module docstring)
GPU_WORK = Work(64, 8, 128, 512)
TINY_WORK = Work(4, 4, 16, 16)


def our_config(model_dir: Path, prompts: Path, work: Work, tiny: bool, run_dir: Path, iterations: int,
               overrides: list[str], gpu: str = "h200-141g", actor_lr: float = LEARNING_RATE) -> Path:
    """The experiment YAML of our side, planned for hardware preset `gpu` on the GPU (written
    beside the results, so the run can be repeated)."""
    import yaml

    raw: dict[str, Any] = {
        "algorithm": "grpo",
        "models": {"actor": {"path": str(model_dir)}},
        "batch": {"prompts": work.prompts, "prompt_len": work.prompt_len, "gen_len": work.gen_len,
                  "group_size": work.group, "ppo_minibatches": 1, "ppo_epochs": 1},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu" if tiny else gpu, "virtual_gpus": tiny,
                    "dashboard": False},
        "plan": {"mode": "heuristic", "seconds": 5},
        "run": {"name": "peer-grpo", "dir": str(run_dir), "iterations": iterations, "seed": 0},
        "data": {"path": str(prompts), "tokenizer": str(model_dir), "max_prompt_len": work.prompt_len},
        "reward": {"function": f"{ROOT / 'benchmarks' / 'peer_reward.py'}:response_length"},
        # On the GPU the decode step runs under torch.compile (as examples/ppo-1b-h200x2.yaml).
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "compile": not tiny},
        "ppo": {"actor_lr": actor_lr, "max_grad_norm": 1.0, "weight_decay": 0.0},
        "grpo": {"kl_loss_coef": 0.0},
        "tracking": {"wandb": False, "console": False},
        "checkpoint": {"every": 0, "at_end": False},
    }
    path = run_dir.parent / "realray-grpo.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    from app.config import load_config

    load_config(path, overrides)  # fails here, naming the field, before anything starts
    return path


def run_ours(config: Path, overrides: list[str], run_dir: Path, work: Work, micro_batches: int,
             name: str = "realray GRPO") -> SideResult:
    """Our GRPO through the driver: every iteration after the first is timed."""
    from app.config import load_config
    from app.run.driver import Driver
    from app.run.runtime import preflight

    result = SideResult(name)
    try:
        cfg = load_config(config, overrides)
        inputs = preflight(cfg)
        if micro_batches:
            ppo = replace(inputs.settings.ppo, micro_batches=micro_batches)
            inputs = replace(inputs, settings=replace(inputs.settings, ppo=ppo))
        calls = [m.name for m in inputs.problem.graph.mfcs]
        rows = Driver(cfg, run_dir, inputs=inputs).run()
    except Exception as exc:  # noqa: BLE001  (reported in the table; the TRL side still runs)
        result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return result
    timed = rows[1:]

    def per_call_mean(group: str) -> dict[str, float]:
        """Each call's `<group>/<call>` metric, mean of the timed steps (0 where not logged)."""
        return {name: sum(r.get(f"{group}/{name}") or 0.0 for r in timed) / len(timed) for name in calls}

    result.step_s = [r["timing_s/iteration"] for r in timed]
    result.tokens = [round(r["rollout/response_length_mean"] * work.sequences) for r in timed]
    result.calls = per_call_mean("timing_s")
    phase_keys = sorted({k for r in timed for k in r if k.startswith("gen/") and k.endswith("_s")})
    result.phases = {k: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in phase_keys}
    result.gc_s, result.compile_s = per_call_mean("timing_gc_s"), per_call_mean("timing_compile_s")
    result.gc_before_s = {name: max(r.get(f"timing_gc_before_s/{name}") or 0.0 for r in timed) for name in calls}
    result.other_s = [r["timing_s/iteration"] - sum(r.get(f"timing_s/{name}") or 0.0 for name in calls) for r in timed]
    result.settings = (f"calls {', '.join(calls)}; plan {cfg.plan.mode}; actor micro-batches "
                       f"{micro_batches or 'from the plan'}; old logprobs from the training forward; "
                       f"sampling.compile={cfg.sampling.compile}, fp8={cfg.sampling.fp8}, "
                       f"kv_cache_dtype={cfg.sampling.kv_cache_dtype}")
    if cfg.sampling.lossy_rollout:  # the importance weights the FP8 rollout turned on
        weights = [r["actor/rollout_is_mean"] for r in timed if "actor/rollout_is_mean" in r]
        result.settings += f"; actor/rollout_is_mean {min(weights):.4f}-{max(weights):.4f}" if weights else ""
    return result


def fmt(x: float, digits: int = 2) -> str:
    return "-" if not math.isfinite(x) else f"{x:,.{digits}f}"


def table(results: list[SideResult], work: Work, model: str, floor_spec: ModelSpec | None = None,
          hardware: HardwareSpec = H200) -> str:
    """One table: per system the timed steps, s/step, completion tokens per step and per second,
    the ratio to TRL; then our calls' times, the step's hardware floor (with `floor_spec`, the
    model on the GPU, at `hardware`'s ceilings: benchmarks/peer_floor.py) and each side's settings."""
    base = next((r for r in results if r.name.startswith("TRL") and not r.error), None)
    header = (f"{'system':<28}{'timed steps':>12}{'s/step':>10}{'compl. tok/step':>17}{'compl. tok/s':>14}"
              f"{'vs TRL':>9}")
    lines = [f"peer_bench: GRPO on {model}, {work.describe()}, one optimizer step per batch, no KL term", header]
    for r in results:
        if r.error:
            lines.append(f"{r.name:<28}  failed: {r.error}")
            continue
        ratio = r.tokens_per_s / base.tokens_per_s if base is not None else float("nan")
        lines.append(f"{r.name:<28}{len(r.step_s):>12}{fmt(r.seconds_per_step):>10}{fmt(r.tokens_per_step, 0):>17}"
                     f"{fmt(r.tokens_per_s, 0):>14}{fmt(ratio) + 'x' if math.isfinite(ratio) else '-':>9}")
    for r in results:
        if r.calls:
            other = r.seconds_per_step - sum(r.calls.values())
            parts = [f"{name} {seconds:.2f}" for name, seconds in r.calls.items()] + [f"other {other:.2f}"]
            lines.append(f"{r.name} calls (s, mean of the timed steps): " + " | ".join(parts))
        if r.phases:
            lines.append(f"{r.name} generation phases (s): "
                         + " | ".join(f"{k.removeprefix('gen/')} {v:.3f}" for k, v in r.phases.items()))
        if r.gc_s:
            lines.append(f"{r.name} garbage collection / compiling inside the calls (s): "
                         + " | ".join(f"{name} {v:.3f} / {r.compile_s.get(name, 0.0):.3f}"
                                      for name, v in r.gc_s.items()))
        if r.other_s:
            lines.append(f"{r.name} other (step minus its calls) per timed step (s): "
                         + ", ".join(f"{v:.2f}" for v in r.other_s) + "; garbage collection before each call, "
                         "largest: " + " | ".join(f"{name} {v:.3f}" for name, v in r.gc_before_s.items()))
    if floor_spec is not None:
        ours = {r.name: r.seconds_per_step for r in results if r.name.startswith("realray") and not r.error}
        lines += floor_lines(floor_spec, work.prompts, work.group, work.prompt_len, work.gen_len, ours, hardware)
        phases = {r.name: (r.calls["actor_train"], r.phases["gen/decode_s"]) for r in results
                  if r.name in ours and r.calls.get("actor_train") and r.phases.get("gen/decode_s")}
        lines += target_lines(floor_spec, work.prompts, work.group, work.prompt_len, work.gen_len, phases, hardware)
    lines += [f"{r.name}: {r.settings}" for r in results if r.settings]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="This project's GRPO against TRL's GRPOTrainer on identical work.")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny model and batch: a check that runs in seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder; each run writes OUT/run-NNN/ (default $OUT/peer or out/peer)")
    parser.add_argument("--inputs", type=Path, default=None, help="where the model and prompts are built "
                        "(default OUT/inputs, OUT/inputs-tiny with --tiny; 2.5 GB on the GPU)")
    parser.add_argument("--iterations", type=int, default=None, help="our iterations incl. 1 warm-up (GPU 4, tiny 2)")
    parser.add_argument("--trl-steps", type=int, default=None, help="TRL steps incl. 1 warm-up (GPU 3, tiny 2)")
    parser.add_argument("--trl-micro-batch", type=int, default=None, help="TRL per_device_train_batch_size (32)")
    parser.add_argument("--trl-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off is faster")
    parser.add_argument("--micro-batches", type=int, default=0, help="our actor micro-batches (0: the plan's)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (default: no allocator setting)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted override of our config, e.g. sampling.compile=true (repeatable)")
    parser.add_argument("--also", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE...]",
                        help="one more row of ours, with these overrides on top of --set (repeatable), e.g. "
                        "fp8:sampling.fp8=true,sampling.kv_cache_dtype=fp8")
    parser.add_argument("--mean-len", type=float, default=None,
                        help="plant an EOS in the weights: responses of about this mean length (default: none, "
                             "every response runs to the budget)")
    parser.add_argument("--gpu", default=None, choices=[n for n in HARDWARE_PRESETS if n != "cpu"],
                        help="the hardware preset our side is planned with and the floor's ceilings "
                             "(default: the preset of this host's GPU by its name, h200-141g if unknown)")
    args = parser.parse_args(argv)
    try:
        args.also = [parse_also(text) for text in args.also]
    except ValueError as exc:
        parser.error(str(exc))
    if args.mean_len is not None and args.mean_len <= 1:
        parser.error(f"--mean-len={args.mean_len}: must be > 1")
    for name in ("iterations", "trl_steps"):
        value = getattr(args, name)
        if value is not None and value < 2:
            parser.error(f"--{name.replace('_', '-')}={value}: must be >= 2 (the first step is a warm-up)")
    return args


def parse_also(text: str) -> tuple[str, list[str]]:
    """'fp8:sampling.fp8=true,sampling.kv_cache_dtype=fp8' -> ('fp8', ['sampling.fp8=true', ...])."""
    label, _, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(",") if o.strip()]
    if not label.strip() or not label.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--also {text!r}: the label before ':' must be letters, digits, '-' or '_'")
    if not overrides or any("=" not in o for o in overrides):
        raise ValueError(f"--also {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...] after the label")
    return label.strip(), overrides


def learning_rate(args: argparse.Namespace) -> float:
    """Both sides' learning rate: tiny with a planted EOS, which a real step would undo."""
    return PLANTED_EOS_LEARNING_RATE if args.mean_len is not None else LEARNING_RATE


def local_gpu_preset() -> str:
    """The hardware preset of this host's first GPU, by the name nvidia-smi gives (asked there
    rather than through torch, so that this process, which later runs TRL, holds no CUDA context
    while our workers run); h200-141g where nvidia-smi cannot say."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "h200-141g"
    name = done.stdout.strip()
    return preset_for_gpu_name(name) if done.returncode == 0 and name else "h200-141g"


def run_our_rows(args: argparse.Namespace, inputs: PeerInputs, work: Work, out: Path, start: float) -> list[SideResult]:
    """Ours with --set (retried uncompiled if the compiled run fails), then one row per --also."""
    iterations = args.iterations or (2 if args.tiny else 4)
    rows: list[SideResult] = []
    for label, extra in [("", []), *args.also]:
        overrides = [*args.overrides, *extra]
        run_dir = out / (f"realray-{label}-run" if label else "realray-run")
        name = f"realray GRPO ({label})" if label else "realray GRPO"
        config = our_config(inputs.model_dir, inputs.prompts, work, args.tiny, run_dir, iterations, overrides,
                            args.gpu, learning_rate(args))
        ours = run_ours(config, overrides, run_dir, work, args.micro_batches, name)
        if ours.error and not args.tiny and "sampling.compile=false" not in overrides:
            # A failure to compile must not cost the comparison: once more, uncompiled.
            print(f"{name} failed ({ours.error}); again with sampling.compile=false", flush=True)
            first = ours.error
            ours = run_ours(config, [*overrides, "sampling.compile=false"], run_dir.with_name(run_dir.name + "-b"),
                            work, args.micro_batches, name)
            ours.settings += f"; the compiled run failed first: {first}"
        rows.append(ours)
        # Printed now too: if a later side is cut short, this one is still on record.
        print(f"{name} done at {time.perf_counter() - start:.1f} s\n{table(rows, work, 'ours alone')}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tiny = args.tiny
    args.gpu = "cpu" if tiny else (args.gpu or local_gpu_preset())
    work = TINY_WORK if tiny else GPU_WORK
    base = (args.out or Path(os.environ.get("OUT", "out")) / "peer").resolve()
    out = fresh_run_dir(base)  # this run's results; earlier runs under `base` stay as they are
    print(f"run directory: {out}", flush=True)
    if not tiny and args.expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    start = time.perf_counter()
    inputs = build_inputs((args.inputs or base / ("inputs-tiny" if tiny else "inputs")).resolve(), tiny,
                          n_prompts=4 * work.prompts, prompt_len=work.prompt_len, mean_len=args.mean_len)
    parts = ", ".join(f"{part} {seconds:.1f}" for part, seconds in inputs.build_s.items())
    print(f"inputs built in {time.perf_counter() - start:.1f} s ({parts}): {inputs.model_dir}", flush=True)
    results = [] if args.skip_ours else run_our_rows(args, inputs, work, out, start)
    if not args.skip_trl:
        settings = TrlSettings(micro_batch=args.trl_micro_batch or (8 if tiny else 32), dtype=args.trl_dtype,
                               gradient_checkpointing=args.trl_gradient_checkpointing,
                               steps=args.trl_steps or (2 if tiny else 3), learning_rate=learning_rate(args))
        results.insert(0, run_trl(inputs.model_dir, inputs.prompts, work.prompts, work.group, work.gen_len, settings,
                                  out, on_gpu=not tiny))
        print(f"TRL done at {time.perf_counter() - start:.1f} s", flush=True)
    model = "a tiny Llama (CPU)" if tiny else "Llama-3.2-1B shape, random weights, bf16, one GPU"
    if args.mean_len is not None:
        model += f", EOS planted for responses of mean ~{args.mean_len:g} tokens"
    floor_spec = None if tiny or args.mean_len is not None else inputs.spec  # the floor: every row whole
    text = table(results, work, model, floor_spec, hardware_preset(args.gpu))
    (out / "peer_bench.txt").write_text(text + "\n")
    summary = {"work": asdict(work), "results": [{**asdict(r), "seconds_per_step": r.seconds_per_step,
                                                  "tokens_per_s": r.tokens_per_s} for r in results]}
    (out / "peer_bench.json").write_text(json.dumps(summary, indent=1, default=str))
    print(text)
    print(f"results: {out / 'peer_bench.txt'}, {out / 'peer_bench.json'}")
    return 1 if any(r.error for r in results if r.name.startswith("realray")) else 0


if __name__ == "__main__":
    sys.exit(main())
