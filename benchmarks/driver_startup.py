"""How long a Driver takes to start on a local Ray, phase by phase (CPU, the default tiny config).

    python benchmarks/driver_startup.py [--runs 2]

Starts one local Ray (2 CPUs, 4 virtual GPUs, as the ray-tier tests do), then builds and runs a
2-iteration Driver of examples/ppo-tiny.yaml `--runs` times, and prints per run the seconds of
`Driver()` (connect, plan, worker start, model load), of its worker start and model load (from a
profile of `Driver()`), and of `run()`. Every ray-tier test pays the start once per Driver, so it dominates the suite's time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli.train import DEFAULT_CONFIG  # noqa: E402
from app.config import load_config  # noqa: E402
from app.run.driver import Driver  # noqa: E402
from benchmarks.tables import markdown_table  # noqa: E402
from tests.ray_fixtures import start_shared_ray  # noqa: E402


def cumulative_s(profile: cProfile.Profile, function_name: str) -> float:
    """Cumulative seconds of app/run/runtime.py's `function_name` in a profile of Driver()."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    return sum(ct for (file, _, name), (_, _, _, ct, _) in stats.items()
               if name == function_name and file.endswith("runtime.py"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    start_shared_ray()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            run_dir = Path(tmp) / f"run{run}"
            cfg = load_config(DEFAULT_CONFIG, [f"run.dir={run_dir}", "tracking.console=false", "run.iterations=2",
                                               "checkpoint.at_end=false"])
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            driver = Driver(cfg, run_dir)
            profile.disable()
            setup = time.perf_counter() - started
            started = time.perf_counter()
            driver.run()
            rows.append((run, setup, cumulative_s(profile, "start_workers"), cumulative_s(profile, "load_models"),
                         time.perf_counter() - started))
    print(markdown_table(("run", "Driver() s", "start_workers s", "load_models s", "run() of 2 iterations s"),
                         [(str(run), *(f"{v:.1f}" for v in (setup, workers, models, ran)))
                          for run, setup, workers, models, ran in rows]))


if __name__ == "__main__":
    main()
