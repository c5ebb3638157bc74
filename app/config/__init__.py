"""The experiment config and what the planner is given from it.

Pure Python (pydantic, planning): `python -m app plan` loads it without torch or ray. May import
planning only. In dependency order:
  sections    config sections that only training reads: data, reward, sampling, ppo, grpo, dpo, ...
  experiment  `ExperimentConfig`: the YAML schema, dotted overrides, `ConfigError` naming the field
  problem     config -> planning problem: graph, cluster, model specs, manual plans, search errors
"""

from __future__ import annotations

from app.config.experiment import ConfigError, ExperimentConfig, load_config
from app.config.problem import build_problem, manual_plan, model_spec, role_sources, search_error

__all__ = [
    # experiment.py
    "ConfigError", "ExperimentConfig", "load_config",
    # problem.py
    "build_problem", "manual_plan", "model_spec", "role_sources", "search_error",
]
