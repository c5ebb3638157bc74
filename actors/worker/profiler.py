"""Microbenchmarks of this machine (the fit of the cost model's efficiencies: actors.worker.profile_fit).

`python -m app profile` (app.cli.profile) drives this module and writes the JSON:

    settings = ProfileSettings.choose("cuda", cut_model(model_preset("llama3.2-1b"), 2), quick=False)
    timing = measure_engine(settings)                 # engine fwd+bwd, optimizer, decode seconds
    hardware = measure_hardware(settings, ranks=2)    # HardwareSpec fields + raw numbers
    eff = fit_efficiency(replace(preset, **hardware.fields), settings, timing)   # actors.worker.profile_fit

Each measurement is small and bounded (sized for about a minute on one H200; seconds on CPU with `quick`):
* bf16 (fp32 on CPU) matmul FLOP/s at a large square size -> `peak_flops`, and at an LLM shape
  [tokens x hidden] x [hidden x 4 hidden] (reported beside it);
* a device-to-device copy -> `hbm_bw` (read + write bytes per second);
* with >= 2 ranks (spawned local processes, NCCL on GPU, gloo on CPU): broadcast bandwidth ->
  `intra_node_bw`, a 4-byte all-reduce -> `collective_latency_s`, and the engine's
  forward+backward with tp = ranks -> efficiency `comm` (the share of the link rate the tp
  all-reduces reach inside real steps; actors.worker.profile_fit);
* a forward+backward and an optimizer step of the engine on a cut-down model, and the decode
  steps of `actors.generation.decoding.generate`, each compared with the cost model's prediction for the
  same shapes (planning.cost) -> efficiencies `gemm`, `optimizer` and `decode`: the factor in
  (0, 1] that makes the prediction on the measured peaks equal the measurement.

The JSON (app.cli.profile) holds the measured HardwareSpec fields at top level (what
`HardwareSpec.with_profile` reads), the factors under "efficiency" (`OpEfficiency.from_dict`),
and a "measurements" block: raw numbers, predicted vs measured seconds, machine and date.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planning.models import ModelSpec

MiB = 1024**2
# Efficiencies are solved in [MIN_EFFICIENCY, 1]: OpEfficiency needs (0, 1].
MIN_EFFICIENCY = 1e-3
# Share of the device's total memory the planner may count on (the presets keep the same headroom).
USABLE_MEMORY = 0.95


@dataclass(frozen=True)
class ProfileSettings:
    """Sizes of every microbenchmark (see `choose` for the values per device and mode).

    model: the engine/decode model (a preset cut to a few layers). decode_steps: the two response
    lengths whose generate times are differenced to get the time of one decode step.
    """

    device: str
    model: ModelSpec
    quick: bool
    matmul_size: int
    gemm_tokens: int
    copy_bytes: int
    comm_bytes: int
    train_seqs: int
    train_seq_len: int
    decode_batch: int
    decode_prompt_len: int
    decode_steps: tuple[int, int]
    warmup: int
    reps: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @staticmethod
    def choose(device: str, model: ModelSpec, quick: bool) -> ProfileSettings:
        """Sizes for `device` ("cuda" or "cpu"); `quick` shrinks everything to seconds."""
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device={device!r}: allowed: cuda, cpu")
        # matmul, gemm tokens, copy MiB, comm MiB, train seqs x len, decode batch, prompt, steps, warmup, reps
        # Decode on GPU: prompt 128 and up to 128 new tokens keep every step in one attention bucket (256).
        table: dict[tuple[str, bool], tuple[Any, ...]] = {
            ("cuda", False): (8192, 8192, 1024, 256, 8, 1024, 16, 128, (16, 128), 2, 5),
            ("cuda", True): (4096, 2048, 256, 64, 2, 512, 8, 128, (16, 64), 1, 3),
            ("cpu", False): (1024, 512, 256, 16, 4, 128, 4, 16, (4, 24), 1, 3),
            ("cpu", True): (256, 128, 16, 1, 2, 32, 2, 8, (2, 8), 1, 3),
        }
        mm, tokens, copy_mib, comm_mib, seqs, seq_len, batch, prompt, steps, warmup, reps = table[(device, quick)]
        return ProfileSettings(device, model, quick, mm, tokens, copy_mib * MiB, comm_mib * MiB, seqs, seq_len,
                               batch, prompt, steps, warmup, reps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of `fn` over `reps` runs after `warmup` runs, the device synchronised
    around each run (the median resists the noise of a shared machine)."""
    return statistics.median(_run_times(fn, device, warmup, reps))


