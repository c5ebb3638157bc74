"""What stays allocated on the GPU between calls (issue 12's memory estimates): one 1B actor,
a train step (16 micro-batches of 20k tokens) and a generation of 512 x (128 + 512) tokens with
the GRPO example's settings; prints torch.cuda.memory_allocated before and after each, in GiB.

    python3 benchmarks/memory_probe.py
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.model_engine import ModelEngine  # noqa: E402
from actors.engine.optimizer import AdamWConfig  # noqa: E402
from actors.engine.process_groups import ParallelGroups  # noqa: E402
from actors.generation import GenerationConfig, SamplingParams, generate  # noqa: E402
from benchmarks.engine_bench import loss_fn, make_batch  # noqa: E402
from planning.models import model_preset  # noqa: E402


def gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def main() -> None:
    torch.cuda.set_device(0)
    spec = model_preset("llama3.2-1b")
    engine = ModelEngine(spec, False, ParallelGroups.serial(), "cuda:0", torch.bfloat16, seed=0,
                         optim_config=AdamWConfig(lr=1e-5))
    rows = [("built", gib())]
    batch = make_batch(20480, 16, spec.vocab_size, 640, 640, seed=1)
    for k in range(2):
        engine.train_step(batch, loss_fn, n_micro=16)
        rows.append((f"after train step {k}", gib()))
        gc.collect()
        rows.append((f"after train step {k} + gc", gib()))
    prompts = [torch.randint(0, spec.vocab_size, (128,), device="cuda") for _ in range(512)]
    for compile_decode in (False, True):
        config = GenerationConfig(512, SamplingParams(temperature=1.0), ignore_eos=True, use_cuda_graph=True,
                                  compile_decode=compile_decode)
        with torch.no_grad():
            out = generate(engine.model, prompts, config)
        del out
        rows.append((f"after generate (compile={compile_decode})", gib()))
        gc.collect()
        rows.append((f"after generate (compile={compile_decode}) + gc", gib()))
    engine.optimizer.zero_grad()
    rows.append(("after optimizer.zero_grad()", gib()))
    print(f"{'point':<40} {'allocated GiB':>14}")
    for name, value in rows:
        print(f"{name:<40} {value:>14.2f}")


if __name__ == "__main__":
    main()
