"""Train-step and forward throughput of the parallel engine (issue 3 targets), with MFU.

Llama-3.2-1B shape, random weights, bf16, packed micro-batches of ~16k tokens made of sequences
of 512-2048 tokens. Runs tp=1 on one GPU and tp=2 on two (one process per GPU, NCCL), then
prints a table: tokens/s, achieved TFLOP/s and model FLOPs utilisation against the measured
785 TFLOP/s bf16 peak, and the tp=2 scaling efficiency.

Model FLOPs per token (Megatron's accounting, no recomputation): forward = 2 * (matmul
parameters, lm_head included, embedding lookup excluded) + causal attention 2 * s * n_heads *
head_dim per layer (QK^T and AV, halved for causality, with s the sequence length); training =
3x forward.

    python3 benchmarks/engine_bench.py                # GPU: tp=1 and (with 2 GPUs) tp=2
    python3 benchmarks/engine_bench.py --cpu --tiny   # a seconds-long check on CPU
    python3 benchmarks/engine_bench.py --profile      # also: top kernels and GPU time by kernel kind
                                                      # (matmul, attention, NCCL, other) per step
    python3 benchmarks/engine_bench.py --grpo-step --tp 1 --profile
        # exactly the training call of benchmarks/peer_bench.py (issue 13): 512 sequences of
        # 128 + 512 tokens in one optimizer step, 16 micro-batches of 32 sequences (20,480
        # tokens), on one GPU; the target is >= 60% MFU, and --profile says where the rest goes.
        # Each micro-batch holds its 4 prompts once (--no-shared-prompts: every row whole); MFU
        # counts the FLOPs the engine runs, tokens/s the rows' tokens.
    python3 benchmarks/engine_bench.py --model qwen2.5-0.5b --grpo-shape 64,8,256,512 --n-micro 24 \
        --tp 1 --profile
        # another preset and GRPO batch: here the 0.5B fidelity shape's inference calls (24
        # micro-batches of ~16k tokens); --profile's idle report says where its host time goes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.model import set_elementwise_fusion  # noqa: E402
from actors.engine.model_engine import ModelEngine, SequenceBatch  # noqa: E402
from actors.engine.optimizer import AdamWConfig  # noqa: E402
from actors.engine.process_groups import ParallelGroups, build_parallel_groups, free_port, init_local_world  # noqa: E402
from actors.engine.shared_prefix import prefix_groups  # noqa: E402
from actors.rl.losses import sft_loss  # noqa: E402
from benchmarks.gpu_idle import format_report, gpu_idle  # noqa: E402
from benchmarks.peer_floor import matmul_params  # noqa: E402
from planning.layout import Layout  # noqa: E402
from planning.models import ModelSpec, model_preset  # noqa: E402

PEAK_FLOPS = 785e12


def flops_per_token(spec: ModelSpec, lengths: list[int], train: bool) -> float:
    """Model FLOPs per token averaged over the batch (see module docstring)."""
    matmul = matmul_params(spec)  # the head included (the embedding matrix when tied), the lookup not
    total_tokens = sum(lengths)
    attn = sum(2 * s * s * spec.n_heads * spec.head_dim * spec.n_layers for s in lengths) / total_tokens
    fwd = 2 * matmul + attn
    return 3 * fwd if train else fwd


def executed_flops(spec: ModelSpec, batch: SequenceBatch, train: bool) -> float:
    """Model FLOPs the engine runs for `batch` (module docstring): with prefix_lengths each shared
    prompt's tokens and its attention once per group (actors.engine.shared_prefix)."""
    lengths = list(batch.lengths)
    if batch.prefix_lengths is None:
        return flops_per_token(spec, lengths, train) * sum(lengths)
    per_token = flops_per_token(spec, [1], train)  # matmuls only (1-token sequences: ~no attention)
    attn_unit = 2 * spec.n_heads * spec.head_dim * spec.n_layers * (3 if train else 1)
    tokens, attn = 0.0, 0.0
    for first, end, shared in prefix_groups(batch.tokens, lengths, batch.prefix_lengths):
        tokens += shared + sum(lengths[r] - shared for r in range(first, end))
        attn += shared * shared + sum(lengths[r] ** 2 - shared * shared for r in range(first, end))
    return per_token * tokens + attn_unit * attn


PEER_SHAPE = (64, 8, 128, 512)  # peer_bench's batch: prompts, samples per prompt, prompt and answer tokens


def make_grpo_batch(vocab: int, shared: bool, shape: tuple[int, int, int, int] = PEER_SHAPE,
                    seed: int = 1) -> SequenceBatch:
    """A GRPO batch: `prompts` prompts of `prompt_len` tokens x `group` samples of `gen_len`
    (peer_bench's by default); with `shared` the rows of a prompt say so (prefix_lengths) and the
    engine holds each prompt once."""
    prompts, group, prompt_len, gen_len = shape
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in torch.randint(0, vocab, (prompts, prompt_len), generator=gen):
        rows += [torch.cat([prompt, torch.randint(0, vocab, (gen_len,), generator=gen)]) for _ in range(group)]
    tokens = torch.cat(rows)
    return SequenceBatch(tokens, (prompt_len + gen_len,) * len(rows), token_data={"mask": torch.ones(tokens.numel())},
                         prefix_lengths=(prompt_len,) * len(rows) if shared else None)


