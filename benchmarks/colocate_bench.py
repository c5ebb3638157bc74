"""Generation beside training on ONE GPU (issue 27, item 3): concurrent against one after the other.

With bounded staleness 1 the generation of batch i+1 reads the policy from before training i, so
it could run on the same GPU while that training runs: decode is memory-bound, training
compute-bound. This measures whether two CUDA streams beat running them back to back.

The work is peer_bench's GRPO step, Llama-3.2-1B shape, bf16, random weights: a ModelEngine
(tp=1, AdamW) trains 512 sequences of 640 tokens in one optimizer step, 16 micro-batches of
20,480 tokens (engine_bench.py --grpo-step); a SEPARATE model (a second copy of the weights: with
staleness 1 generation reads the previous policy) generates 512 prompts of 128 tokens, 512 new
tokens, temperature 1, ignore_eos, CUDA-graph decode (generate_bench.py --grpo-step's call;
--compile-decode adds torch.compile under the graph).

Phases, each wrapped so that a failure prints the error and the table keeps what was measured:
(1) warm-up: one train step, one generate call (compiles, autotuning, cuBLAS workspaces);
(2) train alone and (3) generate alone, --reps times each, the median; (4) both at once, --reps
times: two threads, each with its own CUDA stream, released together by a threading.Barrier: the
wall time until both have finished and each thread's finishing time from that release. Serial
sum = train alone + generate alone; speedup = serial sum / concurrent wall; "wins by" speedup - 1.
Each role runs in one persistent thread on its own stream in every phase (the same code path).

CUDA graph capture. `generate` builds a new `DecodeStep` per call, which captures its graph at the
first decode step: one graph per call (the Triton decode attention reads each sequence's length;
attend_bucket is set to the whole cache so that the SDPA fallback captures only once too).
`torch.cuda.graph` captures in "global" mode, where other threads' unsafe CUDA calls (cudaMalloc,
synchronous copies, the training's host syncs) fail, and its entry synchronizes the device and
empties the allocator's cache. So training starts only after the capture: the generation thread
starts its call at the barrier, and training waits for an Event that a DecodeStep subclass sets
when `capture` returns (this process rebinds the name that `generate` looks up in
actors.generation.loop; no file of actors/ changes). The subclass refuses a capture once training
runs, so an unexpected second capture fails loudly instead of breaking the other thread. A worker
would do the same: the concurrent time includes generation's prefill and capture before training
starts (printed). As each capture empties the allocator's cache, so does each train-alone rep.

Limitation: one process, two threads. Python's GIL and kernel-launch overhead are part of what is
measured (the decode loop launches its sampling kernels from Python every step while the training
thread launches its own), as they would be in a worker. Moving the new weights to the generation
model (a reallocation once per iteration) is not included.

    python3 benchmarks/colocate_bench.py                    # one H200, about 2 minutes
    python3 benchmarks/colocate_bench.py --compile-decode --reps 3
    python3 benchmarks/colocate_bench.py --cpu --tiny       # seconds on CPU: checks the script

Run it from the project root on kind nvidia-h200 with the environment of benchmarks/run_gpu.sh
(PYTHONPATH=/tmp/site:$PWD after its wheel install). Exit status 1: a phase failed (its error is
printed; the table still comes last).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import actors.generation.loop as generation_loop
from actors.engine.model_engine import ModelEngine, SequenceBatch
from actors.engine.optimizer import AdamWConfig
from actors.engine.process_groups import ParallelGroups
from actors.generation.decode_step import DecodeStep
from actors.generation.decoding import GenerationConfig
from benchmarks.engine_bench import loss_fn, make_batch
from benchmarks.generate_bench import build_random_model, mode_config
from planning.layout import Layout
from planning.models import model_preset

WAIT_S = 300.0  # longest wait for the other thread (barrier, capture): a hung peer fails the phase


@dataclass
class CaptureGate:
    """One concurrent round's hand-off: `captured` is set once generation's graph is captured (or
    at once when there is none to capture); `training` once training has started."""

    captured: threading.Event = field(default_factory=threading.Event)
    training: bool = False


class GatedDecodeStep(DecodeStep):
    """DecodeStep that opens the round's gate after capturing its graph and refuses to capture
    once training runs (a "global" capture would make the training thread's CUDA calls fail)."""

    gate: ClassVar[CaptureGate | None] = None

    def capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        gate = GatedDecodeStep.gate
        if gate is not None and gate.training:
            raise RuntimeError("generation captured a second CUDA graph while training ran; a capture in 'global' "
                               "mode breaks the other thread's CUDA calls (more than one attention bucket?)")
        result = super().capture()
        if gate is not None:
            gate.captured.set()
        return result


@contextlib.contextmanager
def gated_decode_steps() -> Iterator[None]:
    """generate() builds its DecodeStep by the name bound in actors.generation.loop: rebind it to
    the gated subclass for this run, and put the original back after."""
    original = generation_loop.DecodeStep
    generation_loop.DecodeStep = GatedDecodeStep
    try:
        yield
    finally:
        generation_loop.DecodeStep = original


@dataclass
class Bench:
    """Both roles' models and inputs, each role's stream (None on CPU) and persistent thread."""

    device: torch.device
    engine: ModelEngine
    batch: SequenceBatch
    n_micro: int
    gen_model: torch.nn.Module
    prompts: list[torch.Tensor]
    config: GenerationConfig
    train_stream: torch.cuda.Stream | None
    gen_stream: torch.cuda.Stream | None
    train_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "train"))
    gen_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "generate"))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def train(self) -> None:
        self.engine.train_step(self.batch, loss_fn, n_micro=self.n_micro)

    def generate(self) -> None:
        generation_loop.generate(self.gen_model, self.prompts, self.config)


