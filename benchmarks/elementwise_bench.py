"""The fused elementwise functions of a block (actors/engine/model.py), compiled two ways, against HBM.

The training profile of the peer bench's call (docs/benchmarks.md, issue 27, eighth step) has
the rotary kernels at about a fifth of the HBM bandwidth (245 us per layer and micro-batch for
q and k, where their bytes need ~50 us), while the norms and the SiLU gate run near it. The
engine compiles each function with `dynamic=True` (actors.engine.model.fused), which makes every
dimension symbolic, head count and head_dim included: the kernels then index with runtime
divisions. This bench times each function's forward and forward + backward at a micro-batch of
the peer bench (20,480 tokens of Llama-3.2-1B) three ways:

    eager            the plain torch functions
    all-dynamic      actors.engine.model.fused(fn): torch.compile(fn, dynamic=True,
                     fullgraph=True), what the engine runs
    token-dynamic    torch.compile(fn, dynamic=False, fullgraph=True) with only the token
                     dimension marked dynamic (torch._dynamo.mark_dynamic(x, 0)), as a
                     micro-batch's token count is the only size that changes

and prints GB/s of the bytes each must move (inputs read, outputs written; backward: saved
inputs and output gradients read, input gradients written) against 4.3 TB/s, with the largest
difference to eager. Each compiled variant is first called at two token counts, so it is
compiled for the changing size before it is timed.

    python3 benchmarks/elementwise_bench.py            # GPU, bf16
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

from actors.engine.model import add_rms_norm, apply_rotary, fused, rms_norm, swiglu

HBM_BYTES_PER_S = 4.3e12
VARIANTS = ("eager", "all-dynamic", "token-dynamic")


def token_dynamic(fn: Callable[..., object]) -> Callable[..., object]:
    """fn compiled with static sizes except dim 0 (tokens) of every token-major tensor argument
    (2-D and up; a norm's weight [H] stays static)."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def run(*args: object) -> object:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 1:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


def variant_fn(fn: Callable[..., object], variant: str) -> Callable[..., object]:
    if variant == "eager":
        return fn
    if variant == "all-dynamic":
        return fused(fn)
    return token_dynamic(fn)


def cases(tokens: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
          device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable[..., object], Callable[[int], tuple]]]:
    """name -> (function, its inputs at a token count; cos/sin need no gradient, the rest do)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

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


def timed(fn: Callable[[], None], steps: int, cuda: bool) -> float:
    fn()  # compiles (per grad mode) and tunes outside the timing
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(name: str, fn: Callable[..., object], make: Callable[[int], tuple], tokens: int, steps: int,
            cuda: bool) -> list[tuple[str, str, float, float, float, float, float]]:
    """Rows (case, variant, forward us, forward GB/s, forward+backward us, GB/s, max diff to eager)."""
    torch.manual_seed(0)
    args = make(tokens)
    reference = [o.detach().float() for o in outputs(fn(*args))]
    rows = []
    for variant in VARIANTS:
        run = variant_fn(fn, variant)
        run(*make(tokens - 128))  # compile for a second token count first (the engine's sizes vary)
        outs = outputs(run(*args))
        grads = [torch.randn_like(o) for o in outs]
        diff = max((o.detach().float() - r).abs().max().item() for o, r in zip(outs, reference))

        def forward(run: Callable[..., object] = run) -> None:
            with torch.no_grad():
                run(*args)

        def both(run: Callable[..., object] = run, grads: list[torch.Tensor] = grads) -> None:
            torch.autograd.backward(outputs(run(*args)), grads)

        fwd_s, both_s = timed(forward, steps, cuda), timed(both, steps, cuda)
        rows.append((name, variant, fwd_s * 1e6, moved_bytes(args, outs, False) / fwd_s / 1e9,
                     both_s * 1e6, moved_bytes(args, outs, True) / both_s / 1e9, diff))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU (a functional check)")
    parser.add_argument("--tiny", action="store_true", help="a few hundred tokens of a tiny shape")
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    shape = (256, 64, 160, 4, 2, 16) if args.tiny else (args.tokens, 2048, 8192, 32, 8, 64)
    table = []
    for name, (fn, make) in cases(*shape, device, dtype).items():
        table += measure(name, fn, make, shape[0], 2 if args.tiny else args.steps, cuda)
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"\nfused elementwise functions, {shape[0]} tokens (hidden {shape[1]}, intermediate {shape[2]}, "
          f"heads {shape[3]}/{shape[4]} x {shape[5]}), {dtype}, {where}; HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print(f"{'case':<13} {'variant':<14} {'fwd us':>9} {'fwd GB/s':>9} {'f+b us':>9} {'f+b GB/s':>9} {'max diff':>9}")
    for name, variant, fwd_us, fwd_gbs, both_us, both_gbs, diff in table:
        print(f"{name:<13} {variant:<14} {fwd_us:>9.1f} {fwd_gbs:>9.0f} {both_us:>9.1f} {both_gbs:>9.0f} {diff:>9.2e}")


if __name__ == "__main__":
    main()