def parse_grpo_shape(text: str) -> tuple[int, int, int, int]:
    """--grpo-shape "PROMPTS,GROUP,PROMPT_LEN,GEN_LEN" -> four positive ints."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--grpo-shape={text!r}: want four positive integers "
                                         "PROMPTS,GROUP,PROMPT_LEN,GEN_LEN, e.g. 64,8,256,512")
    prompts, group, prompt_len, gen_len = (int(p) for p in parts)
    return prompts, group, prompt_len, gen_len


def make_batch(tokens_per_mb: int, n_micro: int, vocab: int, lo: int, hi: int, seed: int) -> SequenceBatch:
    """Random packed batch: n_micro groups of sequences of lo..hi tokens, ~tokens_per_mb each."""
    rng = random.Random(seed)
    lengths: list[int] = []
    for _ in range(n_micro):
        budget = tokens_per_mb
        while budget >= lo:
            n = min(rng.randint(lo, hi), budget)
            lengths.append(n)
            budget -= n
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    mask = torch.ones(sum(lengths))
    return SequenceBatch(tokens, tuple(lengths), token_data={"mask": mask})


def loss_fn(logprobs: torch.Tensor, data: dict[str, torch.Tensor]):
    return sft_loss(logprobs, data["mask"])


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    device = "cpu" if args.cpu else f"cuda:{rank}"
    if world > 1:
        init_local_world(rank, world, port, "gloo" if args.cpu else "nccl", threads=1 if args.cpu else 4)
        groups = build_parallel_groups(Layout(tp=world))
    else:
        if not args.cpu:
            torch.cuda.set_device(0)
        groups = ParallelGroups.serial()
    spec = model_preset(args.model)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    engine = ModelEngine(spec, False, groups, device, dtype, seed=0, optim_config=AdamWConfig(lr=1e-5))
    if args.eager_elementwise:
        set_elementwise_fusion(engine.model, False)
    if args.grpo_shape is not None:
        batch = make_grpo_batch(spec.vocab_size, not args.no_shared_prompts, args.grpo_shape)
    else:
        batch = make_batch(args.tokens_per_mb, args.n_micro, spec.vocab_size, args.min_len, args.max_len, seed=1)
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize

    def timed(fn: Callable[[], object], reps: int) -> float:
        for _ in range(args.warmup):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - start) / reps

    train_s = timed(lambda: engine.train_step(batch, loss_fn, n_micro=args.n_micro), args.steps)
    with torch.no_grad():
        fwd_s = timed(lambda: engine.forward_logprobs(batch, n_micro=args.n_micro), args.steps)
    if args.profile and not args.cpu:  # every rank runs the step (collectives); rank 0 prints
        print_profile(lambda: engine.train_step(batch, loss_fn, n_micro=args.n_micro), f"train step, tp={world}",
                      rank == 0)
        with torch.no_grad():
            print_profile(lambda: engine.forward_logprobs(batch, n_micro=args.n_micro), f"forward, tp={world}",
                          rank == 0)
    if rank == 0:
        n_tokens = sum(batch.lengths)
        out[world] = {
            "tokens": n_tokens, "train_s": train_s, "fwd_s": fwd_s,
            "train_flops": executed_flops(spec, batch, True), "fwd_flops": executed_flops(spec, batch, False),
            "mem_gib": 0.0 if args.cpu else torch.cuda.max_memory_allocated() / 2**30,
        }
        shared = "" if batch.prefix_lengths is None else ", prompts shared"
        print(f"measured tp={world}: train {train_s:.3f} s/step, forward {fwd_s:.3f} s/step, "
              f"{n_tokens} tokens{shared}, peak {out[world]['mem_gib']:.1f} GiB{gqa_note()}", flush=True)


def gqa_note() -> str:
    """How the packed attention takes GQA on this GPU's torch (", varlen GQA <mode>")."""
    from actors.engine.attention import varlen_attn_available, varlen_gqa_mode

    if not torch.cuda.is_available() or not varlen_attn_available():
        return ""
    return f", varlen GQA {varlen_gqa_mode(torch.device('cuda'))}"


def print_profile(step: Callable[[], object], title: str, show: bool) -> None:
    """The top CUDA kernels of one call of `step` and GPU time by kernel kind (printed when
    `show`), i.e. where the time of a step goes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if not show:
        return
    print(f"profile of one {title}:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print_time_by_kind(prof, title)
    print(format_report(gpu_idle(prof), title), flush=True)


def print_time_by_kind(prof: torch.profiler.profile, title: str) -> None:
    """One line: the profiled CUDA kernels' self time summed by `kernel_category`, largest first."""
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":  # kernels only: CPU ops repeat their kernels' time
            kind = kernel_category(event.key)
            totals[kind] = totals.get(kind, 0.0) + event.self_device_time_total / 1e3
    whole = sum(totals.values()) or 1.0
    print(f"GPU kernel time by kind, {title}: " + ", ".join(
        f"{k} {v:.1f} ms ({v / whole:.0%})" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])), flush=True)


