"""Decode throughput of actors.generation (the `generate` loop) against the memory-bandwidth roofline.

    python benchmarks/generate_bench.py                 # one H200, Llama-3.2-1B shape, bf16
    python benchmarks/generate_bench.py --tp 2          # two H200s, 2 spawned processes, NCCL
    python benchmarks/generate_bench.py --cpu --tiny    # seconds on a laptop (checks the script)
    python benchmarks/generate_bench.py --grpo-step     # the generation call of benchmarks/peer_bench.py
        # (issue 13): 512 sequences (64 prompts x 8, --group 8) of 128 tokens, 512 new tokens sampled at
        # temperature 1, modes graph and graph+compile; the target is >= 60% of the roofline

Random weights; 256 prompts of 128 random tokens, 512 new tokens, EOS ignored, greedy. For each
of eager and CUDA-graph decoding it times a prefill-only call (1 new token) and the full call;
decode time = full - prefill, decode tokens/s = n_prompts * (new_tokens - 1) / decode time.

Roofline: every decode step reads this GPU's weights once plus the valid part of its KV cache
(on average prompt_len + new_tokens / 2 tokens per sequence), so the best step time is
bytes / bandwidth (4.3e12 B/s measured on an H200) and the best rate n_prompts / that time. Under
tp the weights and KV heads are split, each GPU reading its share in parallel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script from a checkout: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.model import Transformer
from actors.engine.parallelize import build_model_shard
from actors.engine.process_groups import ParallelGroups, build_parallel_groups, free_port
from actors.generation.decoding import GenerationConfig
from actors.generation.fp8_weights import Fp8DecodeWeights
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from planning.layout import Layout
from planning.models import ModelSpec, model_preset

H200_BANDWIDTH = 4.3e12
MODES_HELP = "eager|graph[+sdpa|+matmul|+triton][+compile][+fp8][+fp8kv]"


@dataclass(frozen=True)
class BenchResult:
    """One measured mode (eager or CUDA graph)."""

    mode: str
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    roofline_tokens_per_s: float
    own_roofline_tokens_per_s: float  # at the bytes the mode reads (FP8 weights / cache: fewer)

    @property
    def ratio(self) -> float:
        return self.decode_tokens_per_s / self.roofline_tokens_per_s

    @property
    def own_ratio(self) -> float:
        return self.decode_tokens_per_s / self.own_roofline_tokens_per_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--group", type=int, default=None,
                        help="rows per distinct prompt, sharing its prefill and its cached prompt K/V "
                             "(default 1; 8 with --grpo-step)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s per GPU")
    parser.add_argument("--modes", default=None,
                        help=f"comma list of {MODES_HELP} (default eager,graph+sdpa,graph,graph+compile; "
                             "with --grpo-step graph,graph+compile)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (float32, gloo)")
    parser.add_argument("--tiny", action="store_true", help="tiny preset, 8 prompts of 16 tokens, 16 new tokens")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top kernels of one whole generate call of the last mode")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (full vocabulary)")
    parser.add_argument("--grpo-step", action="store_true",
                        help="peer_bench's generation: 512 prompts of 128 tokens, 512 new tokens, temperature 1")
    args = parser.parse_args()
    if args.grpo_step:
        args.prompts, args.prompt_len, args.new_tokens, args.temperature = 512, 128, 512, 1.0
        args.group = 8 if args.group is None else args.group
        args.modes = args.modes or "graph,graph+compile"
    args.modes = args.modes or "eager,graph+sdpa,graph,graph+compile"
    args.group = 1 if args.group is None else args.group
    if args.tiny:
        args.preset, args.prompts, args.prompt_len, args.new_tokens = "tiny", 8, 16, 16
    return args


def roofline_tokens_per_s(model: Transformer, spec: ModelSpec, args: argparse.Namespace,
                          config: GenerationConfig | None = None) -> float:
    """Best decode rate of one GPU's shard: n_prompts / ((weights + mean valid KV) / bandwidth),
    at the model's dtype (the issue's roofline). With `config`, at the bytes that mode reads
    instead: one byte per weight of the FP8 MLPs and head (fp8_weights), per cached value (an
    e4m3 cache)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    itemsize = next(model.parameters()).element_size()
    if config is not None and config.fp8_weights:  # the copies (with their scales) read instead
        copied = sum(w.numel() for w in Fp8DecodeWeights.sources(model))
        weight_bytes += Fp8DecodeWeights.nbytes(model) - copied * itemsize
    kv_itemsize = 1 if config is not None and config.kv_cache_dtype == "fp8" else itemsize
    kv_per_token = sum(2 * layer.self_attn.n_kv_heads * layer.self_attn.head_dim * kv_itemsize
                       for layer in model.model.layers.values())
    mean_len = args.prompt_len + args.new_tokens / 2
    step_bytes = weight_bytes + args.prompts * mean_len * kv_per_token
    return args.prompts / (step_bytes / args.bandwidth)


