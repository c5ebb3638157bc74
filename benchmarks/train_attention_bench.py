"""Training attention of one peer-bench micro-batch, forward + backward, by kernel and by way of
sharing the prompts (actors.engine.shared_prefix_attention): which is fastest?

    python3 benchmarks/train_attention_bench.py             # one H200 (seconds)
    python3 benchmarks/train_attention_bench.py --cpu --tiny  # the same code paths' shapes on CPU

Shape (the peer bench's training micro-batch): 32 rows = 4 prompts x 8 samples, 128 prompt + 512
completion tokens, Llama-3.2-1B's attention (32 query heads, 8 KV heads, head_dim 64), bf16.
Ways, each timed as forward + backward of one layer (median of --reps, CUDA events):
  cascade        the engine's path until the fifteenth step: FlashAttention 2 varlen over the
                 compact stream (every prompt once, then every completion) + a cross call of each
                 group's completions over its prompt, merged; backward the same two calls
  fa2 rows       FlashAttention 2 varlen, every row whole (640 tokens causal, 32 sequences)
  cudnn rows     cuDNN's varlen attention (aten._cudnn_attention_forward/backward, the nested
                 tensors' kernel) on the same 32 whole rows, K/V with 8 heads, then repeated to 32
                 if cuDNN refuses grouped heads
  cudnn dense    cuDNN SDPA on the rows as one dense [32, H, 640, 64] batch (all rows are equally
                 long here; a real batch would pad)
  cudnn cascade  the cascade with cuDNN's varlen forward/backward instead of FA2's
  history        the engine's path: one FA2 varlen call (torch's varlen_attn) over K/V gathered
                 per row, a completion's keys its prompt and itself (history_attention)
  history aten   the same kernel calls without torch's varlen_attn, the autograd gather and the
                 float32 sum: aten's FA2 forward and backward on the gathered K/V, which shows
                 whether the kernel or what surrounds it costs the time
--profile WAYS (comma-separated names, '_' for a space, or "all") prints each named way's CUDA kernels by time per
step (torch.profiler over 5 steps).
Each line gives ms per layer, TFLOP/s on the FLOPs the way runs (forward 4 * S_q * S_k * D * H,
halved where causal; backward 2.5x forward) and the same times 16 layers x 16 micro-batches (the
training step's attention, 421 ms in the profile of the ninth step). A way that fails prints why.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.packing import PackedBatch, PrefixSpans  # noqa: E402
from actors.engine.shared_prefix_attention import (  # noqa: E402
    FLASH_KERNELS,
    REFERENCE_KERNELS,
    CascadeKernels,
    cascade_attention,
    history_attention,
)
from benchmarks.segment_copy_bench import median_cuda_seconds  # noqa: E402

LAYERS_X_MICRO = 16 * 16  # Llama-3.2-1B's layers x the peer bench's training micro-batches
PEAK_TFLOPS = 785.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="float32 on CPU: the reference cascade only")
    parser.add_argument("--tiny", action="store_true", help="2 prompts x 2 rows, 8 + 8 tokens, 4/2 heads, dim 8")
    parser.add_argument("--profile", default="", metavar="WAYS",
                        help="comma-separated way names (or 'all'): print their CUDA kernels by time per step")
    return parser.parse_args(argv)


def shape(args: argparse.Namespace) -> dict[str, int]:
    if args.tiny:
        return {"prompts": 2, "group": 2, "prompt": 8, "completion": 8, "hq": 4, "hkv": 2, "dim": 8}
    return {"prompts": 4, "group": 8, "prompt": 128, "completion": 512, "hq": 32, "hkv": 8, "dim": 64}


def cascade_batch(s: dict[str, int], device: torch.device) -> PackedBatch:
    """The compact stream [prompts | completions] of actors.engine.shared_prefix.shared_layout."""
    n_rows = s["prompts"] * s["group"]
    seg = [s["prompt"]] * s["prompts"] + [s["completion"]] * n_rows
    cu = torch.tensor([0] + seg, device=device).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(s["prompt"])] * s["prompts"]
                          + [torch.arange(s["prompt"], s["prompt"] + s["completion"])] * n_rows).to(device)
    cu_prefix = torch.arange(s["prompts"] + 1, device=device, dtype=torch.int32) * s["prompt"]
    cu_suffix = torch.arange(s["prompts"] + 1, device=device, dtype=torch.int32) * s["group"] * s["completion"]
    n_prefix = s["prompts"] * s["prompt"]
    heads = torch.arange(n_rows, device=device) // s["group"] * s["prompt"] + s["prompt"] - 1
    _, back = compact_index(s, device)  # each row whole, in compact positions
    history = torch.cat((torch.arange(n_prefix, device=device), back))
    cu_history = torch.tensor([0] + [s["prompt"]] * s["prompts"] + [s["prompt"] + s["completion"]] * n_rows,
                              device=device).cumsum(0).to(torch.int32)
    history_sorted, history_order = torch.sort(history, stable=True)
    spans = PrefixSpans(n_prefix, cu_prefix, cu_suffix, s["prompt"], s["group"] * s["completion"], heads,
                        history, cu_history, s["prompt"] + s["completion"], history_order, history_sorted)
    return PackedBatch(cu, positions, max(seg), spans)


def flops(s: dict[str, int], way: str) -> float:
    """Forward + backward FLOPs of the attention the way computes (module docstring)."""
    per_pair = 4 * s["dim"] * s["hq"]
    n_rows, p, c = s["prompts"] * s["group"], s["prompt"], s["completion"]
    if way == "cascade":
        forward = per_pair * (s["prompts"] * p * p / 2 + n_rows * c * c / 2 + n_rows * c * p)
    else:
        forward = per_pair * n_rows * (p + c) ** 2 / 2
    return 3.5 * forward


def time_ms(step: Callable[[], torch.Tensor], reps: int, device: torch.device) -> float:
    """Median ms of `step` (forward + backward) over reps on CUDA; NaN elsewhere (after two calls)."""
    if device.type != "cuda":
        step(), step()
        return float("nan")
    return 1e3 * median_cuda_seconds(step, reps)


def row_inputs(s: dict[str, int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """q [R * L, Hq, D], k, v [R * L, Hkv, D] of the rows whole (L = prompt + completion), the rows of
    a group holding the same prompt (as GRPO's samples of one prompt do)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for heads in (s["hq"], s["hkv"], s["hkv"]):
        parts = []
        for _ in range(s["prompts"]):
            prompt = torch.randn(s["prompt"], heads, s["dim"], generator=gen)
            for _ in range(s["group"]):
                parts += [prompt, torch.randn(s["completion"], heads, s["dim"], generator=gen)]
        out.append(torch.cat(parts).to(device=device, dtype=dtype))
    return out


def reference(rows: list[torch.Tensor], s: dict[str, int]) -> torch.Tensor:
    """float32 [R * L, Hq, D]: causal attention of every row alone."""
    length, group = s["prompt"] + s["completion"], s["hq"] // s["hkv"]
    q, k, v = (t.float().unflatten(0, (-1, length)).transpose(1, 2) for t in rows)  # [R, H, L, D]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(0, 1)


def compact_index(s: dict[str, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows -> compact: for each compact token the row token it comes from [T_c]; compact -> rows:
    for each row token its compact position [R * L])."""
    length, n_rows = s["prompt"] + s["completion"], s["prompts"] * s["group"]
    row_start = torch.arange(n_rows) * length
    prompts = (row_start[::s["group"], None] + torch.arange(s["prompt"])).flatten()
    completions = (row_start[:, None] + s["prompt"] + torch.arange(s["completion"])).flatten()
    take = torch.cat((prompts, completions))
    n_prefix = s["prompts"] * s["prompt"]
    prompt_at = (torch.arange(n_rows)[:, None] // s["group"]) * s["prompt"] + torch.arange(s["prompt"])
    completion_at = n_prefix + torch.arange(n_rows)[:, None] * s["completion"] + torch.arange(s["completion"])
    back = torch.cat((prompt_at, completion_at), dim=1).flatten()
    return take.to(device), back.to(device)


def leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def backward_fresh(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """out.backward with the leaves' gradients cleared first: accumulating into the previous
    step's .grad would add three bf16 adds (~0.1 ms) that the engine, whose gradients flow on into
    the projections, never runs, and that the aten ways (no autograd) do not pay either."""
    for t in inputs:
        t.grad = None
    out.backward(torch.ones_like(out))


def cascade_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    batch = cascade_batch(s, device)
    take, back = compact_index(s, device)
    q, k, v = leaves([t[take] for t in rows])
    kernels = FLASH_KERNELS if device.type == "cuda" else REFERENCE_KERNELS

    def step() -> torch.Tensor:
        # K/V with their own heads, as the engine passes them where FlashAttention takes GQA.
        out = cascade_attention(q, k, v, batch, kernels)
        backward_fresh(out, [q, k, v])
        return out.detach()[back]
    return step


# The layout cuDNN's varlen forward returned its lse in, by the cuDNN cascade's forward: its
# backward must hand the merged lse back in that layout (the cascade keeps FlashAttention's [H, T]).
_CUDNN_LSE_SHAPE: dict[str, tuple[int, ...]] = {}


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    out, lse, *_ = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0,
                                                            causal, False, scale=scale)
    _CUDNN_LSE_SHAPE["native"] = tuple(lse.shape)
    heads, tokens = q.shape[1], q.shape[0]
    if tuple(lse.shape) != (heads, tokens):  # e.g. [T, H] or [T, H, 1]: to [H, T]
        lse = lse.reshape(tokens, heads).t()
    return out, lse.float().contiguous(), torch.empty(0, device=q.device)


def _cudnn_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                    scale: float, rng: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(_CUDNN_LSE_SHAPE["native"]) == 3:  # [T, H, 1], as the forward gave it
        lse = lse.t().unsqueeze(-1)
    empty = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(d_out, q, k, v, out, lse.contiguous(), empty, empty,
                                                         torch.empty(0, device=q.device, dtype=q.dtype), cu_q, cu_k,
                                                         max_q, max_k, 0.0, causal, scale=scale)
    return dq, dk, dv


def cudnn_cascade_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device,
                       repeat_kv: bool) -> Callable[[], torch.Tensor]:
    """The engine's cascade with cuDNN's varlen forward and backward in place of FlashAttention's."""
    batch = cascade_batch(s, device)
    take, back = compact_index(s, device)
    q, k, v = leaves([t[take] for t in rows])
    if repeat_kv:
        k, v = leaves([t.repeat_interleave(s["hq"] // s["hkv"], 1) for t in (k, v)])
    kernels = CascadeKernels(_cudnn_forward, _cudnn_backward, FLASH_KERNELS.merge)

    def step() -> torch.Tensor:
        out = cascade_attention(q, k, v, batch, kernels)
        backward_fresh(out, [q, k, v])
        return out.detach()[back]
    return step


def history_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """The engine's path since the fifteenth step: one varlen call over K/V gathered per row."""
    batch = cascade_batch(s, device)
    take, back = compact_index(s, device)
    q, k, v = leaves([t[take] for t in rows])

    def step() -> torch.Tensor:
        out = history_attention(q, k, v, batch)
        backward_fresh(out, [q, k, v])
        return out.detach()[back]
    return step


def history_aten_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """history's kernels alone: K/V gathered by index, aten's FA2 forward and backward (CUDA only)."""
    batch = cascade_batch(s, device)
    spans = batch.shared_prefix
    assert spans is not None
    take, back = compact_index(s, device)
    q, k, v = (t[take].contiguous() for t in rows)
    scale, empty = s["dim"] ** -0.5, torch.empty(0, device=device)
    cu_q, cu_k, max_q, max_k = batch.cu_seqlens, spans.cu_history, batch.max_seqlen, spans.max_history

    def step() -> torch.Tensor:
        k_rows, v_rows = k.index_select(0, spans.history), v.index_select(0, spans.history)
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k_rows, v_rows, cu_q, cu_k, max_q, max_k,
                                                                      0.0, True, False, scale=scale)
        torch.ops.aten._flash_attention_backward(torch.ones_like(out), q, k_rows, v_rows, out, lse, cu_q, cu_k,
                                                 max_q, max_k, 0.0, True, rng, empty, scale=scale)
        return out[back]
    return step


def profile_kernels(name: str, step: Callable[[], torch.Tensor], steps: int = 5, top: int = 8) -> None:
    """Print the way's CUDA kernels by device time per step (the largest `top`, then the rest)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    print(f"profile of {name}: {total:.3f} ms of kernels per step")
    for e in kernels[:top]:
        print(f"  {e.self_device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<3d} {e.key[:100]}")
    rest = sum(e.self_device_time_total for e in kernels[top:]) / steps / 1e3
    if rest:
        print(f"  {rest:8.3f} ms  the other {len(kernels) - top} kernels")


def rows_cu(s: dict[str, int], device: torch.device) -> tuple[torch.Tensor, int]:
    n_rows, length = s["prompts"] * s["group"], s["prompt"] + s["completion"]
    return torch.arange(n_rows + 1, device=device, dtype=torch.int32) * length, length


def fa2_rows_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    cu, length = rows_cu(s, device)
    q, k, v = rows
    scale = s["dim"] ** -0.5

    def step() -> torch.Tensor:
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, True,
                                                                      False, scale=scale)
        torch.ops.aten._flash_attention_backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, length, length,
                                                 0.0, True, rng, torch.empty(0, device=device), scale=scale)
        return out
    return step


def cudnn_rows_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device,
                    repeat_kv: bool) -> Callable[[], torch.Tensor]:
    cu, length = rows_cu(s, device)
    q, k, v = rows
    if repeat_kv:
        k, v = (t.repeat_interleave(s["hq"] // s["hkv"], 1) for t in (k, v))
    scale, empty = s["dim"] ** -0.5, torch.empty(0, device=device, dtype=q.dtype)

    def step() -> torch.Tensor:
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, length, length, True, 0.0, True, False, scale=scale)
        torch.ops.aten._cudnn_attention_backward(torch.ones_like(out), q, k, v, out, lse, seed, offset, empty, cu, cu,
                                                 length, length, 0.0, True, scale=scale)
        return out
    return step


def cudnn_dense_step(s: dict[str, int], rows: list[torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    length = s["prompt"] + s["completion"]
    q, k, v = leaves([t.unflatten(0, (-1, length)).transpose(1, 2) for t in rows])  # [R, H, L, D]
    backends = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]

    def step() -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(backends):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        backward_fresh(out, [q, k, v])
        return out.detach().transpose(1, 2).flatten(0, 1)
    return step


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    s = shape(args)
    rows = row_inputs(s, dtype, device)
    expected = reference(rows, s)
    ways: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
        "cascade": lambda: cascade_step(s, rows, device), "history": lambda: history_step(s, rows, device)}
    if device.type == "cuda":
        ways |= {"history aten": lambda: history_aten_step(s, rows, device),
                 "fa2 rows": lambda: fa2_rows_step(s, rows, device),
                 "cudnn rows (8 kv heads)": lambda: cudnn_rows_step(s, rows, device, repeat_kv=False),
                 "cudnn rows (kv repeated)": lambda: cudnn_rows_step(s, rows, device, repeat_kv=True),
                 "cudnn dense": lambda: cudnn_dense_step(s, rows, device),
                 "cudnn cascade (8 kv heads)": lambda: cudnn_cascade_step(s, rows, device, repeat_kv=False),
                 "cudnn cascade (kv repeated)": lambda: cudnn_cascade_step(s, rows, device, repeat_kv=True)}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"cudnn {torch.backends.cudnn.version() if device.type == 'cuda' else '-'}")
    profiled = {way.replace("_", " ") for way in args.profile.split(",")}  # fa2_rows: "fa2 rows"
    table = []
    for name, build in ways.items():
        try:
            step = build()
            error = (step().float() - expected).abs().max().item()
            ms = time_ms(step, args.reps, device)
            if device.type == "cuda" and (args.profile == "all" or name in profiled):
                profile_kernels(name, step)
        except Exception as exc:  # noqa: BLE001 - a kernel this torch/GPU lacks: say why, go on
            print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            traceback.print_exc(limit=2)
            continue
        tflops = flops(s, "cascade" if "cascade" in name or name.startswith("history") else "rows") / ms / 1e9
        table.append((name, error, ms, tflops))
    if _CUDNN_LSE_SHAPE:
        print(f"cuDNN varlen lse layout: {_CUDNN_LSE_SHAPE['native']}")
    print("\n| way | max abs error | ms per layer (fwd+bwd) | TFLOP/s | % of 785 | ms per step (16 x 16) |")
    print("|---|---|---|---|---|---|")
    for name, error, ms, tflops in table:
        print(f"| {name} | {error:.1e} | {ms:.3f} | {tflops:.0f} | {100 * tflops / PEAK_TFLOPS:.0f}% | "
              f"{ms * LAYERS_X_MICRO:.0f} |")


if __name__ == "__main__":
    main()