def best_seconds(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Shortest wall time of `fn` over `reps` runs: a peak rate is what the device reaches
    when nothing else gets in the way, so the fastest run estimates it best."""
    return min(_run_times(fn, device, warmup, reps))


def _run_times(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


# ---- single-device microbenchmarks ----------------------------------------------------------------


def matmul_flops(m: int, k: int, n: int, settings: ProfileSettings) -> float:
    """FLOP/s of [m, k] @ [k, n] in the settings' dtype (2*m*k*n FLOPs per product)."""
    device = torch.device(settings.device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=settings.dtype, generator=gen)
    b = torch.randn(k, n, device=device, dtype=settings.dtype, generator=gen)
    seconds = best_seconds(lambda: torch.matmul(a, b), device, settings.warmup + 1, 3 * settings.reps)
    return 2.0 * m * k * n / seconds


def copy_bandwidth(settings: ProfileSettings) -> float:
    """Device memory bytes/s of a large copy: each copy reads and writes `copy_bytes`."""
    device = torch.device(settings.device)
    src = torch.ones(settings.copy_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), device, settings.warmup + 1, 3 * settings.reps)
    return 2.0 * settings.copy_bytes / seconds


# ---- collectives over local processes -------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveTiming:
    """Median seconds (of the slowest rank) of one all-reduce and one broadcast of `nbytes`
    (float32) over `ranks` processes, of a 4-byte all-reduce (the fixed cost of a collective),
    and of the engine's forward+backward under tensor parallelism over the ranks."""

    ranks: int
    backend: str
    nbytes: int
    allreduce_s: float
    broadcast_s: float
    small_allreduce_s: float
    # The engine's forward+backward of the settings' train batch with tp = ranks (slowest rank):
    # what the tp all-reduces cost inside real steps, which the fit of `comm` uses.
    tp_fwd_bwd_s: float = float("nan")

    @property
    def broadcast_bw(self) -> float:
        """Bytes/s of a broadcast once its fixed cost is paid (the link rate the cost model uses)."""
        return self.nbytes / max(self.broadcast_s - self.small_allreduce_s, 1e-9)

    @property
    def allreduce_bw(self) -> float:
        """The `bw` of the cost model's ring formula t = lat + 2(n-1)/n * bytes / bw."""
        ring = 2.0 * (self.ranks - 1) / self.ranks
        return ring * self.nbytes / max(self.allreduce_s - self.small_allreduce_s, 1e-9)


def measure_collectives(settings: ProfileSettings, ranks: int) -> CollectiveTiming:
    """Spawn `ranks` local processes (one GPU each with NCCL, or gloo on CPU) and time collectives."""
    import torch.multiprocessing as mp

    from actors.engine import free_port

    if ranks < 2:
        raise ValueError(f"ranks={ranks}: collectives need at least 2")
    backend = "nccl" if settings.device == "cuda" else "gloo"
    if backend == "nccl":
        # NVLink multicast (NVLS) is off on the lent hosts; the benchmarks run without it too.
        for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
            os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="realray-profile-") as scratch:
        result = Path(scratch, "collectives.json")
        mp.spawn(collective_rank, args=(ranks, free_port(), backend, settings, str(result)), nprocs=ranks, join=True)
        return CollectiveTiming(**json.loads(result.read_text()))


