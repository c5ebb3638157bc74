"""The fused elementwise functions of the engine, compiled two ways, against HBM bandwidth.

Each function (actors/engine/model.py; the shared-prefix attention merge of
actors/engine/shared_prefix_attention.py) is timed forward and forward + backward at a
micro-batch of the peer bench (20,480 tokens of Llama-3.2-1B), three ways:

    eager            the plain torch functions
    all-dynamic      torch.compile(fn, dynamic=True, fullgraph=True): every size symbolic,
                     head count and head_dim included, as the engine compiled them up to
                     c591b44 (the kernels index with runtime divisions)
    token-dynamic    actors.engine.fusion.fused(fn), what the engine runs now: only the token
                     dimension symbolic, the other sizes compiled in

and prints GB/s of the bytes each must move (inputs read, outputs written; backward: saved
inputs and output gradients read, input gradients written) against 4.3 TB/s, with the largest
difference to eager. On CUDA the times are the GPU kernels' own (the profiler's sum of kernel
durations): a compiled function's host overhead overlaps the GPU in the engine, and timing the
wall clock of one small call measures that overhead instead. Each compiled variant is first
called at two token counts, so it is compiled for the changing size before it is timed, and
must then run a third token count without recompiling. The merge runs forward only (the
cascade's backward does not differentiate it).

    python3 benchmarks/elementwise_bench.py            # GPU, bf16
    python3 benchmarks/elementwise_bench.py --model qwen2.5-0.5b --tokens 16384   # another shape
    python3 benchmarks/elementwise_bench.py --cpu --tiny   # a functional check (float32, CPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.fusion import fused
from actors.engine.model import add_rms_norm, rms_norm, swiglu
from actors.engine.rotary import apply_rotary
from actors.engine.shared_prefix_attention import merge_partials
from planning.models import model_preset

HBM_BYTES_PER_S = 4.3e12
VARIANTS = ("eager", "all-dynamic", "token-dynamic")


# Token dimension of each argument of the cases that are not token-major throughout (the
# merge's lse are [heads, tokens]); the others use fused()'s default (dim 0 of 2-D and up).
TOKEN_DIMS = {"merge": (0, 1, 0, 1)}


def variant_fn(name: str, fn: Callable[..., object], variant: str) -> Callable[..., object]:
    if variant == "eager":
        return fn
    if variant == "all-dynamic":
        return torch.compile(fn, dynamic=True, fullgraph=True)
    return fused(fn, TOKEN_DIMS.get(name))


def cases(tokens: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
          device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable[..., object], Callable[[int], tuple]]]:
    """name -> (function, its inputs at a token count; cos/sin need no gradient, the rest do)."""
    def randn(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    def lse(t: int) -> torch.Tensor:
        return torch.randn(heads, t, device=device) + 5.0

    def self_part(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The self-attention partial as the cascade passes it: the rows after the prompt, sliced
        from [T, H, D] and [H, T] (stride and offset change with the prompt length)."""
        prompt = t // 8
        return randn(t + prompt, heads, head_dim, grad=False)[prompt:], lse(t + prompt)[:, prompt:]

    def rope(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.rand(t, head_dim // 2, device=device) * 6.28
        emb = torch.cat((angles, angles), -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    eps = 1e-5
    return {
        "rms_norm": (lambda x, w: rms_norm(x, w, eps), lambda t: (randn(t, hidden), randn(hidden))),
        "add_rms_norm": (lambda x, d, w: add_rms_norm(x, d, w, eps),
                         lambda t: (randn(t, hidden), randn(t, hidden), randn(hidden))),
        "swiglu": (swiglu, lambda t: (randn(t, inter), randn(t, inter))),
        "rotary q": (apply_rotary, lambda t: (randn(t, heads, head_dim), *rope(t))),
        "rotary k": (apply_rotary, lambda t: (randn(t, kv_heads, head_dim), *rope(t))),
        "merge": (merge_partials, lambda t: (*self_part(t), randn(t, heads, head_dim, grad=False), lse(t))),
    }


def outputs(result: object) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def moved_bytes(args: tuple, outs: list[torch.Tensor], backward: bool) -> int:
    """Least bytes: forward reads the inputs and writes the outputs; backward reads the inputs it
    saved and the output gradients and writes the gradients of the inputs needing them."""
    size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    out = sum(o.numel() * o.element_size() for o in outs)
    grads = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
    return size + out + (out + size + grads if backward else 0)


def kernel_seconds(fn: Callable[[], None], steps: int) -> tuple[float, float]:
    """(GPU kernel seconds, kernels launched) per call of fn, from the profiler: the sum of the
    kernels' own durations, so host overhead (a compiled function's guards, autograd) and gaps
    between launches are left out, as they overlap the GPU's work in the engine."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps, len(kernels) / steps


def timed(fn: Callable[[], None], steps: int, cuda: bool) -> tuple[float, float]:
    """(seconds, kernels) per call: GPU kernel time on CUDA, wall time on CPU (kernels: 0)."""
    fn()  # compiles (per grad mode) and tunes outside the timing
    fn()
    if cuda:
        return kernel_seconds(fn, steps)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps, 0.0


Row = tuple[str, str, float, float, float, float, float, float]


def measure(name: str, fn: Callable[..., object], make: Callable[[int], tuple], tokens: int, steps: int,
            cuda: bool) -> list[Row]:
    """Rows (case, variant, forward us, forward GB/s, forward+backward us, GB/s, kernels per
    forward+backward, max diff to eager); nan for the backward of forward-only cases. Backward
    goes through torch.autograd.grad, so no .grad accumulation kernels are timed with it."""
    torch.manual_seed(0)
    args = make(tokens)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    reference = [o.detach().float() for o in outputs(fn(*args))]
    rows = []
    for variant in VARIANTS:
        run = variant_fn(name, fn, variant)
        run(*make(tokens - 128))  # compile for a second token count first (the engine's sizes vary)
        outs = outputs(run(*args))
        grads = [torch.randn_like(o) for o in outs]
        diff = max((o.detach().float() - r).abs().max().item() for o, r in zip(outs, reference))

        def forward(run: Callable[..., object] = run) -> None:
            with torch.no_grad():
                run(*args)

        def both(run: Callable[..., object] = run, grads: list[torch.Tensor] = grads) -> None:
            torch.autograd.grad(outputs(run(*args)), leaves, grads)

        fwd_s, kernels = timed(forward, steps, cuda)
        both_s = float("nan")  # forward-only cases (the merge)
        if leaves:
            both_s, kernels = timed(both, steps, cuda)
        if variant != "eager":
            no_recompile(run, make(tokens - 64))
        rows.append((name, variant, fwd_s * 1e6, moved_bytes(args, outs, False) / fwd_s / 1e9,
                     both_s * 1e6, moved_bytes(args, outs, True) / both_s / 1e9, kernels, diff))
    return rows


def no_recompile(run: Callable[..., object], args: tuple) -> None:
    """A third token count must reuse the compiled kernels (the engine's token counts vary per
    micro-batch and a recompile per size would hit dynamo's recompile limit)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = outputs(run(*args))
        if leaves:
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])


def chosen_cases(parser: argparse.ArgumentParser, names: str, every: dict[str, tuple]) -> dict[str, tuple]:
    """The cases --cases names, in the table's order; an unknown name exits 2 listing the known ones."""
    if names == "all":
        return every
    wanted = [n.replace("_", " ") if n.startswith("rotary") else n for n in names.split(",")]
    unknown = [n for n in wanted if n not in every]
    if unknown:
        known = ", ".join(n.replace(" ", "_") for n in every)
        parser.error(f"--cases: {', '.join(unknown)} unknown; known: {known}, or all")
    return {n: case for n, case in every.items() if n in wanted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU (a functional check)")
    parser.add_argument("--tiny", action="store_true", help="a few hundred tokens of a tiny shape")
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--model", default="llama3.2-1b", help="planning.models preset whose sizes to use")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cases", default="all",
                        help="comma-separated case names (rms_norm, add_rms_norm, swiglu, rotary_q, rotary_k, "
                             "merge; '_' for a space) or 'all'")
    args = parser.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    spec = model_preset(args.model)
    shape = (256, 64, 160, 4, 2, 16) if args.tiny else (
        args.tokens, spec.hidden_size, spec.intermediate_size, spec.n_heads, spec.n_kv_heads, spec.head_dim)
    table = []
    for name, (fn, make) in chosen_cases(parser, args.cases, cases(*shape, device, dtype)).items():
        table += measure(name, fn, make, shape[0], 2 if args.tiny else args.steps, cuda)
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"\nfused elementwise functions, {shape[0]} tokens (hidden {shape[1]}, intermediate {shape[2]}, "
          f"heads {shape[3]}/{shape[4]} x {shape[5]}), {dtype}, {where}; HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    timing = "GPU kernel time per call (profiler)" if cuda else "wall time per call"
    print(f"{timing}; f+b = forward and backward; kernels launched per f+b (per forward for the merge)")
    print(f"{'case':<13} {'variant':<14} {'fwd us':>9} {'fwd GB/s':>9} {'f+b us':>9} {'f+b GB/s':>9} "
          f"{'kernels':>8} {'max diff':>9}")
    for name, variant, fwd_us, fwd_gbs, both_us, both_gbs, kernels, diff in table:
        print(f"{name:<13} {variant:<14} {fwd_us:>9.1f} {fwd_gbs:>9.0f} {both_us:>9.1f} {both_gbs:>9.0f} "
              f"{kernels:>8.0f} {diff:>9.2e}")


if __name__ == "__main__":
    main()
