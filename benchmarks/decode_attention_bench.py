"""Decode attention kernel (actors.kernels.decode_attention) against the HBM roofline, for every split count.

    python benchmarks/decode_attention_bench.py                 # one H200, bf16, the cases below (< 60 s)
    python benchmarks/decode_attention_bench.py --eager         # time eager launches, not graph replays
    python benchmarks/decode_attention_bench.py --cpu --tiny    # seconds on CPU, in Triton's interpreter
    python benchmarks/decode_attention_bench.py --cache-dtype fp8 --sweep   # an e4m3 cache; launch configs

Cases (n_seqs, n_kv, group, head_dim, length): every sequence holds `length` cached tokens (the
cache has length + 1 slots: the kernel writes the step's K/V at slot `length`). For each case it
runs splits 1, 2, 4, 8, 16 and auto (splits=None: `decode_splits` of the shape and this GPU's
multiprocessor count), checks each output against the torch reference, and times one call: a
warm-up call first (autotuning happens there), then `--reps` calls captured in one CUDA graph
and replayed (decode runs as graph replays; eager launch gaps would swamp short kernels), timed
with CUDA events. Autotuning keys on (group, head_dim, slots class: the bit length of the slots one
program reads), so every split count of a case is tuned for its own chunk length (until
2026-12-03 the key left the class out, and each kernel kept the config of its first call). Small
caches are rotated among several copies so the L2 (60 MB on an H200) cannot serve them. GB/s counts the K/V bytes read, 2 * n_seqs * n_kv * length * head_dim *
itemsize, over the time per call; "of peak" divides that by --bandwidth (4.3e12 B/s measured on an
H200). --cpu --tiny: tiny float32 cases, blocks of 16 slots, one timed call each.

--cache-dtype fp8: the cache in e4m3 (`sampling.kv_cache_dtype: fp8`), queries and new K/V in
bf16 (float32 on CPU); the bytes read are then one per value. The fifteenth step of issue 27
measured the whole decode no faster with it (the kernel read its half-size cache at ~60% of HBM
where bf16 reaches ~95%): the kernel's autotuned configs were chosen for bf16. --sweep then
times every launch config of SWEEP_CONFIGS (BLOCK_N, num_warps, num_stages) unsplit on the
peer bench's cases, beside the autotuned choice, so one call shows which configs an e4m3 (or
bf16) cache wants.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Run as a script from a checkout: make the repository's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H200_BANDWIDTH = 4.3e12
CASES = [(512, 8, 4, 64, 128), (512, 8, 4, 64, 384), (512, 8, 4, 64, 640), (64, 8, 4, 64, 2048),
         (16, 8, 4, 64, 4096), (8, 2, 7, 64, 8192), (4, 8, 4, 128, 16384)]
TINY_CASES = [(2, 1, 2, 16, 40), (1, 1, 4, 16, 70)]
SPLITS: list[int | None] = [1, 2, 4, 8, 16, None]  # None: the automatic choice
ROTATE_BYTES = 256e6  # each timed call reads a cache copy that is not in L2 (4x an H200's 60 MB)
PEER_CASES = CASES[:3]  # the peer bench's decode: 512 rows at 128, 384 and 640 cached tokens
SWEEP_CONFIGS = [(n, w, st) for n in (64, 128, 256) for w in (2, 4, 8) for st in (2, 3)]
TINY_SWEEP_CONFIGS = [(16, 2, 2), (32, 4, 2)]


@dataclass(frozen=True)
class Row:
    """One (case, splits) measurement."""

    case: tuple[int, int, int, int, int]
    splits: int | None
    us: float
    gb_s: float
    peak_frac: float
    auto: int
    max_err: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="calls per timing (one graph replay)")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s")
    parser.add_argument("--eager", action="store_true", help="time eager launches instead of a CUDA graph")
    parser.add_argument("--cpu", action="store_true", help="run on CPU in Triton's interpreter (float32)")
    parser.add_argument("--tiny", action="store_true", help="tiny cases, 1 rep (with --cpu: seconds)")
    parser.add_argument("--cache-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="the KV cache's dtype (fp8: e4m3; queries stay bf16, float32 on CPU)")
    parser.add_argument("--sweep", action="store_true",
                        help="time each launch config of SWEEP_CONFIGS, unsplit, on the peer bench's cases")
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps = 1
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: must be >= 1")
    return args


def make_case(case: tuple[int, int, int, int, int], copies: int, device: torch.device, dtype: torch.dtype,
              cache_dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """`copies` input sets (q, k_new, v_new, k_cache, v_cache) of random data, and the lengths;
    the caches in `cache_dtype`, rounded from random `dtype` values."""
    n_seqs, n_kv, group, head_dim, length = case
    gen = torch.Generator(device=device).manual_seed(sum(case))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def new_kv() -> torch.Tensor:  # on the cache's grid: the kernel's rounding and torch's cannot differ
        return rand(n_seqs, n_kv, head_dim).to(cache_dtype).to(dtype)

    sets = [(rand(n_seqs, n_kv * group, head_dim), new_kv(), new_kv(),
             rand(n_seqs, n_kv, length + 1, head_dim).to(cache_dtype),
             rand(n_seqs, n_kv, length + 1, head_dim).to(cache_dtype))
            for _ in range(copies)]
    return sets, torch.full((n_seqs,), length, dtype=torch.int64, device=device)


def time_calls(call: Callable[[int], torch.Tensor], reps: int, device: torch.device, eager: bool) -> float:
    """Seconds per call of call(i) for i < reps; the caller has made one call (compiled, autotuned)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for i in range(reps):
            call(i)
        return (time.perf_counter() - start) / reps
    torch.cuda.synchronize(device)
    graph = None
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                call(i)
        graph.replay()  # first replay outside the timing
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    if graph is not None:
        graph.replay()
    else:
        for i in range(reps):
            call(i)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / reps


