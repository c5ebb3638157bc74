"""Environments for multi-turn (agentic) rollouts: the user's reset/step interface, its loader,
the built-in environments, observation ids and the per-call sessions the decode loop drives.

May import app.data (and transformers lazily; no torch at import time). In dependency order:
  interface   the environment interface, `load_env` / `check_env` ('module:Class' or 'file.py:Class'),
              the checks of what reset and step return
  calculator  a safe arithmetic evaluator (ast-based, bounded) for the calculator tool
  builtin     built-in environments: HiddenDigitGame (the CPU learning test), CalculatorEnv (GSM8K)
  templates   observation ids, token in / token out: plain tokens or the chat-template delta,
              the prefix-preserving check, truncation
  sessions    EnvSessions: one generation call's environments in a thread pool, a TurnSource for
              the decode loop (imports actors.generation lazily, for TurnResult)
"""

from __future__ import annotations

from app.envs.builtin import CalculatorEnv, HiddenDigitGame
from app.envs.calculator import CalculatorError, calculate, evaluate
from app.envs.interface import (
    Env,
    EnvFactory,
    EnvLoadError,
    StepOutcome,
    check_env,
    check_reset_result,
    check_step_result,
    load_env,
)
from app.envs.sessions import END_REASONS, EnvSessions
from app.envs.templates import ObservationEncoder, check_prefix_preserving, observation_encoder

__all__ = [
    # interface.py
    "Env", "EnvFactory", "EnvLoadError", "StepOutcome", "check_env", "check_reset_result", "check_step_result",
    "load_env",
    # calculator.py
    "CalculatorError", "calculate", "evaluate",
    # builtin.py
    "CalculatorEnv", "HiddenDigitGame",
    # templates.py
    "ObservationEncoder", "check_prefix_preserving", "observation_encoder",
    # sessions.py
    "END_REASONS", "EnvSessions",
]
