"""The first generation calls of a run: wall seconds of each of several calls whose longest prompts
differ, so each call's cache holds a different number of slots (longest prompt + new tokens).
What it shows is how often the compiled decode step compiles: a call that compiles takes tens of
seconds more than one that reuses an earlier compile.

    python benchmarks/compile_calls_bench.py                 # one GPU, Llama-3.2-1B shape, bf16
    python benchmarks/compile_calls_bench.py --cpu --tiny    # checks the script (CPU, SDPA path)

Random weights; --prompts prompts x --group rows each (the rows of a prompt share its tensor, as
GRPO's samples do), prompt lengths drawn in [longest / 2, longest] with one prompt exactly
`longest` long, --new-tokens sampled at temperature 1 with EOS ignored, CUDA graph + compile.
Prints a row per call: its longest prompt, cache slots, wall seconds and dynamo's graph count
after it. Run each variant in a fresh process with empty compile caches
(TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR), or the second reuses the first's kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# Run as a script from a checkout: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.generation.decoding import GenerationConfig  # noqa: E402
from actors.generation.loop import generate  # noqa: E402
from actors.generation.sampling import SamplingParams  # noqa: E402
from benchmarks.generate_bench import build_random_model  # noqa: E402
from benchmarks.tables import markdown_table  # noqa: E402
from planning.layout import Layout  # noqa: E402
from planning.models import ModelSpec, model_preset  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3.2-1b", help="model preset (planning.models)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="rows per prompt")
    parser.add_argument("--longest", default="128,112,144,120,100", help="longest prompt of each call, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--cpu", action="store_true", help="run on CPU (float32, no CUDA graph)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of width 64 (with --cpu)")
    args = parser.parse_args(argv)
    try:
        args.longest = [int(n) for n in args.longest.split(",")]
    except ValueError:
        parser.error(f"--longest {args.longest!r}: expected comma-separated integers")
    if any(n < 2 for n in args.longest) or args.prompts < 1 or args.group < 1 or args.new_tokens < 2:
        parser.error("--longest values must be >= 2; --prompts, --group >= 1; --new-tokens >= 2")
    return args


def call_prompts(n_prompts: int, group: int, longest: int, vocab: int, seed: int,
                 device: torch.device) -> list[torch.Tensor]:
    """n_prompts x group rows; lengths in [longest // 2, longest], the first exactly longest."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(longest // 2, longest + 1, (n_prompts,), generator=gen).tolist()
    lengths[0] = longest
    distinct = [torch.randint(3, vocab, (n,), generator=gen).to(device) for n in lengths]
    return [prompt for prompt in distinct for _ in range(group)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    spec = model_preset(args.model)
    if args.tiny:
        spec = ModelSpec(name="tiny", family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                         n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=1024)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = build_random_model(spec, Layout.parse("tp1"), None, device, dtype)
    config = GenerationConfig(args.new_tokens, SamplingParams(temperature=1.0), ignore_eos=True,
                              use_cuda_graph=not args.cpu, compile_decode=True)
    from torch._dynamo.utils import counters

    rows = []
    for call, longest in enumerate(args.longest):
        prompts = call_prompts(args.prompts, args.group, longest, spec.vocab_size, call, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        generate(model, prompts, config)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows.append((call + 1, longest, longest + args.new_tokens, time.perf_counter() - start,
                     counters["stats"]["unique_graphs"]))
    print(f"\n{spec.name}: {args.prompts} x {args.group} rows, {args.new_tokens} new tokens, graph + compile")
    print(markdown_table(("call", "longest prompt", "cache slots", "wall s", "graphs compiled so far"),
                         [(str(call), str(longest), str(slots), f"{seconds:.2f}", str(graphs))
                          for call, longest, slots, seconds, graphs in rows]))


if __name__ == "__main__":
    main()