@dataclass
class Row:
    """One phase of the table: medians over its successful reps (None: not measured)."""

    phase: str
    wall_s: float | None = None
    train_s: float | None = None
    gen_s: float | None = None
    peak_gib: float | None = None
    train_start_s: float | None = None  # concurrent: training's wait for generation's capture
    error: str | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per phase (median)")
    parser.add_argument("--compile-decode", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--cpu", action="store_true", help="CPU, float32, no graphs or streams")
    parser.add_argument("--tiny", action="store_true", help="tiny preset and a small batch (seconds)")
    args = parser.parse_args(argv)
    args.reps = max(1, args.reps)
    args.preset = "tiny" if args.tiny else "llama3.2-1b"
    # (sequences per micro-batch, micro-batches, sequence length, prompts, prompt length, new tokens)
    shape = (2, 4, 32, 8, 8, 8) if args.tiny else (32, 16, 640, 512, 128, 512)
    args.seqs_per_mb, args.n_micro, args.seq_len, args.prompts, args.prompt_len, args.new_tokens = shape
    return args


def build(args: argparse.Namespace) -> Bench:
    """The training engine, the separate generation model, the batch, prompts and streams."""
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    spec = model_preset(args.preset)
    engine = ModelEngine(spec, False, ParallelGroups.serial(), device, dtype, seed=0,
                         optim_config=AdamWConfig(lr=1e-5))
    batch = make_batch(args.seqs_per_mb * args.seq_len, args.n_micro, spec.vocab_size, args.seq_len, args.seq_len,
                       seed=1)
    gen_model = build_random_model(spec, Layout(tp=1), None, device, dtype)
    ids = torch.randint(0, spec.vocab_size, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(7))
    prompts = list(ids.to(device).unbind(0))
    mode = "eager" if args.cpu else "graph+compile" if args.compile_decode else "graph"
    # attend_bucket = the whole cache: one graph per call whatever the decode attention kernel
    # (Triton ignores the bucket; SDPA would otherwise capture again every 128 slots, mid-call).
    config = replace(mode_config(mode, args.new_tokens, temperature=1.0),
                     attend_bucket=args.prompt_len + args.new_tokens)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else (None, None)
    return Bench(device, engine, batch, args.n_micro, gen_model, prompts, config, *streams)


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """The role's stream as the calling thread's current stream (nothing on CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def finish(stream: torch.cuda.Stream | None) -> float:
    """Wait for this role's own stream only (not the other thread's work); the time then."""
    if stream is not None:
        stream.synchronize()
    return time.perf_counter()


def alone_rep(bench: Bench, role: str) -> float:
    """Seconds of one train step or generate call by itself, in its role's thread and stream."""
    work, stream, pool = ((bench.train, bench.train_stream, bench.train_pool) if role == "train"
                          else (bench.generate, bench.gen_stream, bench.gen_pool))

    def job() -> float:
        with on_stream(stream):
            if bench.cuda:
                # Same start as beside generation: its capture empties the cache first (and a
                # generate call empties it by itself anyway).
                torch.cuda.empty_cache()
                torch.cuda.synchronize()
            start = time.perf_counter()
            work()
            return finish(stream) - start

    return pool.submit(job).result()


