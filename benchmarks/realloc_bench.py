"""Benchmark parameter reallocation between two GPUs and compare it with the cost model.

Runs the executor of `actors.realloc.executor` on two processes (one per GPU, NCCL), for a Llama-3.2-1B
shaped model in bf16 with random weights built directly as shard dicts (no model code):

    (GPU0, tp1)      -> (GPU0+1, tp2)
    (GPU0+1, dp2)    -> (GPU1, tp1)      (all local: GPU1 already holds a full replica)
    (GPU0+1, tp2)    -> (GPU0+1, pp2)
    (GPU0, tp1)      -> (GPU1, tp1)      (a whole-model move over one link, for reference)

For each: seconds (median over repetitions, slowest rank), host seconds (until the host had
issued everything) and work seconds (host seconds outside torch.distributed calls: on gloo the
host waits for the transfer inside them, so `work` is the executor's own host time per call,
the number `--cpu --tiny-dims` is for), bytes per link, effective bandwidth
(bytes over the busiest link / seconds) against the measured NCCL broadcast peak, and the cost
model's prediction (`realloc_time_s`, hardware preset h200-141g). A raw 1 GiB NCCL broadcast
between the two GPUs is measured for reference. The first repetition of each case also checks
the result exactly against slices of a full model generated identically on both ranks.

    python benchmarks/realloc_bench.py                 # two GPUs, NCCL
    python benchmarks/realloc_bench.py --cpu           # gloo on CPU, tiny model, few repetitions
    python benchmarks/realloc_bench.py --cpu --model llama3.2-1b --tiny-dims   # host time per tensor

`--tiny-dims` keeps the preset's parameter list (layers, tying, biases) but shrinks every size,
so the bytes are negligible and the times are the executor's host-side work per tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.process_groups import free_port  # noqa: E402
from actors.realloc.executor import (
    COPY_PROGRAMS,
    ReallocGroups,
    ReallocStats,
    broadcast_groups,
    execute_reallocation,
    pull_group,
)
from actors.realloc.schedule import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_LEAD_BYTES,
    DIRECT_MIN_BYTES,
    MiB,
    build_schedule,
)  # noqa: E402
from planning.hardware import hardware_preset  # noqa: E402
from planning.layout import ClusterSpec, Layout, Mesh  # noqa: E402
from planning.models import ModelSpec, model_preset, param_specs  # noqa: E402
from planning.plan import Placement  # noqa: E402
from planning.realloc_plan import ReallocPlan, plan_reallocation, rank_params, realloc_time_s  # noqa: E402

# NVLink multicast (NVLS) stays off on the lent machines.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PEAK_BCAST_BPS = 367e9  # measured NCCL broadcast between two H200s
GPN = 2  # one node of two GPUs


def _p(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, GPN), Layout.parse(layout))


CASES: list[tuple[str, Placement, Placement]] = [
    ("g0 tp1 -> g0-1 tp2", _p(0, 1, "tp1"), _p(0, 2, "tp2")),
    ("g0-1 dp2 -> g1 tp1", _p(0, 2, "dp2"), _p(1, 1, "tp1")),
    ("g0-1 tp2 -> g0-1 pp2", _p(0, 2, "tp2"), _p(0, 2, "pp2")),
    ("g0 tp1 -> g1 tp1", _p(0, 1, "tp1"), _p(1, 1, "tp1")),
]


@dataclass(frozen=True)
class CaseResult:
    case: str
    lead_mib: float  # the schedule's first and last round size (0 = no ramp)
    seconds: float  # median over repetitions of the slowest rank
    best_seconds: float
    host_seconds: float  # median time for the slowest host to issue everything
    work_seconds: float  # median of the slowest host's time outside torch.distributed calls
    call_seconds: float  # median wall time of the whole call on the slowest rank (incl. planning)
    bytes_per_link: dict[str, int]
    local_bytes: int
    effective_gbps: float  # busiest link bytes / seconds, GB/s
    pct_of_peak: float
    predicted_seconds: float
    exact: bool


def _shards(spec: ModelSpec, placement: Placement, rank: int, full: dict[str, torch.Tensor],
            copy: bool = True) -> dict[str, torch.Tensor]:
    """This rank's slices of the full model under `placement` (empty outside its mesh), copied
    unless `copy` is False (views, enough to compare against)."""
    if rank not in placement.mesh.gpus:
        return {}
    out = {}
    for p, piece in rank_params(spec, False, placement, rank - placement.mesh.start):
        t = full[p.name]
        view = t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.stop - piece.start)
        out[p.name] = view.clone() if copy else view
    return out


def _full_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights, identical on both ranks (same seed, same device type)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {p.name: torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
            for p in param_specs(spec)}


def _time_case(plan: ReallocPlan, rank: int, src_shards: dict[str, torch.Tensor], groups: ReallocGroups,
               device: torch.device, dtype: torch.dtype, args: argparse.Namespace, lead_mib: float,
               reps: int) -> list[tuple[float, float, float, float]]:
    """(seconds, host seconds, whole-call seconds, work seconds) of each repetition, the slowest
    rank's."""
    times = []
    for _ in range(reps):
        dist.barrier()
        call_start = time.perf_counter()
        out, stats = _move(plan, rank, src_shards, groups, device, dtype, args, lead_mib)
        call_seconds = time.perf_counter() - call_start
        del out
        slowest = torch.tensor([stats.seconds, stats.host_seconds, call_seconds, stats.host_seconds - stats.comm_seconds],
                               dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, host, call, work = (float(x) for x in slowest.tolist())
        times.append((seconds, host, call, work))
    return times


def _move(plan: ReallocPlan, rank: int, src_shards: dict[str, torch.Tensor], groups: ReallocGroups,
          device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
          lead_mib: float) -> tuple[dict[str, torch.Tensor], ReallocStats]:
    return execute_reallocation(plan, rank, src_shards, groups, device, dtype, args.bucket_mib * MiB,
                                int(args.direct_mib * MiB), int(lead_mib * MiB),
                                copy_kernels=args.copies == "kernel",
                                copy_programs=args.copy_programs, pull={"auto": None, "on": True, "off": False}[args.pull])


def _run_case(name: str, src: Placement, dst: Placement, spec: ModelSpec, rank: int, groups: ReallocGroups,
              device: torch.device, dtype: torch.dtype, args: argparse.Namespace, lead_mib: float) -> CaseResult:
    plan = plan_reallocation(spec, False, src, dst)
    groups.ensure(broadcast_groups(plan) + ((pull_group(plan),) if pull_group(plan) else ()))
    full = _full_model(spec, device, dtype)
    src_shards = _shards(spec, src, rank, full)
    out, _ = _move(plan, rank, src_shards, groups, device, dtype, args, lead_mib)
    expected = _shards(spec, dst, rank, full, copy=False)
    exact = sorted(out) == sorted(expected) and all(torch.equal(out[k], v) for k, v in expected.items())
    del out, expected, full
    flag = torch.tensor([1.0 if exact else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    _time_case(plan, rank, src_shards, groups, device, dtype, args, lead_mib, args.warmup)
    timed = _time_case(plan, rank, src_shards, groups, device, dtype, args, lead_mib, args.reps)
    if args.trace and args.trace in name.replace(" ", ""):
        _trace(plan, rank, src_shards, groups, device, dtype, args, lead_mib, name)
    times = [t[0] for t in timed]
    elem = torch.empty((), dtype=dtype).element_size()
    links = plan.bytes_per_link(elem)
    seconds = statistics.median(times)
    busiest = max(links.values(), default=0)
    gbps = busiest / seconds / 1e9 if busiest else 0.0
    cluster = ClusterSpec(1, GPN, hardware_preset("h200-141g"))
    return CaseResult(
        case=name, lead_mib=lead_mib, seconds=seconds, best_seconds=min(times), host_seconds=statistics.median(t[1] for t in timed),
        work_seconds=statistics.median(t[3] for t in timed), call_seconds=statistics.median(t[2] for t in timed),
        bytes_per_link={f"{s}->{d}": b for (s, d), b in sorted(links.items())},
        local_bytes=plan.local_bytes(elem), effective_gbps=gbps, pct_of_peak=100 * gbps * 1e9 / PEAK_BCAST_BPS,
        predicted_seconds=realloc_time_s(plan, cluster, elem), exact=bool(flag.item() == 1.0),
    )


def _median_seconds(device: torch.device, step: Callable[[], None], warmup: int, reps: int) -> float:
    """Median wall seconds of `step` over `reps` runs after `warmup`, ranks aligned before each."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _raw_broadcast(device: torch.device, nbytes: int, warmup: int, reps: int) -> float:
    """Bytes/s of a plain broadcast of `nbytes` from rank 0 to rank 1 (median of `reps`)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_seconds(device, lambda: dist.broadcast(buf, src=0), warmup, reps)


def _raw_exchange(device: torch.device, nbytes: int, warmup: int, reps: int) -> float:
    """Bytes/s per direction when ranks 0 and 1 send `nbytes` to each other at once (one
    batch_isend_irecv each): the ceiling for moves with traffic both ways, e.g. tp2 -> pp2."""
    send = torch.empty(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    peer = 1 - dist.get_rank()

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return nbytes / _median_seconds(device, exchange, warmup, reps)


def _schedule_only(plan: ReallocPlan, rank: int, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                   lead_mib: float, merged: bool) -> float:
    """Seconds for the point-to-point rounds of the executor's schedule alone: the same messages
    (or, `merged`, one per direction and round) from and into preallocated buffers, no copies:
    the ceiling of the schedule."""
    schedule = build_schedule(plan, dtype.itemsize, args.bucket_mib * MiB, int(args.direct_mib * MiB), int(lead_mib * MiB))
    rounds = []
    for messages in schedule.p2p_rounds:
        mine = [(m.src == rank, m.receivers[0] if m.src == rank else m.src, m.numel)
                for m in messages if rank in (m.src, m.receivers[0])]
        if merged:
            sums: dict[tuple[bool, int], int] = {}
            for send, peer, numel in mine:
                sums[(send, peer)] = sums.get((send, peer), 0) + numel
            mine = [(send, peer, numel) for (send, peer), numel in sums.items()]
        rounds.append([(send, peer, torch.empty(numel, dtype=dtype, device=device)) for send, peer, numel in mine])

    def step() -> None:
        works = []
        for ops in rounds:
            if ops:
                works += dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, buf, peer)
                                                 for send, peer, buf in ops])
        for work in works:
            work.wait()

    return _median_seconds(device, step, args.warmup, args.reps)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(NCCL_ENV)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1 if args.cpu else 4)
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=2)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    dist.barrier()  # the world communicator exists before any point-to-point batch
    try:
        spec = _tiny_dims(model_preset(args.model)) if args.tiny_dims else model_preset(args.model)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        groups = ReallocGroups()
        results = [_run_case(name, src, dst, spec, rank, groups, device, dtype, args, lead)
                   for lead in args.lead_mib for name, src, dst in CASES]
        if args.schedule_only:
            for name, src, dst in CASES[:1] + CASES[2:3]:
                plan = plan_reallocation(spec, False, src, dst)
                busiest = max(plan.bytes_per_link(dtype.itemsize).values())
                for lead in args.lead_mib:
                    for merged in (False, True):
                        seconds = _schedule_only(plan, rank, device, dtype, args, lead, merged)
                        if rank == 0:
                            print(f"schedule only ({'one message per direction' if merged else 'executor messages'}), "
                                  f"{name}, lead {lead:g}: {seconds * 1e3:.3f} ms, "
                                  f"{100 * busiest / seconds / PEAK_BCAST_BPS:.1f}% of peak")
        raw_bps = _raw_broadcast(device, args.raw_mib * 2**20, args.warmup, args.reps)
        exchange_bps = _raw_exchange(device, args.raw_mib * 2**20, args.warmup, args.reps)
        if rank == 0:
            _report(results, raw_bps, exchange_bps, spec, args)
    finally:
        dist.destroy_process_group()