def build_random_model(spec: ModelSpec, layout: Layout, groups: ParallelGroups | None, device: torch.device,
                       dtype: torch.dtype) -> Transformer:
    """This rank's shard with random weights drawn on the device (fast for 1B parameters)."""
    coords = (0, groups.tp_rank if groups is not None else 0, 0)
    model = build_model_shard(spec, False, layout, coords, groups, device, dtype, seed=None)
    gen = torch.Generator(device=device).manual_seed(1234 + coords[1])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def timed_generate(model: Transformer, prompts: list[torch.Tensor], config: GenerationConfig,
                   groups: ParallelGroups | None) -> float:
    """Wall seconds of one generate call, all ranks synchronised before and after."""
    device = prompts[0].device
    for _ in range(2):  # before: align the ranks; after: wait for the slowest
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        if _ == 0:
            start = time.perf_counter()
            generate(model, prompts, config, groups)
    return time.perf_counter() - start


def mode_config(mode: str, new_tokens: int, temperature: float = 0.0) -> GenerationConfig:
    """Config of a mode: "eager" or "graph", optionally with a decode attention kernel "+sdpa",
    "+matmul" or "+triton" (default "auto": Triton on CUDA), "+compile" (torch.compile'd decode
    step), "+fp8" (FP8 copies of the MLP and head weights in decode, GenerationConfig.fp8_weights),
    "+fp8kv" (an FP8 KV cache, GenerationConfig.kv_cache_dtype), e.g. "graph+compile+sdpa"."""
    parts = mode.split("+")
    kernels = {"sdpa", "matmul", "triton"}
    if parts[0] not in ("eager", "graph") or not set(parts[1:]) <= kernels | {"compile", "fp8", "fp8kv"}:
        raise ValueError(f"--modes: {mode!r} unknown; allowed: {MODES_HELP}")
    kernel = next((p for p in parts[1:] if p in kernels), "auto")
    return GenerationConfig(new_tokens, SamplingParams(temperature=temperature), ignore_eos=True,
                            use_cuda_graph=parts[0] == "graph", compile_decode="compile" in parts,
                            decode_attention=kernel, fp8_weights="fp8" in parts,
                            kv_cache_dtype="fp8" if "fp8kv" in parts else "auto")