def generation_job(bench: Bench, gate: CaptureGate, barrier: threading.Barrier) -> float:
    """Generate from the barrier on; open the gate after the capture (or at once without graphs)."""
    with on_stream(bench.gen_stream):
        barrier.wait()
        try:
            if not (bench.cuda and bench.config.use_cuda_graph):
                gate.captured.set()
            bench.generate()
            return finish(bench.gen_stream)
        finally:
            gate.captured.set()  # also on failure: training must not wait for a capture that never comes


def training_job(bench: Bench, gate: CaptureGate, barrier: threading.Barrier) -> tuple[float, float]:
    """Train once generation's graph is captured; (start, end) times."""
    with on_stream(bench.train_stream):
        barrier.wait()
        if not gate.captured.wait(WAIT_S):
            raise TimeoutError(f"generation did not capture its CUDA graph within {WAIT_S:.0f} s")
        gate.training = True
        start = time.perf_counter()
        bench.train()
        return start, finish(bench.train_stream)


def concurrent_rep(bench: Bench) -> dict[str, float]:
    """One round of both at once: wall time and each thread's finishing time from the barrier."""
    gate = CaptureGate()
    released: list[float] = []  # t0: the barrier's action runs once, before any party goes on
    barrier = threading.Barrier(3, action=lambda: released.append(time.perf_counter()), timeout=WAIT_S)
    GatedDecodeStep.gate = gate
    try:
        if bench.cuda:
            torch.cuda.synchronize()
        gen_future = bench.gen_pool.submit(generation_job, bench, gate, barrier)
        train_future = bench.train_pool.submit(training_job, bench, gate, barrier)
        barrier.wait()
        wait([gen_future, train_future])
        if bench.cuda:
            torch.cuda.synchronize()
        t0 = released[0]
        wall = time.perf_counter() - t0
        gen_end = gen_future.result()  # raises the thread's error, if any
        train_start, train_end = train_future.result()
    finally:
        GatedDecodeStep.gate = None
        barrier.abort()  # a thread that failed before the barrier must not leave the other waiting
    return {"wall": wall, "train": train_end - t0, "gen": gen_end - t0, "train_start": train_start - t0}


def attempt(what: str, fn: Callable[[], object], failures: list[str]) -> str | None:
    """Run `fn`; on an exception print it, note the failure and return its one line for the table."""
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001 (the table must still show what was measured)
        traceback.print_exc()
        failures.append(what)
        print(f"{what} failed: {type(exc).__name__}: {exc}", flush=True)
        return f"{type(exc).__name__}: {exc}"


def reset_peak(bench: Bench) -> None:
    if bench.cuda:  # a phase's peak: from its first rep to its last
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(name: str, bench: Bench, rep: Callable[[], dict[str, float]], reps: int, failures: list[str]) -> Row:
    """Run `rep` up to `reps` times (stopping at the first failure); medians and the phase's peak."""
    row, samples = Row(name), []
    row.error = attempt(f"{name} (set-up)", lambda: reset_peak(bench), failures)
    for i in range(reps if row.error is None else 0):
        row.error = attempt(f"{name} rep {i + 1}", lambda: samples.append(rep()), failures)
        if row.error is not None:
            break
        print(f"measured {name} rep {i + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in samples[-1].items()),
              flush=True)
    if bench.cuda:
        with contextlib.suppress(Exception):  # after a CUDA error the statistics may be unreadable
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    if samples:
        median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        row.wall_s, row.train_s, row.gen_s = median.get("wall"), median.get("train"), median.get("gen")
        row.train_start_s = median.get("train_start")
    return row