@dataclass(frozen=True)
class CaseInputs:
    """One case's input copies (rotated so L2 cannot serve them), the reference output of the
    first copy and the K/V bytes one call reads."""

    sets: list[tuple[torch.Tensor, ...]]
    lengths: torch.Tensor
    ref: torch.Tensor
    kv_bytes: int


def case_inputs(case: tuple[int, int, int, int, int], args: argparse.Namespace, device: torch.device) -> CaseInputs:
    from actors.kernels.decode_attention import gqa_decode_attention_reference

    n_seqs, n_kv, _, head_dim, length = case
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if args.cache_dtype == "fp8" else dtype
    kv_bytes = 2 * n_seqs * n_kv * length * head_dim * cache_dtype.itemsize
    copies = 1 if args.tiny else min(8, math.ceil(ROTATE_BYTES / kv_bytes))
    sets, lengths = make_case(case, copies, device, dtype, cache_dtype)
    q, k_new, v_new, k_cache, v_cache = sets[0]
    ref = gqa_decode_attention_reference(q, k_new, v_new, k_cache.clone(), v_cache.clone(), lengths).float()
    return CaseInputs(sets, lengths, ref, kv_bytes)


def measure_case(case: tuple[int, int, int, int, int], args: argparse.Namespace, device: torch.device) -> list[Row]:
    """Every split count of one case: error against the reference, then the time per call."""
    from actors.kernels.decode_attention import gqa_decode_attention
    from actors.kernels.decode_launch import decode_splits

    n_seqs, n_kv, _, _, length = case
    inputs = case_inputs(case, args, device)
    if device.type == "cuda":
        auto = decode_splits(n_seqs, n_kv, length + 1, torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        auto = 1  # off CUDA (and with block_n given) splits=None is the unsplit kernel
    block_n = 16 if device.type == "cpu" else None
    rows = []
    for splits in SPLITS:
        def call(i: int, splits: int | None = splits) -> torch.Tensor:
            return gqa_decode_attention(*inputs.sets[i % len(inputs.sets)], inputs.lengths, block_n=block_n,
                                        splits=splits)

        err = (call(0).float() - inputs.ref).abs().max().item()  # also the warm-up: compiles and autotunes
        seconds = time_calls(call, args.reps, device, args.eager)
        rows.append(Row(case, splits, seconds * 1e6, inputs.kv_bytes / seconds / 1e9,
                        inputs.kv_bytes / seconds / args.bandwidth, auto, err))
    return rows


def sweep_case(case: tuple[int, int, int, int, int], args: argparse.Namespace,
               device: torch.device) -> list[tuple[str, float, float, float]]:
    """(config, us per call, fraction of --bandwidth, max error) of each launch config, unsplit,
    then the autotuned kernel's ("tuned"; on CPU the interpreter's default block)."""
    from triton.runtime.errors import OutOfResources

    from actors.kernels.decode_attention import gqa_decode_attention

    inputs = case_inputs(case, args, device)
    configs = TINY_SWEEP_CONFIGS if args.tiny else SWEEP_CONFIGS
    choices: list[tuple[str, int | None, dict[str, int] | None]] = [
        (f"{n}/{w}/{st}", n, {"num_warps": w, "num_stages": st}) for n, w, st in configs]
    choices.append(("tuned", 16 if device.type == "cpu" else None, None))
    out = []
    for name, block_n, launch in choices:
        def call(i: int, block_n: int | None = block_n, launch: dict[str, int] | None = launch) -> torch.Tensor:
            return gqa_decode_attention(*inputs.sets[i % len(inputs.sets)], inputs.lengths, block_n=block_n,
                                        splits=1, launch=launch)

        try:
            err = (call(0).float() - inputs.ref).abs().max().item()
        except OutOfResources:  # e.g. 256 slots x 3 stages of bf16 K and V: more shared memory than an SM has
            out.append((name, math.nan, math.nan, 0.0))
            continue
        seconds = time_calls(call, args.reps, device, args.eager)
        out.append((name, seconds * 1e6, inputs.kv_bytes / seconds / args.bandwidth, err))
    return out


def print_sweep(results: dict[tuple[int, int, int, int, int], list[tuple[str, float, float, float]]],
                args: argparse.Namespace) -> None:
    print(f"\nlaunch configs (BLOCK_N/num_warps/num_stages), unsplit, {cache_label(args)} cache: us/call (of peak)")
    names = [name for name, *_ in next(iter(results.values()))]
    print(f"{'config':<12}" + "".join(f"{str(case):>30}" for case in results))
    for i, name in enumerate(names):
        cells = [("no room" if math.isnan(results[case][i][1]) else
                  f"{results[case][i][1]:.1f} ({results[case][i][2]:.1%})") for case in results]
        print(f"{name:<12}" + "".join(f"{cell:>30}" for cell in cells))
    worst_err = max(err for rows in results.values() for *_, err in rows)
    print(f"max err over all configs: {worst_err:.2e}")


def cache_label(args: argparse.Namespace) -> str:
    """The cache's dtype as the bench runs it (bf16 is float32 on CPU)."""
    return "e4m3" if args.cache_dtype == "fp8" else ("float32" if args.cpu else "bf16")


def print_table(rows: list[Row], where: str, args: argparse.Namespace) -> None:
    how = "eager launches" if args.eager or args.cpu else "CUDA graph replays"
    print(f"\ndecode attention on {where}, {cache_label(args)} cache: {args.reps} calls per timing ({how}), "
          f"peak {args.bandwidth:.2e} B/s")
    print(f"{'case (seqs,kv,group,dim,len)':<30} {'splits':>6} {'us/call':>10} {'GB/s':>8} {'of peak':>8} "
          f"{'auto':>5} {'max err':>9}")
    for r in rows:
        name = "auto" if r.splits is None else str(r.splits)
        print(f"{r.case!s:<30} {name:>6} {r.us:>10.1f} {r.gb_s:>8.0f} {r.peak_frac:>8.1%} {r.auto:>5} "
              f"{r.max_err:>9.2e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        # The kernels run on CPU only in the interpreter, which must be on before triton is imported.
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu --tiny", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.sweep:
        cases = TINY_CASES if args.tiny else PEER_CASES
        print_sweep({case: sweep_case(case, args, device) for case in cases}, args)
        return 0
    cases = TINY_CASES if args.tiny else CASES
    rows = []
    for case in cases:
        rows.extend(measure_case(case, args, device))
        if device.type == "cuda":  # progress, in case a later case runs past a time limit
            print(f"measured {case}", flush=True)
    print_table(rows, "cpu" if args.cpu else torch.cuda.get_device_name(device), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
