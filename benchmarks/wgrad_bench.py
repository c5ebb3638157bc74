"""Weight gradients summed into the fp32 main grad: the hook's way against the GEMM's epilogue.

Training sums each bf16 weight's gradient over micro-batches in an fp32 buffer. Two ways, per
linear weight of one block of a model preset (and its LM head), at one micro-batch of tokens:

    hook    dW = dY^T X in bf16 (cuBLAS), then main += dW (a mixed-dtype elementwise pass):
            what autograd plus ShardedAdamW's accumulation hook do (the embedding, head and
            norms still go this way)
    gemm    actors.engine.main_grad.accumulate_weight_grad: torch.addmm(main, dY^T, X,
            out_dtype=float32, out=main), the sum in the GEMM's epilogue (the linear layers)

The times are the GPU kernels' own (the profiler's kernel durations, as in elementwise_bench.py)
with the number of kernels each launches, and the largest difference of the two sums relative to
the largest value of the float64 sum. The last line multiplies one block by the model's layer
count: what a micro-batch's weight gradients cost each way.

    python3 benchmarks/wgrad_bench.py --model qwen2.5-0.5b --tokens 16384   # GPU, bf16
    python3 benchmarks/wgrad_bench.py --cpu --tiny                          # functional check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.main_grad import accumulate_weight_grad  # noqa: E402
from benchmarks.elementwise_bench import timed  # noqa: E402
from planning.models import ModelSpec, model_preset  # noqa: E402


def block_weights(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one block's linear weights and the LM head."""
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f), ("lm_head", spec.vocab_size, h)]


def measure(out_f: int, in_f: int, tokens: int, steps: int, device: torch.device,
            dtype: torch.dtype) -> tuple[float, float, float, float, float]:
    """(hook us, kernels, gemm us, kernels, relative difference of the two sums)."""
    grad = torch.randn(tokens, out_f, device=device, dtype=dtype)
    x = torch.randn(tokens, in_f, device=device, dtype=dtype)
    hook_main = torch.zeros(out_f, in_f, device=device, dtype=torch.float32)
    gemm_main = torch.zeros_like(hook_main)

    def hook() -> None:
        hook_main.add_(grad.t() @ x)

    def gemm() -> None:
        accumulate_weight_grad(gemm_main, grad, x)

    cuda = device.type == "cuda"
    results: list[float] = []
    for fn in (hook, gemm):
        seconds, kernels = timed(fn, steps, cuda)
        results += [seconds * 1e6, kernels]
    calls = steps + 2  # timed() calls each twice before timing
    scale = float((grad.double().t() @ x.double()).abs().max()) * calls
    diff = float((hook_main.double() - gemm_main.double()).abs().max()) / scale
    return results[0], results[1], results[2], results[3], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU (a functional check)")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset, 256 tokens")
    parser.add_argument("--model", default="llama3.2-1b", help="planning.models preset")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    spec = model_preset("tiny" if args.tiny else args.model)
    tokens, steps = (256, 2) if args.tiny else (args.tokens, args.steps)
    rows = [(name, out_f, in_f, *measure(out_f, in_f, tokens, steps, device, dtype))
            for name, out_f, in_f in block_weights(spec)]
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    timing = "GPU kernel time per micro-batch (profiler)" if cuda else "wall time"
    print(f"\nweight gradient into the fp32 main grad, {spec.name}, {tokens} tokens, {dtype}, {where}; {timing}")
    print(f"{'weight':<10} {'out x in':>14} {'hook us':>9} {'kernels':>8} {'gemm us':>9} {'kernels':>8} {'rel diff':>9}")
    for name, out_f, in_f, hook_us, hook_k, gemm_us, gemm_k, diff in rows:
        print(f"{name:<10} {f'{out_f} x {in_f}':>14} {hook_us:>9.1f} {hook_k:>8.0f} {gemm_us:>9.1f} {gemm_k:>8.0f} "
              f"{diff:>9.1e}")
    hook_ms, gemm_ms = (sum(r[i] for r in rows if r[0] != "lm_head") * spec.n_layers / 1e3 for i in (3, 5))
    print(f"{spec.n_layers} blocks per micro-batch: hook {hook_ms:.2f} ms, gemm {gemm_ms:.2f} ms")


if __name__ == "__main__":
    main()
