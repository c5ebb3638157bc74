"""Decode with finished rows dropped (actors.generation.compaction) against keeping them, on
responses that end at different lengths.

    python3 benchmarks/compaction_bench.py              # one GPU: the peer bench's generation shape
    python3 benchmarks/compaction_bench.py --cpu --tiny # seconds on CPU (checks the script)

Shape (GPU): Llama-3.2-1B, 512 rows = 64 prompts x 8 samples, 128 prompt tokens, at most 512 new
tokens sampled at temperature 1, CUDA graph + torch.compile, as benchmarks/peer_bench.py's
generation call. Random weights never emit EOS on their own, so the bench plants one
(benchmarks/planted_eos.py): every step ends a row with the same probability, so response lengths
are geometric, mean about --mean-len, cut at the budget. The compute of a step is that of any
weights of this shape.

For each --fractions value (0: keep every row), and each --min-row-steps value for a fraction
above 0 (GenerationConfig.compact_min_row_steps; "auto": the loop's default), one warm-up call,
then --reps timed calls; the
table gives the decode seconds (device time, graph captures included), response tokens per
second, compactions per call and the speed-up over fraction 0. "compact s" is the host time of a
call's compactions (each from the decision to the smaller step's first call, which captures its
graph); "first call s" the warm-up call's wall time (the first fraction pays the compile, later
ones any recompile for a new row count). Every fraction samples with the
same seed, so the rows' lengths agree up to bf16 ties (a different row count's GEMMs round
differently); the table says how many rows agree with fraction 0.

--dynamic-rows (GenerationConfig.compile_dynamic_rows) decides whether a compacting call's first
compile has the row count symbolic; compare its first-call times in fresh processes with their own
caches, e.g. `TORCHINDUCTOR_CACHE_DIR=/tmp/ind_off python3 benchmarks/compaction_bench.py
--fractions 0.75,0 --dynamic-rows off`. Within one process dynamo reuses a compile whose guards
accept the call: a fraction-0 row after a symbolic compile decodes with that symbolic step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.model import Transformer  # noqa: E402
from actors.generation.compaction import min_row_steps as row_step_bar  # noqa: E402
from actors.generation.decoding import GenerationConfig, GenerationOutput  # noqa: E402
from actors.generation.loop import generate  # noqa: E402
from actors.generation.sampling import SamplingParams  # noqa: E402
from benchmarks.generate_bench import build_random_model  # noqa: E402
from benchmarks.planted_eos import expected_length, plant_eos  # noqa: E402
from planning.layout import Layout  # noqa: E402
from planning.models import model_preset  # noqa: E402

# --dynamic-rows -> GenerationConfig.compile_dynamic_rows: "auto" leaves it to the loop, which traces
# the row count symbolically from the first call where the call may compact.
DYNAMIC_ROWS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--mean-len", type=float, default=200.0, help="mean response length the planted EOS aims at")
    parser.add_argument("--fractions", default="0,0.75,0.5", help="GenerationConfig.compact_fraction values")
    parser.add_argument("--min-row-steps", default="auto",
                        help="GenerationConfig.compact_min_row_steps values, comma-separated ints or 'auto'")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dynamic-rows", choices=sorted(DYNAMIC_ROWS), default="auto",
                        help="GenerationConfig.compile_dynamic_rows for every row (auto: the loop's default)")
    parser.add_argument("--compile-times", action="store_true",
                        help="print torch._dynamo's compile-time breakdown (seconds by phase) before the table")
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU, eager steps")
    parser.add_argument("--tiny", action="store_true", help="tiny preset, 4 prompts x 4 of 8 tokens, 64 new tokens")
    args = parser.parse_args(argv)
    if args.tiny:
        args.preset, args.prompts, args.group, args.prompt_len, args.new_tokens = "tiny", 4, 4, 8, 64
        args.mean_len, args.reps = min(args.mean_len, 24.0), 1
    fractions = [float(f) for f in args.fractions.split(",")]
    if any(not 0.0 <= f < 1.0 for f in fractions) or 0.0 not in fractions:
        raise SystemExit(f"--fractions {args.fractions}: each in [0, 1), and 0 among them (the baseline)")
    if args.mean_len <= 1.0:
        raise SystemExit(f"--mean-len {args.mean_len}: must be > 1")
    args.fraction_list = fractions
    args.min_row_steps_list = [parse_min_row_steps(v) for v in args.min_row_steps.split(",")]
    return args


def parse_min_row_steps(value: str) -> int | None:
    """'auto' -> None (the loop's default), else an int >= 0."""
    value = value.strip()
    if value == "auto":
        return None
    if not value.isdigit():
        raise SystemExit(f"--min-row-steps {value!r}: each an int >= 0 or 'auto'")
    return int(value)


def configurations(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    """(compact_fraction, compact_min_row_steps) of each row: fraction 0 once, the others with each
    --min-row-steps value."""
    return [(f, m) for f in args.fraction_list for m in ([None] if f == 0.0 else args.min_row_steps_list)]


def timed_call(model: Transformer, prompts: list[torch.Tensor], config: GenerationConfig) -> GenerationOutput:
    if prompts[0].is_cuda:
        torch.cuda.synchronize()
    return generate(model, prompts, config)


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    spec = model_preset(args.preset)
    model = build_random_model(spec, Layout(), None, device, dtype)
    eos = spec.eos_token_id if spec.eos_token_id is not None else 1
    planted = plant_eos(model, eos, args.mean_len)
    vocab = spec.vocab_size
    expected = expected_length(planted, vocab)
    print(f"planted EOS offset {planted:.3f}: mean length {expected:.0f} before the {args.new_tokens}-token budget",
          flush=True)
    gen = torch.Generator().manual_seed(7)
    distinct = [torch.randint(2, vocab, (args.prompt_len,), generator=gen) for _ in range(args.prompts)]
    distinct = [torch.where(p == eos, eos + 1, p).to(device) for p in distinct]
    prompts = [p for p in distinct for _ in range(args.group)]
    cuda = device.type == "cuda"
    rows: list[dict[str, float]] = []
    baseline_lengths: list[int] | None = None
    for fraction, min_row_steps in configurations(args):
        config = GenerationConfig(args.new_tokens, SamplingParams(temperature=1.0), seed=3, eos_token_id=eos,
                                  use_cuda_graph=cuda, compile_decode=cuda, compact_fraction=fraction,
                                  compact_min_row_steps=min_row_steps,
                                  compile_dynamic_rows=DYNAMIC_ROWS[args.dynamic_rows])
        began = time.perf_counter()
        timed_call(model, prompts, config)  # compile, autotune, first captures
        if cuda:
            torch.cuda.synchronize()
        first_call_s = time.perf_counter() - began
        outs = [timed_call(model, prompts, config) for _ in range(args.reps)]
        lengths = outs[-1].response_lengths.tolist()
        baseline_lengths = lengths if baseline_lengths is None else baseline_lengths
        decode_s = median(o.stats["decode_s"] for o in outs)
        rows.append({"fraction": fraction, "min_row_steps": row_step_bar(config), "decode_s": decode_s,
                     "capture_s": median(o.stats["capture_s"] for o in outs),
                     "compact_s": median(o.stats["compact_s"] for o in outs), "first_call_s": first_call_s,
                     "compactions": outs[-1].stats["compactions"], "mean_len": sum(lengths) / len(lengths),
                     "tokens_per_s": sum(lengths) / decode_s,
                     "same_rows": sum(a == b for a, b in zip(lengths, baseline_lengths))})
        triton_dir = os.environ.get("TRITON_CACHE_DIR")
        has_cache = triton_dir is not None and os.path.isdir(triton_dir)
        built = f", {len(os.listdir(triton_dir))} Triton kernels in its cache" if has_cache else ""
        print(f"measured fraction {fraction:g}, min row-steps {rows[-1]['min_row_steps']}: decode {decode_s:.3f} s, "
              f"first call {first_call_s:.1f} s{built}", flush=True)
    return rows


def print_table(args: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    where = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    n_rows = args.prompts * args.group
    print(f"\n{args.preset} on {where}: {n_rows} rows ({args.prompts} prompts x {args.group}), {args.prompt_len} "
          f"prompt tokens, up to {args.new_tokens} new, temperature 1, median of {args.reps}, "
          f"rows compiled dynamic: {args.dynamic_rows}")
    base = next(r for r in rows if r["fraction"] == 0.0)
    print(f"{'compact_fraction':>16} {'min row-steps':>14} {'mean len':>9} {'decode s':>9} {'capture s':>10} "
          f"{'compact s':>10} {'resp tok/s':>11} {'compactions':>12} {'speed-up':>9} {'same rows':>10} "
          f"{'first call s':>13}")
    for r in rows:
        min_row_steps = "-" if r["fraction"] == 0.0 else str(r["min_row_steps"])
        print(f"{r['fraction']:>16g} {min_row_steps:>14} {r['mean_len']:>9.1f} {r['decode_s']:>9.3f} "
              f"{r['capture_s']:>10.3f} {r['compact_s']:>10.3f} {r['tokens_per_s']:>11,.0f} {r['compactions']:>12.0f} "
              f"{base['decode_s'] / r['decode_s']:>8.2f}x {r['same_rows']:>6.0f}/{n_rows} {r['first_call_s']:>13.1f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2 if args.cpu else 1)
    rows = run(args)
    if args.compile_times:
        from torch._dynamo.utils import compile_times
        print(compile_times(repr="str", aggregate=True))
    print_table(args, rows)


if __name__ == "__main__":
    main()
