"""Running an experiment on Ray: set-up, the per-iteration schedule, the driver loop, checkpoints,
and the one-placement jobs behind `generate` and `score`.

Imports everything below it (actors, cluster, planning, app.config/data/reporting/algorithms);
imports torch and ray, so the CLI imports it inside the commands that run. In dependency order:
  schedule    what the driver submits for one iteration and which shards each consumer gets
  checkpoint  HF exports of the trained models under `<run_dir>/checkpoints/iter_N/`
  cluster_check  the configured nodes x GPUs against the live Ray cluster (the planner's nodes)
  runtime     checks before any worker starts, then Ray, the plan search, workers and models
  failures    a lost Ray node named with the calls in flight on it
  headroom    the plan's memory margin, checked before the first call
  replan      self-calibration from measured calls, re-planning, switching plans between iterations
  driver      `Driver`: runs the plan's dataflow graph iteration after iteration
  jobs        one-off jobs on Ray with a single placement (`generate`, `score`)
"""

from __future__ import annotations

from app.run.driver import Driver, DriverError
from app.run.jobs import LayoutJob, column, generate_on_ray
from app.run.runtime import preflight

__all__ = [
    # runtime.py
    "preflight",
    # driver.py
    "Driver", "DriverError",
    # jobs.py
    "LayoutJob", "column", "generate_on_ray",
]
