"""`python -m app train [CONFIG.yaml] [key.path=value ...] [--run-dir DIR] [--iterations N]`.

Trains as the config says: local Ray with virtual GPUs on a machine without GPUs, or the Ray
cluster at `RAY_ADDRESS` (which is what `ray job submit -- python -m app train ...` runs).
Without CONFIG it runs the embedded default, examples/ppo-tiny.yaml (tiny actor and critic on 4
virtual GPUs, the toy task).

A config that cannot run (unknown field, cluster too small for the models or for the Ray
cluster, unknown reward function, dataset rows without the prompt field, a model directory
without readable weights, a run directory that holds another run) fails before any worker
starts: exit status 2 and one `error:` line. A worker that dies or stalls is recovered from
(all workers restarted, the run resumed from its last complete checkpoint, up to
`run.max_restarts` times); a run that fails for good exits with status 1 and an `error:` line
naming the call, the worker and the cause; what the run directory holds by then stays valid.

Run directory: `run.dir`, default `runs/<run.name>-<YYYYmmdd-HHMMSS>`; `--run-dir` overrides it.
It holds one run: `run.resume=auto` continues it from its latest complete checkpoint (metrics
appended without duplicates), `run.resume=PATH` from that checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from app.config import ExperimentConfig, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "ppo-tiny.yaml"
RUN_FAILED = 1


def add_parser(subparsers: Any) -> None:
    """Register the `train` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "train", help="train as a config says (local Ray with virtual GPUs, or RAY_ADDRESS)",
        description="Run an RLHF experiment: plan, start one worker per GPU, iterate, log, checkpoint.",
    )
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG),
                        help="experiment YAML (default: the embedded examples/ppo-tiny.yaml)")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key.path=value",
                        help="config overrides, e.g. run.iterations=3 tracking.wandb=false")
    parser.add_argument("--run-dir", help="run directory (overrides run.dir)")
    parser.add_argument("--iterations", type=int, help="shortcut for run.iterations=N")
    parser.set_defaults(run=run)


def resolve_run_dir(cfg: ExperimentConfig, now: float | None = None) -> Path:
    """`run.dir`, or runs/<name>-<local time> when it is unset."""
    if cfg.run.dir:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe_name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in cfg.run.name)
    return Path("runs") / f"{safe_name}-{stamp}"


def run(args: argparse.Namespace) -> int:
    """Check everything that can be checked without workers, then train. See the module docstring."""
    from app.run import Driver, DriverError, check_run_dir, preflight

    config, overrides = args.config, list(args.overrides)
    if "=" in config and not Path(config).is_file():  # `train key=value ...`: the default config
        config, overrides = str(DEFAULT_CONFIG), [config, *overrides]
    if args.iterations is not None:
        overrides.append(f"run.iterations={args.iterations}")
    if args.run_dir is not None:
        overrides.append(f"run.dir={args.run_dir}")
    cfg = load_config(config, overrides)
    inputs = preflight(cfg)  # ConfigError -> status 2, before Ray or any worker starts
    run_dir = resolve_run_dir(cfg)
    checkpoint = check_run_dir(run_dir, cfg.run.resume)  # a directory holding another run, a bad resume
    print(f"run directory: {run_dir}", flush=True)
    if cfg.run.resume is not None:
        print(f"resuming from {checkpoint or 'iteration 0 (no complete checkpoint yet)'}", flush=True)
    try:
        driver = Driver(cfg, run_dir, inputs=inputs)
        history = driver.run()
    except DriverError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return RUN_FAILED
    print(summary(history, run_dir))
    return 0


def summary(history: list[dict[str, float]], run_dir: Path) -> str:
    """Two lines: iterations, mean reward of the first and last 5, and where the outputs are."""
    rewards = [row["rollout/reward_mean"] for row in history if "rollout/reward_mean" in row]
    head = f"{len(history)} iterations"
    if rewards:
        first, last = rewards[:5], rewards[-5:]
        head += f"; reward mean: first {len(first)} {sum(first) / len(first):.3f}, last {len(last)} {sum(last) / len(last):.3f}"
    return f"{head}\noutputs: {run_dir} (metrics.jsonl, plan.json, gantt.png, timings.json, checkpoints/)"


__all__ = ["DEFAULT_CONFIG", "add_parser", "resolve_run_dir", "run", "summary"]
