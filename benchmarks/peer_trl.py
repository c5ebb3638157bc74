"""TRL's side of benchmarks/peer_bench.py: GRPOTrainer (HF generation, beta=0, one optimizer step
per generation batch) on the shared model directory and prompts, timed step by step.

The batch is `prompts x group` completions generated at once (generation_batch_size), trained
in `per_device_train_batch_size` micro-batches with gradient accumulation over all of them, so
each step is one generation and one optimizer step; with num_iterations=1 and the steps aligned
TRL takes the old logprobs from the training forward, as we do. A step's time runs from the end
of the previous step (the trainer's start for the first) to the end of this one, so it holds
generation, reward, training and the trainer's own overhead.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peer_reward import trl_reward_fn


@dataclass(frozen=True)
class TrlSettings:
    """How TRL runs: micro-batch of completions, model dtype, gradient checkpointing, steps, the
    learning rate."""

    micro_batch: int = 32
    dtype: str = "bfloat16"
    gradient_checkpointing: bool = False
    steps: int = 3  # the first is a warm-up
    learning_rate: float = 1e-6


@dataclass
class SideResult:
    """One system's measurement: seconds and completion tokens of each timed step (warm-up
    excluded), per-call seconds where known (and the phases of a call), the settings in words, or
    the error that stopped it."""

    name: str
    step_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    calls: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # e.g. gen/decode_s, mean of the timed steps
    gc_s: dict[str, float] = field(default_factory=dict)  # per call: garbage collection, mean
    compile_s: dict[str, float] = field(default_factory=dict)  # per call: torch.compile compiling, mean
    gc_before_s: dict[str, float] = field(default_factory=dict)  # per call: collections since the last call, max
    other_s: list[float] = field(default_factory=list)  # per timed step: the step minus its calls
    settings: str = ""
    error: str | None = None

    @property
    def seconds_per_step(self) -> float:
        return sum(self.step_s) / len(self.step_s) if self.step_s else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return sum(self.tokens) / len(self.tokens) if self.tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.step_s) if self.step_s else float("nan")


def run_trl(model_dir: Path, prompts_file: Path, n_prompts: int, group: int, gen_len: int, settings: TrlSettings,
            out: Path, on_gpu: bool, seed: int = 0) -> SideResult:
    """GRPOTrainer for `settings.steps` steps; a SideResult with the error when TRL is missing or fails."""
    try:
        import trl
        from datasets import Dataset
    except ImportError as exc:
        return SideResult("TRL", error=f"not importable ({exc}); install the wheels (see peer_bench.py)")
    result = SideResult(f"TRL {trl.__version__} GRPOTrainer")
    try:
        _train(result, model_dir, prompts_file, n_prompts, group, gen_len, settings, out, on_gpu, seed, Dataset)
    except Exception as exc:  # noqa: BLE001  (a crash is a result of the comparison: report it)
        result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return result


def _train(result: SideResult, model_dir: Path, prompts_file: Path, n_prompts: int, group: int, gen_len: int,
           settings: TrlSettings, out: Path, on_gpu: bool, seed: int, dataset_cls: Any) -> None:
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    batch = n_prompts * group
    if batch % settings.micro_batch:
        raise ValueError(f"micro_batch={settings.micro_batch}: must divide the {batch} completions of a step")
    records = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()]
    dataset = dataset_cls.from_list([{"prompt": r["prompt"]} for r in records])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_counts: list[int] = []
    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if on_gpu:
                import torch

                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    dtype = settings.dtype if on_gpu else "float32"
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=settings.steps, learning_rate=settings.learning_rate,
        weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=settings.micro_batch,
        gradient_accumulation_steps=batch // settings.micro_batch, num_generations=group,
        max_completion_length=gen_len, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=settings.gradient_checkpointing,
        model_init_kwargs={"dtype": dtype}, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=seed, use_vllm=False,
    )
    result.settings = (f"HF generate, {batch} completions per step in micro-batches of {settings.micro_batch} "
                       f"(gradient accumulation {batch // settings.micro_batch}, one optimizer step), "
                       f"model {dtype}, bf16={on_gpu}, gradient_checkpointing={settings.gradient_checkpointing}, "
                       f"beta=0, num_iterations=1, learning_rate={settings.learning_rate:g}")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=trl_reward_fn(token_counts), args=args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    steps = [b - a for a, b in itertools.pairwise(ends)]
    if len(steps) != settings.steps or len(token_counts) != settings.steps:
        raise RuntimeError(f"timed {len(steps)} steps and {len(token_counts)} generations, wanted {settings.steps}")
    result.step_s, result.tokens = steps[1:], token_counts[1:]
