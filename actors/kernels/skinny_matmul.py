"""y = x W^T (+ b) for a few hundred rows of x: the projections of a decode step, as a Triton GEMM.

Why: a decode step of 512 sequences multiplies [512, H] activations by every weight of the
model. cuBLAS picks tiles for such short, wide products that leave much of an H200 idle: torch
inductor's autotuner measured its GEMMs of a 1B Llama's decode step at 57-77% of the speed of the
best Triton tiling (down projection [512, 8192] x [8192, 2048]: 58.5 us against 33.4 us; docs/
benchmarks.md, issue 27, eighth step). This is the plain tiled GEMM (fp32 accumulator, tiles
grouped along M so neighbouring programs share weight columns in L2) with a few launch shapes
tuned per (M, N, K) on first use:

    x    [M, K]   activations, rows contiguous (M in SKINNY_ROWS)
    w    [N, K]   nn.Linear's weight
    b    [N]      optional bias
    out  [M, N]   x's dtype

`skinny_fits` is the single rule for when `actors.engine.tp_layers.linear` takes this path: CUDA,
no autograd (decode and other inference), bf16/fp16, M in SKINNY_ROWS, N and K at most MAX_DIM
(the vocabulary head stays with cuBLAS, which reaches ~90% of the bf16 peak there). On CPU the
kernel runs only in Triton's interpreter, for the tests (actors.kernels.switch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.switch import triton_installed, triton_interpreting

SKINNY_ROWS = (256, 1024)  # rows of x where the tuned tiles beat cuBLAS (benchmarks/skinny_matmul_bench.py)
MAX_DIM = 16384  # largest N and K; a vocabulary head (N ~ 128k) stays with cuBLAS
# Read once at import: the calls below run inside torch.compile'd decode steps, where a package
# lookup per call would break the graph.
_ON_CUDA = triton_installed() and not triton_interpreting()
_ON_CPU = triton_interpreting()

if triton_installed():
    import triton
    import triton.language as tl

    # The winners of inductor's autotuning for a 1B Llama's decode projections at M = 512 on an
    # H200 (gate/up, fused qkv, o, down), plus two smaller tiles for narrow outputs.
    _CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
                for m, n, k, s, w in ((128, 128, 64, 3, 4), (128, 128, 64, 5, 8), (64, 64, 128, 5, 4),
                                      (64, 128, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4))]

    @triton.jit
    def _skinny_mm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # Program -> (pid_m, pid_n), GROUP_M row tiles at a time: the programs running together
        # read the same weight tiles, so each weight byte comes from HBM about once.
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        group_rows = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group_rows)
        pid_n = (pid % width) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows and columns past the edge wrap around (loads need no mask; the store masks them).
        rm_in = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
        rn_in = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_tile = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_left in range(K, 0, -BLOCK_K):
            if EVEN_K:
                a = tl.load(x_tile)
                b = tl.load(w_tile)
            else:
                a = tl.load(x_tile, mask=rk[None, :] < k_left, other=0.0)
                b = tl.load(w_tile, mask=rk[:, None] < k_left, other=0.0)
            acc += tl.dot(a, b)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    # Every tuned BLOCK_K divides 128, so K % 128 == 0 means no partial K block for any config.
    _skinny_mm_tuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K"])(_skinny_mm_kernel)


def skinny_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` runs x [M, K] @ weight [N, K]^T through the Triton kernel."""
    return (_ON_CUDA and x.is_cuda and not torch.is_grad_enabled() and x.dim() == 2
            and SKINNY_ROWS[0] <= x.shape[0] <= SKINNY_ROWS[1]
            and weight.shape[0] <= MAX_DIM and weight.shape[1] <= MAX_DIM
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.is_contiguous())


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                  block: tuple[int, int, int] | None = None) -> Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32.

    block: (BLOCK_M, BLOCK_N, BLOCK_K) to launch with; None tunes on CUDA (16, 16, 32 in the
    interpreter, where tuning would only cost time)."""
    if not (x.is_cuda and _ON_CUDA or x.device.type == "cpu" and _ON_CPU):
        raise RuntimeError(f"skinny_linear: no Triton for {x.device} (CUDA, or CPU under TRITON_INTERPRET=1)")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)}; want [M, K] and [N, K]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)}; want [{weight.shape[0]}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    args = (x, weight, bias_arg, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0))
    if block is None and x.is_cuda:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _skinny_mm_tuned[grid](*args, HAS_BIAS=bias is not None, EVEN_K=K % 128 == 0)
        return out
    bm, bn, bk = block or (16, 16, 32)
    _skinny_mm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        *args, HAS_BIAS=bias is not None, EVEN_K=K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
    return out


__all__ = ["MAX_DIM", "SKINNY_ROWS", "skinny_fits", "skinny_linear"]
