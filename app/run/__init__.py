"""Running an experiment on Ray: set-up, the per-iteration schedule, the driver loop, checkpoints,
and the one-placement jobs behind `generate` and `score`.

Imports everything below it (actors, cluster, planning, app.config/data/reporting/algorithms);
imports torch and ray, so the CLI imports it inside the commands that run. In dependency order:
  schedule    what the driver submits for one iteration and which shards each consumer gets
  checkpoint  atomic checkpoints under `<run_dir>/checkpoints/iter_N/`: writing, listing, pruning
  resume      the run-directory rules, the driver's state in a checkpoint, restoring a run
  recovery    which failures a restart gets past, stall reports naming the rank, restart logs
  cluster_check  the configured nodes x GPUs against the live Ray cluster (the planner's nodes)
  tokenizer_check  every model reading the actor's ids against its tokenizer; the reward model's text path
  runtime     checks before any worker starts, the plan (before Ray), then Ray, workers and models
  failures    a lost Ray node named with the calls in flight on it
  staleness   bounded staleness: the stages the driver submits next, rollout/staleness
  dynamic_sampling  DAPO's rounds: groups with distinct rewards kept, the select call
  collect     waiting for submitted operations: results, or the failure to report
  submit      one scheduled operation as Ray tasks on the workers of its mesh
  dispatch    the submitted side of a run: data position, KL coefficients, stages, pending iterations
  iteration_metrics  a collected iteration's timeline records and metrics row
  headroom    the plan's memory margin, checked before the first call
  replan      self-calibration from measured calls, re-planning, switching plans between iterations
  driver      `Driver`: runs the plan's dataflow graph iteration after iteration, recovering
  jobs        one-off jobs on Ray with a single placement (`generate`, `score`)
"""

from __future__ import annotations

from app.run.checkpoint import latest_checkpoint
from app.run.driver import Driver
from app.run.jobs import LayoutJob, column, generate_on_ray
from app.run.recovery import DriverError
from app.run.resume import check_run_dir
from app.run.runtime import preflight, reward_model_priced

__all__ = [
    # checkpoint.py
    "latest_checkpoint",
    # resume.py
    "check_run_dir",
    # recovery.py
    "DriverError",
    # runtime.py
    "preflight", "reward_model_priced",
    # driver.py
    "Driver",
    # jobs.py
    "LayoutJob", "column", "generate_on_ray",
]