def _report(results: list[CaseResult], raw_bps: float, exchange_bps: float, spec: ModelSpec,
            args: argparse.Namespace) -> None:
    mode = "cpu/gloo" if args.cpu else "cuda/nccl"
    print(f"\nmodel {spec.name} ({spec.n_params() / 1e9:.2f}B params, {args.dtype}), {mode}, "
          f"pull {args.pull}, bucket {args.bucket_mib} MiB, direct >= {args.direct_mib} MiB, copies {args.copies} "
          f"({args.copy_programs} blocks), "
          f"{args.reps} reps after {args.warmup} warm-up")
    print("lead: the first and last round of a link (MiB; rounds grow x4 in between; 0 = all rounds of half a bucket)")
    print(f"raw broadcast of {args.raw_mib} MiB g0->g1: {raw_bps / 1e9:.1f} GB/s "
          f"({100 * raw_bps / PEAK_BCAST_BPS:.0f}% of {PEAK_BCAST_BPS / 1e9:.0f} GB/s)")
    print(f"raw exchange of {args.raw_mib} MiB each way g0<->g1: {exchange_bps / 1e9:.1f} GB/s per direction "
          f"({100 * exchange_bps / PEAK_BCAST_BPS:.0f}% of {PEAK_BCAST_BPS / 1e9:.0f} GB/s)")
    header = (f"{'case':<24} {'lead':>5} {'seconds':>9} {'best':>9} {'host':>9} {'work':>9} {'call':>9} {'pred(h200)':>10} "
              f"{'GB/s':>7} {'%peak':>6} {'exact':>5}  bytes per link / local")
    print(header)
    print("-" * len(header))
    for r in results:
        links = ", ".join(f"{k}: {_mb(v)}" for k, v in r.bytes_per_link.items()) or "none"
        print(f"{r.case:<24} {r.lead_mib:>5g} {r.seconds:>9.5f} {r.best_seconds:>9.5f} {r.host_seconds:>9.5f} {r.work_seconds:>9.5f} "
              f"{r.call_seconds:>9.5f} {r.predicted_seconds:>10.5f} "
              f"{r.effective_gbps:>7.1f} {r.pct_of_peak:>6.1f} {str(r.exact):>5}  {links} / local {_mb(r.local_bytes)}")
    if args.json:
        payload = {"mode": mode, "model": spec.name, "dtype": args.dtype, "bucket_mib": args.bucket_mib,
                   "copies": args.copies, "pull": args.pull,
                   "direct_mib": args.direct_mib, "raw_broadcast_gbps": raw_bps / 1e9,
                   "raw_exchange_gbps": exchange_bps / 1e9, "cases": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2))


