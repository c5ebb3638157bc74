"""The commands of `python -m app`, one module each (`add_parser(subparsers)` sets `run`).

Commands keep torch and ray imports inside their run functions so `plan` starts fast.
  inputs    checks shared by the commands that run one HF checkpoint under one layout
  plan      `plan CONFIG.yaml`: search a plan without GPUs and print its table
  train     `train [CONFIG.yaml]`: run an experiment on Ray
  generate  `generate --model HF_DIR --data prompts.jsonl --out out.jsonl`
  score     `score --model HF_DIR --data texts.jsonl --out out.jsonl`
  profile   `profile --out profile.json`: measure this machine for the cost model
  host_link the profile's pinned host <-> GPU copy rate and host RAM per GPU (optimizer offload)
  commands  the parser over those modules and `main(argv)`, the entry of `python -m app`
"""

from __future__ import annotations

from app.cli.commands import COMMAND_MODULES, USAGE_ERROR, build_parser, main

__all__ = [
    # commands.py
    "COMMAND_MODULES", "USAGE_ERROR", "build_parser", "main",
]