def collective_rank(rank: int, ranks: int, port: int, backend: str, settings: ProfileSettings, result: str) -> None:
    """One spawned rank: join the world, time the collectives, rank 0 writes them to `result`."""
    from actors.engine import init_local_world

    init_local_world(rank, ranks, port, backend)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        timings = _collective_seconds(settings, device)  # its buffers are freed before the engine's
        timings.append(tp_fwd_bwd_seconds(settings, device, ranks))
        seconds = torch.tensor(timings, dtype=torch.float64, device=device)
        # The slowest rank's time: a broadcast's root can finish before its receivers do.
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if rank == 0:
            allreduce_s, broadcast_s, small_s, tp_s = seconds.tolist()
            Path(result).write_text(json.dumps({
                "ranks": ranks, "backend": backend, "nbytes": settings.comm_bytes // 4 * 4, "allreduce_s": allreduce_s,
                "broadcast_s": broadcast_s, "small_allreduce_s": small_s, "tp_fwd_bwd_s": tp_s}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the engine and generation --------------------------------------------------------------------


@dataclass(frozen=True)
class EngineTiming:
    """Median seconds of the engine's forward+backward and optimizer step on the settings'
    train batch, and of `generate` with the two decode lengths (their difference over the
    extra steps is one decode step)."""

    fwd_bwd_s: float
    optimizer_s: float
    decode_short_s: float
    decode_long_s: float

    def decode_step_s(self, steps: tuple[int, int]) -> float:
        return (self.decode_long_s - self.decode_short_s) / (steps[1] - steps[0])


def _engine_and_fwd_bwd(settings: ProfileSettings, device: torch.device, groups: Any) -> tuple[Any, Callable[[], None]]:
    """An engine of the settings' model over `groups` and a forward+backward of the settings'
    train batch (one micro-batch, SFT loss on every token) on it."""
    from actors.engine import AdamWConfig, ModelEngine, SequenceBatch
    from actors.rl import LossSums, sft_loss

    spec = settings.model
    engine = ModelEngine(spec, False, groups, device, settings.dtype, seed=0, optim_config=AdamWConfig(lr=1e-6))
    gen = torch.Generator().manual_seed(0)
    n_tokens = settings.train_seqs * settings.train_seq_len
    batch = SequenceBatch(torch.randint(0, spec.vocab_size, (n_tokens,), generator=gen),
                          (settings.train_seq_len,) * settings.train_seqs, token_data={"mask": torch.ones(n_tokens)})

    def loss_fn(logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
        return sft_loss(logprobs, data["mask"])

    def fwd_bwd() -> None:
        engine.optimizer.zero_grad()
        engine.backward_step(batch, loss_fn)

    return engine, fwd_bwd


def _collective_seconds(settings: ProfileSettings, device: torch.device) -> list[float]:
    """Median seconds of an all-reduce and a broadcast of `comm_bytes`, and of a 4-byte all-reduce."""
    big = torch.ones(settings.comm_bytes // 4, device=device, dtype=torch.float32)
    small = torch.ones(1, device=device, dtype=torch.float32)

    def timed(fn: Callable[[], object], reps: int) -> float:
        dist.barrier()  # every rank starts the loop together, so rank 0 does not time a wait
        return median_seconds(fn, device, settings.warmup + 1, reps)

    return [
        timed(lambda: dist.all_reduce(big), settings.reps),
        timed(lambda: dist.broadcast(big, src=0), settings.reps),
        timed(lambda: dist.all_reduce(small), 10 * settings.reps),
    ]


def tp_fwd_bwd_seconds(settings: ProfileSettings, device: torch.device, ranks: int) -> float:
    """Median seconds of the forward+backward with tp = every rank of the world (collective);
    NaN when the model cannot be split `ranks` ways (then `tp_comm` is not fitted)."""
    from actors.engine import build_parallel_groups
    from planning.layout import Layout
    from planning.models import validate_tp

    try:
        validate_tp(settings.model, ranks)
    except ValueError:
        return float("nan")  # same answer on every rank: none of them runs the collective step
    groups = build_parallel_groups(Layout(tp=ranks))
    engine, fwd_bwd = _engine_and_fwd_bwd(settings, device, groups)
    dist.barrier()
    seconds = median_seconds(fwd_bwd, device, settings.warmup, settings.reps)
    del engine
    return seconds


def measure_engine(settings: ProfileSettings) -> EngineTiming:
    """Time a train step (split into forward+backward and optimizer) and generation of the model."""
    from actors.engine import ParallelGroups

    device = torch.device(settings.device)
    engine, fwd_bwd = _engine_and_fwd_bwd(settings, device, ParallelGroups.serial())
    n_tokens = settings.train_seqs * settings.train_seq_len

    def step() -> None:  # grads of the last fwd_bwd are still there: the step reads them again
        engine.optimizer.step(grad_scale=1.0 / n_tokens)

    fwd_bwd()
    optimizer_s = median_seconds(step, device, settings.warmup, settings.reps)
    fwd_bwd_s = median_seconds(fwd_bwd, device, settings.warmup, settings.reps)
    engine.optimizer.zero_grad()
    short_s, long_s = _decode_seconds(engine.model, settings)
    return EngineTiming(fwd_bwd_s, optimizer_s, short_s, long_s)


def _decode_seconds(model: torch.nn.Module, settings: ProfileSettings) -> tuple[float, float]:
    """Median seconds of `generate` (prefill + n decode steps, no EOS) for both decode lengths."""
    from actors.generation import GenerationConfig, generate

    device = torch.device(settings.device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, settings.model.vocab_size, (settings.decode_prompt_len,), generator=gen).to(device)
               for _ in range(settings.decode_batch)]
    model.eval()
    seconds = []
    try:
        for steps in settings.decode_steps:
            config = GenerationConfig(steps, eos_token_id=None, use_cuda_graph=device.type == "cuda")
            seconds.append(median_seconds(lambda: generate(model, prompts, config), device,
                                          settings.warmup, settings.reps))
    finally:
        model.train()
    return seconds[0], seconds[1]


# ---- hardware fields -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareMeasurements:
    """Raw single-device and collective numbers, and the HardwareSpec fields they give."""

    fields: dict[str, float]
    square_flops: float
    llm_flops: float
    collectives: CollectiveTiming | None


def measure_hardware(settings: ProfileSettings, ranks: int) -> HardwareMeasurements:
    """Matmul, copy and (with ranks >= 2) collective microbenchmarks -> HardwareSpec fields."""
    h = settings.model.hidden_size
    square = matmul_flops(settings.matmul_size, settings.matmul_size, settings.matmul_size, settings)
    llm = matmul_flops(settings.gemm_tokens, h, 4 * h, settings)
    fields: dict[str, float] = {"peak_flops": square, "hbm_bw": copy_bandwidth(settings)}
    if settings.device == "cuda":
        fields["mem_bytes"] = torch.cuda.get_device_properties(0).total_memory * USABLE_MEMORY
    collectives = measure_collectives(settings, ranks) if ranks >= 2 else None
    if collectives is not None:
        fields["intra_node_bw"] = collectives.broadcast_bw
        fields["collective_latency_s"] = collectives.small_allreduce_s
    return HardwareMeasurements(fields, square, llm, collectives)


def cut_model(spec: ModelSpec, n_layers: int) -> ModelSpec:
    """`spec` with only its first `n_layers` decoder blocks (same widths, vocabulary and head)."""
    if not 1 <= n_layers <= spec.n_layers:
        raise ValueError(f"n_layers={n_layers}: must be in [1, {spec.n_layers}] for {spec.name}")
    return replace(spec, name=f"{spec.name}-{n_layers}l", n_layers=n_layers)


__all__ = [
    "CollectiveTiming", "EngineTiming", "HardwareMeasurements", "MIN_EFFICIENCY", "ProfileSettings", "best_seconds",
    "copy_bandwidth", "cut_model", "matmul_flops", "measure_collectives", "measure_engine", "measure_hardware",
    "median_seconds", "tp_fwd_bwd_seconds",
]
