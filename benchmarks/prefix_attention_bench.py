"""Decode attention over shared prompts as the peer bench's generation runs it: three ways to read
a group's prompt, and the kernels' launch configs, across the lengths of one call.

    python benchmarks/prefix_attention_bench.py              # one H200, bf16 (seconds)
    python benchmarks/prefix_attention_bench.py --sweep      # and 27 fixed launch configs (minutes)
    python benchmarks/prefix_attention_bench.py --cpu --tiny # seconds, in Triton's interpreter

Shape: 512 rows = 64 prompts x 8 rows, 8 KV heads x group 4, head_dim 64, 128 prompt slots, a
cache of 640 slots; lengths 128 + 16 .. 639 (the decode's steps, sampled at LENGTHS). Ways:
  own      every row reads its own copy of the prompt (no sharing: HBM traffic x 8 for it)
  shared   rows read the prompt slots from the group's first row (`prefix_rows`), each program
           streaming them again (L2 may serve the repeats)
  cascade  actors.kernels.prefix_attention: one program per (group, KV head) attends the group's
           32 query rows to the prompt once, then the decode kernel reads only the row's own slots
Configs: "tuned@first" autotunes on the first call (at the first of LENGTHS; a generation call
tunes at its first step, at the prompt's length) and keeps that choice; "tuned@L" re-tunes at
every length; "(n,w,s)" is a fixed BLOCK_N, num_warps, num_stages (--sweep). Each time is one
call inside a CUDA graph of --reps calls that rotate over cache copies (>= 256 MB, beyond an
H200's L2), averaged over the lengths; "s/call (16x511)" is that times 16 layers x 511 steps,
the attention's part of a generation call.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_attention_bench import H200_BANDWIDTH, ROTATE_BYTES, time_calls  # noqa: E402

LENGTHS = [144, 272, 400, 528, 624]
FIXED = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))  # BLOCK_N, num_warps, num_stages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="Triton's interpreter on CPU (float32)")
    parser.add_argument("--tiny", action="store_true", help="8 rows of 2 groups, short lengths, 1 rep")
    parser.add_argument("--sweep", action="store_true", help="also every fixed config of FIXED (about 2 minutes)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps = 1
    return args


def make_inputs(args: argparse.Namespace, device: torch.device) -> dict:
    """Cache copies, queries, lengths and the group tables of the shape in the module docstring."""
    n_seqs, group_rows, n_kv, group, dim, prompt, capacity = (
        (8, 4, 2, 2, 16, 16, 48) if args.tiny else (512, 8, 8, 4, 64, 128, 640))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kv_bytes = 2 * n_seqs * n_kv * capacity * dim * dtype.itemsize
    copies = 1 if args.tiny else max(1, math.ceil(ROTATE_BYTES / kv_bytes))
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    sets = []
    for _ in range(copies):
        k, v = rand(n_seqs, n_kv, capacity, dim), rand(n_seqs, n_kv, capacity, dim)
        for t in (k, v):  # the prefill's copies: a group's rows hold equal prompt K/V
            t[:, :, :prompt] = t[::group_rows, :, :prompt].repeat_interleave(group_rows, dim=0)
        sets.append((rand(n_seqs, n_kv * group, dim), rand(n_seqs, n_kv, dim), rand(n_seqs, n_kv, dim), k, v))
    rows = torch.arange(n_seqs, device=device)
    return {"sets": sets, "prompt": prompt, "capacity": capacity, "kv_heads": n_kv,
            "own": (rows, torch.zeros_like(rows)),
            "shared": (rows - rows % group_rows, torch.full_like(rows, prompt)),
            "groups": rows.view(-1, group_rows), "lengths": [20, 40] if args.tiny else LENGTHS}


def attention_call(inputs: dict, way: str, lengths: torch.Tensor, config: tuple[int, int, int] | None,
                   cpu: bool):
    """call(i) running one decode attention of `way` on cache copy i (mod copies)."""
    from actors.kernels.decode_attention import gqa_decode_attention
    from actors.kernels.prefix_attention import prefix_partials

    sets = inputs["sets"]
    prefix_rows, prefix_lengths = inputs["own" if way == "own" else "shared"]
    block_n = 16 if cpu else (config[0] if config else None)
    launch = {"num_warps": config[1], "num_stages": config[2]} if config and not cpu else None

    def call(i: int) -> torch.Tensor:
        q, k_new, v_new, k_cache, v_cache = sets[i % len(sets)]
        partial = None
        if way == "cascade":
            partial = prefix_partials(q, k_cache, v_cache, inputs["groups"], prefix_lengths, block_n=block_n or 64)
        return gqa_decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, block_n=block_n, splits=1,
                                    prefix_rows=prefix_rows, prefix_lengths=prefix_lengths, prefix_partial=partial,
                                    launch=launch)

    return call


def mean_us(inputs: dict, way: str, config: tuple[int, int, int] | None, retune: bool, args: argparse.Namespace,
            device: torch.device) -> tuple[float, float]:
    """Mean microseconds per call over the lengths, and the largest error against the reference."""
    from actors.kernels import decode_attention as kernels

    n_seqs = inputs["sets"][0][0].shape[0]
    total, worst = 0.0, 0.0
    for step, length in enumerate(inputs["lengths"]):
        lengths = torch.full((n_seqs,), length, dtype=torch.int64, device=device)
        if config is None and retune and not args.cpu:
            clear_tuning()
        call = attention_call(inputs, way, lengths, config, args.cpu)
        if step == 0:
            q, k_new, v_new, k_cache, v_cache = inputs["sets"][0]
            prefix_rows, prefix_lengths = inputs["shared"]
            ref = kernels.gqa_decode_attention_reference(q, k_new, v_new, k_cache.clone(), v_cache.clone(), lengths,
                                                         None, prefix_rows, prefix_lengths).float()
            worst = (call(0).float() - ref).abs().max().item()
        else:
            call(0)  # compile / autotune outside the timing
        total += time_calls(call, args.reps, device, eager=args.cpu) * 1e6
    return total / len(inputs["lengths"]), worst


def clear_tuning() -> None:
    """Forget the decode kernels' autotuning, so that the next call tunes again."""
    from actors.kernels import decode_attention as kernels

    kernels._gqa_decode_tuned.cache.clear()
    kernels._gqa_decode_after_prefix_tuned.cache.clear()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu --tiny", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    inputs = make_inputs(args, device)
    runs: list[tuple[str, str, tuple[int, int, int] | None, bool]] = []
    for way in ("own", "shared", "cascade"):
        runs += [(way, "tuned@first", None, False)] + ([] if args.cpu else [(way, "tuned@L", None, True)])
        runs += [(way, str(c), c, False) for c in (FIXED if args.sweep and not args.cpu else [])]
    results = []
    for way, name, config, retune in runs:
        if config is None and not args.cpu:
            clear_tuning()  # "tuned@first": tuned at the first length only
        us, err = mean_us(inputs, way, config, retune, args, device)
        results.append((way, name, us, err))
        print(f"measured {way} {name}: {us:.1f} us/call", flush=True)
    print_table(results, inputs, args)
    return 0


