"""Generation: a static KV cache, packed prefill, a decode loop and sampling, serial or pipelined.

May import actors.engine and actors.kernels. In dependency order:
  sampling     greedy / temperature / top-k / top-p, and the truncation the train side reapplies
  fp8_weights  FP8 copies of the MLP and head weights for decode steps (opt-in)
  kv_cache     the head-major KV cache decode reads once per step, and the fused [q; k; v] weights
  cache_extension  tokens appended to a filled cache (multi-turn observations)
  decoding     what to generate, the recorded output, the memory check, the prefilled cache
  decode_step  the cached decode step (CUDA graph, torch.compile)
  prefill      the prompts' forward, once per distinct prompt (samples of one prompt share it)
  compaction   dropping finished rows from the decode step (the serial and multi-turn loops)
  pipelined  pipeline-parallel generation: micro-batches circulate through the stages
  loop       `generate`: the serial loop, or the pipelined one when the layout has pp > 1
  turns      what the multi-turn loop asks of the environments (`TurnSource`, `TurnResult`)
  turn_state  the multi-turn loop's per-row state on the device, and each step's readback
  multiturn  `generate_turns`: trajectories that pause for an environment and resume on their cache
"""

from __future__ import annotations

from actors.generation.decoding import GenerationConfig, GenerationOutput
from actors.generation.loop import generate
from actors.generation.multiturn import TurnsOutput, generate_turns
from actors.generation.sampling import SamplingParams
from actors.generation.turns import TurnResult, TurnSource

__all__ = [
    # sampling.py
    "SamplingParams",
    # decoding.py
    "GenerationConfig", "GenerationOutput",
    # loop.py
    "generate",
    # turns.py
    "TurnResult", "TurnSource",
    # multiturn.py
    "TurnsOutput", "generate_turns",
]