def run_rank(rank: int, args: argparse.Namespace, port: int | None) -> list[BenchResult]:
    """Build the shard, warm up, measure every mode; returns the results (rank 0 prints them)."""
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    groups = None
    if port is not None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if args.cpu else "nccl", rank=rank, world_size=args.tp)
        groups = build_parallel_groups(Layout(tp=args.tp))
    torch.manual_seed(0)
    spec = model_preset(args.preset)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = build_random_model(spec, Layout(tp=args.tp), groups, device, dtype)
    gen = torch.Generator().manual_seed(7)
    if args.group < 1 or args.prompts % args.group:
        raise SystemExit(f"--group {args.group}: must be >= 1 and divide --prompts {args.prompts}")
    distinct = [torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=gen).to(device)
                for _ in range(args.prompts // args.group)]
    prompts = [p for p in distinct for _ in range(args.group)]  # a group's rows share one tensor
    roofline = roofline_tokens_per_s(model, spec, args)
    results = []
    for mode in args.modes.split(","):
        try:
            results.append(measure_mode(model, prompts, mode, args, groups, roofline))
        except Exception as exc:  # one failing mode (e.g. a compile error) must not hide the others
            print(f"mode {mode} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if rank == 0:  # progress, in case a later mode runs past a time limit
            r = results[-1]
            print(f"measured {mode}: {r.decode_tokens_per_s:,.0f} decode tok/s ({r.ratio:.1%} of roofline)", flush=True)
    if args.profile:
        profile_call(model, prompts, groups, args.modes.split(",")[-1], args)
    if port is not None:
        dist.destroy_process_group()
    return results


def measure_mode(model: Transformer, prompts: list[torch.Tensor], mode: str, args: argparse.Namespace,
                 groups: ParallelGroups | None, roofline: float) -> BenchResult:
    """Warm up, then time a prefill-only call and a full call of one mode."""
    base = mode_config(mode, args.new_tokens, args.temperature)
    prefill_only = GenerationConfig(**{**base.__dict__, "max_new_tokens": 1})
    # Warm-up: one full call, so that compiles (one per batch shape and attention bucket) and
    # kernel autotuning happen outside the measurement; a call's own graph captures stay inside.
    timed_generate(model, prompts, base, groups)
    prefill_s = timed_generate(model, prompts, prefill_only, groups)
    full_s = timed_generate(model, prompts, base, groups)
    decode_s = max(full_s - prefill_s, 1e-9)
    rate = args.prompts * (args.new_tokens - 1) / decode_s
    return BenchResult(mode, prefill_s, decode_s, rate, roofline, roofline_tokens_per_s(model, model.spec, args, base))


def profile_call(model: Transformer, prompts: list[torch.Tensor], groups: ParallelGroups | None,
                 mode: str, args: argparse.Namespace) -> None:
    """Top kernels and GPU time by kernel kind over one whole generate call of `mode` (already
    warmed up by measure_mode), so every context length of the call is in the sample."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.engine_bench import print_time_by_kind

    config = mode_config(mode, args.new_tokens, args.temperature)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompts[0].is_cuda else [])
    with profile(activities=activities) as prof:
        timed_generate(model, prompts, config, groups)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    sort_by = "self_cuda_time_total" if prompts[0].is_cuda else "self_cpu_time_total"
    print(f"profile of one generate call, mode {mode}:")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70), flush=True)
    print_time_by_kind(prof, f"generate {mode}")


def print_table(args: argparse.Namespace, results: list[BenchResult]) -> None:
    where = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    how = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature:g}"
    print(f"\n{args.preset} tp={args.tp} on {where}: {args.prompts} prompts x {args.prompt_len} tokens "
          f"({args.prompts // args.group} distinct), "
          f"{args.new_tokens} new tokens {how}, bandwidth {args.bandwidth:.2e} B/s per GPU")
    print("ratio: against the roofline of the model's dtype (the issue's); own: against the bytes the mode "
          "reads (FP8 weights and cache read fewer)")
    print(f"{'mode':<26} {'prefill s':>10} {'decode s':>10} {'decode tok/s':>14} {'roofline tok/s':>15} {'ratio':>7}"
          f" {'own':>7}")
    for r in results:
        print(f"{r.mode:<26} {r.prefill_s:>10.3f} {r.decode_s:>10.3f} {r.decode_tokens_per_s:>14,.0f} "
              f"{r.roofline_tokens_per_s:>15,.0f} {r.ratio:>7.1%} {r.own_ratio:>7.1%}")


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    results = run_rank(rank, args, port)
    if rank == 0:
        print_table(args, results)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)) if args.cpu else 1)
    if args.cpu:
        args.modes = "eager+sdpa,eager+matmul"  # CUDA graphs need CUDA; compiling on CPU needs a C++ toolchain
    if args.tp == 1:
        print_table(args, run_rank(0, args, None))
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args, free_port()), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