def print_table(results: list[tuple[str, str, float, float]], inputs: dict, args: argparse.Namespace) -> None:
    where = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    q, _, _, k, _ = inputs["sets"][0]
    own_bytes = sum(2 * k.shape[0] * k.shape[1] * (n - inputs["prompt"]) * k.shape[3] * k.element_size()
                    for n in inputs["lengths"]) / len(inputs["lengths"])
    floor_us = own_bytes / H200_BANDWIDTH * 1e6
    print(f"\nshared-prompt decode attention on {where}, {q.shape[0]} rows, lengths {inputs['lengths']}: "
          f"own slots alone at {H200_BANDWIDTH:.1e} B/s = {floor_us:.1f} us/call")
    print(f"{'way':<8} {'config':<14} {'us/call':>9} {'x floor':>8} {'s/call (16x511)':>16} {'max err':>9}")
    best: dict[str, tuple[str, float]] = {}
    for way, name, us, err in results:
        print(f"{way:<8} {name:<14} {us:>9.1f} {us / floor_us:>8.2f} {us * 16 * 511 / 1e6:>16.3f} {err:>9.2e}")
        if way not in best or us < best[way][1]:
            best[way] = (name, us)
    print("best: " + "; ".join(f"{w} {n} {u:.1f} us" for w, (n, u) in best.items()))


if __name__ == "__main__":
    sys.exit(main())
