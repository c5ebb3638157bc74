"""Parameter reallocation: the executor that moves a model's shards between placements.

The plan is `planning.realloc_plan` (a pure function every rank computes); this package only moves
bytes. May import actors.engine and actors.kernels. In dependency order, as Megatron's
resharding splits planner -> execution -> copies:
  schedule  the plan's transfers grouped into messages and rounds (pure Python)
  program   one rank's schedule resolved ahead of time (pure Python)
  buffers   the per-call tensor work: views, packing, unpacking, staging
  copies    a program's copies as tables for the segment-copy kernel
  pull      inside one node: read peers' shards over CUDA IPC straight into place
  cache     per-process caches of programs, copy tables and pull sessions
  executor  `execute_reallocation`: pull or NCCL/gloo rounds, chosen per call
  offload   where a model's weights live between calls: CPU offload and the copy rules
"""

from __future__ import annotations

from actors.realloc.executor import ReallocGroups, execute_reallocation, release_peer_mappings
from actors.realloc.offload import ModelCopies

__all__ = [
    # executor.py
    "ReallocGroups", "execute_reallocation", "release_peer_mappings",
    # offload.py
    "ModelCopies",
]