# Substrings of kernel names, first match wins: where a step's GPU time goes.
KERNEL_KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "attn")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "_mm_", "sm90", "sm80")),
                ("logprobs", ("logprob", "logsumexp", "cross_entropy")),
                ("optimizer", ("adam", "foreach", "multi_tensor")))


def kernel_category(name: str) -> str:
    """gemm, attention, nccl, logprobs, optimizer, or other (elementwise, norms, copies)."""
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def spawn(world: int, args: argparse.Namespace) -> dict:
    """Run one tp degree in fresh processes (tp=1 too), so each starts with an empty GPU: the
    caching allocator of a finished run would otherwise keep its memory from the next one."""
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_entry, args=(world, free_port(), args, out), nprocs=world, join=True)
    return dict(out)


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    run_rank(rank, world, port, args, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (a functional check)")
    parser.add_argument("--tiny", action="store_true", help="tiny model instead of Llama-3.2-1B")
    parser.add_argument("--model", default=None, help="a model preset (planning.models), e.g. qwen2.5-0.5b; "
                                                     "default llama3.2-1b (tiny with --tiny)")
    parser.add_argument("--grpo-shape", type=parse_grpo_shape, default=None, metavar="P,G,PL,GL",
                        help="a GRPO batch of P prompts x G samples, PL prompt + GL answer tokens, in --n-micro "
                             "micro-batches (--grpo-step: 64,8,128,512 in 16)")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="tp degrees to run (default 1 and 2 if 2 GPUs)")
    parser.add_argument("--tokens-per-mb", type=int, default=16384)
    parser.add_argument("--n-micro", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one train step")
    parser.add_argument("--eager-elementwise", action="store_true",
                        help="norms, rotary and SwiGLU gate unfused (the default on CUDA fuses them)")
    parser.add_argument("--grpo-step", action="store_true",
                        help="peer_bench's training call: 16 micro-batches of 32 sequences of 640 tokens")
    parser.add_argument("--no-shared-prompts", action="store_true",
                        help="with --grpo-step: every row whole (by default a micro-batch holds each of its "
                             "prompts once, as the train call does)")
    args = parser.parse_args()
    args.model = args.model or ("tiny" if args.tiny else "llama3.2-1b")
    try:
        model_preset(args.model)
    except ValueError as exc:
        parser.error(f"--model={args.model!r}: {exc}")
    if args.grpo_step:  # 64 prompts x 8 samples of 128 + 512 tokens, one optimizer step
        args.tokens_per_mb, args.n_micro, args.min_len, args.max_len = 32 * 640, 16, 640, 640
        args.grpo_shape = args.grpo_shape or (PEER_SHAPE if not args.cpu else None)
    if args.cpu:
        args.tokens_per_mb, args.min_len, args.max_len, args.steps, args.warmup = 256, 16, 64, 2, 1
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    n_gpus = 0 if args.cpu else torch.cuda.device_count()
    degrees = args.tp or ([1, 2] if args.cpu or n_gpus >= 2 else [1])
    results: dict[int, dict] = {}
    for tp in degrees:
        results.update(spawn(tp, args))
    peak = PEAK_FLOPS if not args.cpu else float("nan")
    work = (f"GRPO batch {'x'.join(map(str, args.grpo_shape))} in {args.n_micro} micro-batches" if args.grpo_shape
            else f"{args.n_micro} micro-batches x ~{args.tokens_per_mb} tokens, sequences {args.min_len}-{args.max_len}")
    print(f"\nengine benchmark ({args.model}, {'cpu fp32' if args.cpu else 'bf16'}, "
          f"elementwise {'eager' if args.eager_elementwise or args.cpu else 'fused'}, {work})")
    print(f"{'tp':>3} {'gpus':>4} {'train tok/s':>12} {'train TFLOP/s':>14} {'train MFU':>9} "
          f"{'fwd tok/s':>10} {'fwd TFLOP/s':>12} {'fwd MFU':>8} {'peak mem GiB':>12} {'scaling':>8}")
    base = results.get(1)
    for tp, r in sorted(results.items()):
        train_tflops = r["train_flops"] / r["train_s"] / 1e12
        fwd_tflops = r["fwd_flops"] / r["fwd_s"] / 1e12
        scaling = (r["tokens"] / r["train_s"]) / (tp * base["tokens"] / base["train_s"]) if base else float("nan")
        print(f"{tp:>3} {tp:>4} {r['tokens'] / r['train_s']:>12.0f} {train_tflops:>14.1f} "
              f"{train_tflops * 1e12 / (peak * tp):>9.1%} {r['tokens'] / r['fwd_s']:>10.0f} {fwd_tflops:>12.1f} "
              f"{fwd_tflops * 1e12 / (peak * tp):>8.1%} {r['mem_gib']:>12.1f} {scaling:>8.2f}")


if __name__ == "__main__":
    main()
