"""The experiment config and what the planner is given from it.

Pure Python (pydantic, planning): `python -m app plan` loads it without torch or ray. May import
planning only. In dependency order:
  files       UTF-8 text that names the line of a bad byte, YAML that refuses duplicate keys
  sections    config sections that only training reads: data, reward, sampling, ppo, grpo, dpo, ...
  experiment  `ExperimentConfig`: the YAML schema, dotted overrides, `ConfigError` naming the field
  problem     config -> planning problem: graph, cluster, model specs, manual plans, search errors
  preflight   the files a config names, checked before Ray: model and tokenizer dirs, output paths
"""

from __future__ import annotations

from app.config.files import load_yaml, read_utf8
from app.config.experiment import ConfigError, ExperimentConfig, load_config
from app.config.problem import build_problem, manual_plan, model_spec, role_sources, search_error
from app.config.preflight import check_model_dir, check_out_path, check_tokenizer_dir

__all__ = [
    # files.py
    "load_yaml", "read_utf8",
    # experiment.py
    "ConfigError", "ExperimentConfig", "load_config",
    # problem.py
    "build_problem", "manual_plan", "model_spec", "role_sources", "search_error",
    # preflight.py
    "check_model_dir", "check_out_path", "check_tokenizer_dir",
]