def run_phases(bench: Bench, reps: int, failures: list[str]) -> list[Row]:
    """Warm-up, train alone, generate alone, both at once."""
    def train_alone() -> dict[str, float]:
        seconds = alone_rep(bench, "train")
        return {"wall": seconds, "train": seconds}

    def generate_alone() -> dict[str, float]:
        seconds = alone_rep(bench, "generate")
        return {"wall": seconds, "gen": seconds}

    def warm_up() -> dict[str, float]:
        return {"train": alone_rep(bench, "train"), "gen": alone_rep(bench, "generate")}

    measure("warm-up", bench, warm_up, 1, failures)  # compile and capture times: not in the table
    return [measure("train alone", bench, train_alone, reps, failures),
            measure("generate alone", bench, generate_alone, reps, failures),
            measure("concurrent", bench, lambda: concurrent_rep(bench), reps, failures)]


def device_name() -> str:
    try:
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 (after a CUDA error the table must still print)
        return "cuda"


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(args: argparse.Namespace, rows: list[Row]) -> None:
    """The table (last), then the verdict line."""
    by_name = {r.phase: r for r in rows}
    train, gen, both = (by_name.get(n, Row(n)) for n in ("train alone", "generate alone", "concurrent"))
    serial = train.wall_s + gen.wall_s if train.wall_s is not None and gen.wall_s is not None else None
    speedup = serial / both.wall_s if serial is not None and both.wall_s else None
    where = "cpu fp32" if args.cpu else f"{device_name()} bf16"
    print(f"\ncolocated training and generation, {args.preset} on {where}, median of {args.reps}: train "
          f"{args.seqs_per_mb * args.n_micro} x {args.seq_len} tokens in {args.n_micro} micro-batches; generate "
          f"{args.prompts} x {args.prompt_len} prompt tokens + {args.new_tokens} new, temperature 1, "
          f"{'eager' if args.cpu else 'CUDA graph' + (' + compile' if args.compile_decode else '')}")
    print(f"{'phase':<16} {'wall s':>8} {'train s':>8} {'generate s':>10} {'serial sum':>10} {'speedup':>8} "
          f"{'peak GiB':>8}")
    for r in (train, gen, both):
        is_both = r is both
        print(f"{r.phase:<16} {fmt(r.wall_s):>8} {fmt(r.train_s):>8} {fmt(r.gen_s):>10} "
              f"{fmt(serial if is_both else None):>10} {fmt(speedup if is_both else None, '.2f'):>8} "
              f"{fmt(r.peak_gib, '.1f'):>8}" + (f"  FAILED {r.error}" if r.error else ""))
    if both.train_start_s is not None and not args.cpu:
        print(f"concurrent: training started {both.train_start_s:.3f} s after generation (its prefill and graph "
              "capture come first)")
    if speedup is None:
        print("verdict: unknown (a phase was not measured; see the errors above)")
    elif speedup > 1.0:
        noise = " (under 2%: within run-to-run noise)" if speedup < 1.02 else ""
        print(f"verdict: concurrent wins by {speedup - 1:.1%} ({serial:.3f} s serial -> {both.wall_s:.3f} s){noise}")
    else:
        print(f"verdict: concurrent does not win (it takes {both.wall_s / serial - 1:.1%} longer: {serial:.3f} s "
              f"serial -> {both.wall_s:.3f} s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        torch.set_num_threads(1)  # one core per role's thread on a small machine
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu --tiny", file=sys.stderr)
        return 2
    failures: list[str] = []
    built: list[Bench] = []
    error = attempt("build", lambda: built.append(build(args)), failures)
    rows = [Row(n, error=f"build: {error}") for n in ("train alone", "generate alone", "concurrent")]
    if built:
        with gated_decode_steps():
            rows = run_phases(built[0], args.reps, failures)
    print_table(args, rows)
    for bench in built:  # after the table: a thread stuck on the device must not hold it back
        bench.train_pool.shutdown(wait=False)
        bench.gen_pool.shutdown(wait=False)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