def _tiny_dims(spec: ModelSpec) -> ModelSpec:
    """`spec` with the same parameter list but every size tiny (hidden 64, 4 heads of 16, 2 KV
    heads, intermediate 128, vocab 512), so that timings measure host work per tensor."""
    return replace(spec, name=f"{spec.name}-tiny-dims", vocab_size=512, hidden_size=64, intermediate_size=128,
                   n_heads=4, n_kv_heads=2, head_dim=16)


def _trace(plan: ReallocPlan, rank: int, src_shards: dict[str, torch.Tensor], groups: ReallocGroups,
           device: torch.device, dtype: torch.dtype, args: argparse.Namespace, lead_mib: float, name: str) -> None:
    """Profile one more repetition and write this rank's GPU activity (kernels and copies, by
    stream, microseconds from the first one) to realloc_trace_lead<L>_rank<R>.txt in --trace-dir."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 (only when tracing)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        out, _ = _move(plan, rank, src_shards, groups, device, dtype, args, lead_mib)
        del out
    raw = Path(args.trace_dir) / f"realloc_trace_rank{rank}.json"
    prof.export_chrome_trace(str(raw))
    events = [e for e in json.loads(raw.read_text())["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    raw.unlink()
    t0 = min((e["ts"] for e in events), default=0.0)
    lines = [f"{name}, lead {lead_mib:g} MiB, rank {rank}: stream, start us, duration us, kernel"]
    for e in sorted(events, key=lambda e: e["ts"]):
        lines.append(f"{e.get('args', {}).get('stream', '?'):>4} {e['ts'] - t0:>9.1f} {e['dur']:>9.1f}  {e['name'][:90]}")
    (Path(args.trace_dir) / f"realloc_trace_lead{lead_mib:g}_rank{rank}.txt").write_text("\n".join(lines) + "\n")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (tiny model, few repetitions by default)")
    parser.add_argument("--model", default=None, help="model preset (default llama3.2-1b; tiny with --cpu)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; 3 with --cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up repetitions (default 3; 1 with --cpu)")
    parser.add_argument("--tiny-dims", action="store_true",
                        help="keep the preset's tensors but shrink their sizes: measures host time per tensor")
    parser.add_argument("--bucket-mib", type=int, default=DEFAULT_BUCKET_BYTES // MiB)
    parser.add_argument("--direct-mib", type=float, default=DIRECT_MIN_BYTES / MiB,
                        help="slices at least this large are sent without packing when contiguous")
    parser.add_argument("--lead-mib", default=str(DEFAULT_LEAD_BYTES / MiB),
                        help="first/last round size in MiB; a comma-separated list runs every case for each")
    parser.add_argument("--trace", default=None,
                        help="case name without spaces (or part of it, e.g. tp2->g0-1pp2): write each rank's "
                             "GPU timeline of one more repetition to realloc_trace_lead<L>_rank<R>.txt")
    parser.add_argument("--copies", default="torch", choices=["torch", "kernel"],
                        help="packing/unpacking/local copies when not pulling: torch copies (the executor's "
                             "default) or the Triton multi-copy kernel")
    parser.add_argument("--pull", default="auto", choices=["auto", "on", "off"],
                        help="read received slices straight from the peer's shards (CUDA IPC) instead of NCCL "
                             "(auto: on CUDA with triton)")
    parser.add_argument("--copy-programs", type=int, default=COPY_PROGRAMS, help="thread blocks per copy kernel launch")
    parser.add_argument("--schedule-only", action="store_true",
                        help="also time the point-to-point rounds of the schedule alone (no copies)")
    parser.add_argument("--trace-dir", default=".", help="where --trace writes its files")
    parser.add_argument("--raw-mib", type=int, default=None, help="raw broadcast size (default 1024; 16 with --cpu)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    try:
        args.lead_mib = [float(x) for x in args.lead_mib.split(",")]
    except ValueError:
        parser.error(f"--lead-mib {args.lead_mib!r}: expected numbers separated by commas, e.g. 0,32")
    if any(x < 0 for x in args.lead_mib):
        parser.error(f"--lead-mib {args.lead_mib}: sizes must be >= 0")
    args.model = args.model or ("tiny" if args.cpu else "llama3.2-1b")
    args.reps = args.reps or (3 if args.cpu else 20)
    args.warmup = args.warmup or (1 if args.cpu else 3)
    args.raw_mib = args.raw_mib or (16 if args.cpu else 1024)
    if not args.cpu and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}; use --cpu to run on CPU with gloo")
    os.environ.update(NCCL_ENV)
    mp.spawn(_worker, args=(args, free_port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
