"""Run one example config under several `run.seed` values and print how much its reward rose.

A tiny run's trajectory is chaotic: a CPU that rounds a matmul differently follows another
trajectory from the same seed, so a learning check that passes for the default seed on one
machine can fail on another (README.md, "The learning check"). Before changing an example or
its check, sweep it:

    python3 scripts/seed_sweep.py examples/remax-tiny.yaml --seeds 0-15 [key.path=value ...]

Each seed runs as `python -m app train` would, in a temporary run directory, on one Ray for all
of them: started or joined once as the config's `cluster` section says (`app.run.runtime.connect_cluster`). One line per seed, then the worst rise: mean reward
of the last 5 iterations minus that of the first 5.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a file: the packages are beside this folder
    sys.path.insert(0, str(REPO_ROOT))

WINDOW = 5  # iterations averaged at each end, as the learning checks do


def parse_seeds(text: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"--seeds {text!r}: expected integers and ranges like 0-3,7") from None
        if hi < lo:
            raise ValueError(f"--seeds {text!r}: range {part!r} runs backwards")
        seeds.extend(range(lo, hi + 1))
    return seeds


def rise(rewards: list[float]) -> tuple[float, float]:
    """(mean of the first WINDOW rewards, mean of the last WINDOW)."""
    if len(rewards) < WINDOW:
        raise ValueError(f"{len(rewards)} iterations: need at least {WINDOW} to compare the ends")
    return sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW


def run_seed(config: Path, seed: int, overrides: list[str]) -> list[float]:
    """The per-iteration mean rewards of one run of `config` with run.seed = seed."""
    from app.config import load_config
    from app.reporting.tracking import read_metrics
    from app.run.driver import Driver

    with tempfile.TemporaryDirectory(prefix="seed-sweep-") as run_dir:
        cfg = load_config(config, [f"run.dir={run_dir}", "tracking.console=false", f"run.seed={seed}", *overrides])
        Driver(cfg, Path(run_dir)).run()
        return [m["rollout/reward_mean"] for m in read_metrics(Path(run_dir))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--seeds", default="0-4", help="run.seed values: '0-4', '0,3,9' (default 0-4)")
    parser.add_argument("overrides", nargs="*", help="key.path=value, as for `python -m app train`")
    args = parser.parse_intermixed_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    if not args.config.is_file():
        parser.error(f"config {args.config}: no such file")
    import ray

    from app.config import ConfigError, load_config
    from app.run.runtime import connect_cluster

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as exc:  # an unknown key or a bad value: one line, status 2
        parser.error(" ".join(str(exc).split()))
    connect_cluster(cfg)  # each Driver then finds Ray running
    rises = []
    for seed in seeds:
        rewards = run_seed(args.config, seed, args.overrides)
        first, last = rise(rewards)
        rises.append(last - first)
        print(f"seed {seed}: first {WINDOW} {first:.3f}, last {WINDOW} {last:.3f}, rise {last - first:+.3f}", flush=True)
    worst = min(range(len(seeds)), key=rises.__getitem__)
    print(f"{args.config.name}: worst rise {rises[worst]:+.3f} (seed {seeds[worst]}) over {len(seeds)} seeds")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
