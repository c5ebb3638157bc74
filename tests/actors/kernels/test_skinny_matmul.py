"""The Triton GEMM for decode-sized batches (actors.kernels.skinny_matmul) against F.linear.

unit: the kernel in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 where
there is no CUDA), float32, small blocks so that M, N and K each take several tiles and the last
one is partial (and K both a multiple of the block and not), with and without bias; the rule
for when `linear` takes the kernel; and that the model's projections and the tp layers go
through `linear`. gpu: bf16 at a 1B Llama's decode shapes (M = 512), tuned launch, against
cuBLAS; and a block's MLP whose projections take the kernel against cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.engine.model import Transformer
from actors.engine.tp_layers import ColumnParallelLinear, Linear, linear
from actors.kernels.skinny_matmul import MAX_DIM, SKINNY_ROWS, skinny_fits, skinny_linear
from actors.kernels.switch import triton_runs
from planning.models import model_preset

CPU_RUNS = triton_runs("cpu")
needs_interpreter = pytest.mark.skipif(not CPU_RUNS, reason="Triton's interpreter is not available")


@needs_interpreter
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(40, 50, 64, False), (33, 48, 80, True), (16, 16, 32, True)])
def test_kernel_matches_linear_in_the_interpreter(m: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = skinny_linear(x, w, b, block=(16, 16, 32))
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_kernel_reads_strided_rows() -> None:
    """x may be a view whose rows are further apart than K (a slice of a wider buffer)."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(24, 96, generator=gen)
    x, w = wide[:, :64], torch.randn(20, 64, generator=gen)
    torch.testing.assert_close(skinny_linear(x, w, block=(16, 16, 32)), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_bad_shapes_name_what_is_wrong() -> None:
    if not CPU_RUNS:
        with pytest.raises(RuntimeError, match="no Triton"):
            skinny_linear(torch.zeros(4, 8), torch.zeros(2, 8))
        return
    with pytest.raises(ValueError, match=r"x \(4, 8\) and weight \(2, 6\)"):
        skinny_linear(torch.zeros(4, 8), torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"bias \(3,\); want \[2\]"):
        skinny_linear(torch.zeros(4, 8), torch.zeros(2, 8), torch.zeros(3))


def test_the_kernel_is_for_cuda_inference_batches_only() -> None:
    """CPU tensors, autograd, float32 and row counts outside SKINNY_ROWS keep F.linear."""
    x, w = torch.zeros(512, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not skinny_fits(x, w)  # CPU: the interpreter runs the kernel only when asked for
    assert SKINNY_ROWS[0] <= 512 <= SKINNY_ROWS[1] and MAX_DIM >= 8192
    with torch.no_grad():
        layer = Linear(64, 32)
        torch.testing.assert_close(layer(torch.ones(3, 64)), F.linear(torch.ones(3, 64), layer.weight, layer.bias))


def test_projections_go_through_linear() -> None:
    """The model's block projections are `Linear` (nn.Linear's names and state_dict keys), the
    tp layers call `linear`; so every projection of a decode step can take the kernel."""
    model = Transformer(model_preset("tiny"))
    layer = model.model.layers["0"]
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                   layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, Linear) and isinstance(p, torch.nn.Linear) for p in projections)
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()
    column = ColumnParallelLinear(16, 8, True, None)
    torch.nn.init.normal_(column.weight)
    torch.nn.init.normal_(column.bias)
    x = torch.randn(5, 16)
    torch.testing.assert_close(column(x), linear(x, column.weight, column.bias))


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (2048, 2048), (8192, 2048), (2048, 8192), (896, 896)])
def test_kernel_matches_cublas_at_decode_shapes(n: int, k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert skinny_fits(x, w)
        got = skinny_linear(x, w, b)
        want = F.linear(x.float(), w.float(), b.float())
    # bf16 output of an fp32 accumulation: within bf16 rounding of the float32 product.
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
def test_mlp_with_the_kernel_matches_cublas() -> None:
    """A block's MLP over 256 rows without autograd (the kernel's range, as in a decode step)
    against the same products through cuBLAS."""
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny"))
    model.init_weights(0)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(256, model.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    mlp = model.model.layers["0"].mlp
    with torch.no_grad():
        assert skinny_fits(x, mlp.gate_proj.weight)
        got = mlp(x)
        want = F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                        mlp.down_proj.weight)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
