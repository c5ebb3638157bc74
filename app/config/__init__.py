"""The experiment config and what the planner is given from it.

Pure Python (pydantic, planning): `python -m app plan` loads it without torch or ray. May import
planning only. In dependency order:
  errors      `ConfigError`: the field, the value and what is allowed
  files       UTF-8 text that names the line of a bad byte, YAML that refuses duplicate keys
  sections    config sections that only training reads: data, reward, sampling, ppo, grpo, dapo, gspo, dpo, ...
  checks      what each algorithm reads (KL in the reward or as a loss, groups), cross-field checks
  experiment  `ExperimentConfig`: the YAML schema, dotted overrides, every error as a `ConfigError`
  problem     config -> planning problem: graph, cluster, model specs, manual plans, search errors
  preflight   the files a config names, checked before Ray: model and tokenizer dirs, output paths
"""

from __future__ import annotations

from app.config.checks import (
    ALGORITHMS,
    DAPO_CLIP_EPS_HIGH,
    generation_rounds,
    rollout_is_level,
    samples_per_prompt,
    uses_ref,
)
from app.config.errors import ConfigError
from app.config.experiment import ExperimentConfig, ModelSource, load_config
from app.config.files import load_yaml, read_utf8
from app.config.preflight import (
    check_model_dir,
    check_out_path,
    check_tokenizer_dir,
    model_tokenizer,
    reward_may_read_text,
)
from app.config.problem import build_problem, manual_plan, model_spec, role_sources, rule_reward_priced, search_error

__all__ = [
    # checks.py
    "ALGORITHMS", "DAPO_CLIP_EPS_HIGH", "generation_rounds", "rollout_is_level", "samples_per_prompt", "uses_ref",
    # errors.py
    "ConfigError",
    # files.py
    "load_yaml", "read_utf8",
    # experiment.py
    "ExperimentConfig", "ModelSource", "load_config",
    # problem.py
    "build_problem", "manual_plan", "model_spec", "role_sources", "rule_reward_priced", "search_error",
    # preflight.py
    "check_model_dir", "check_out_path", "check_tokenizer_dir", "model_tokenizer", "reward_may_read_text",
]
