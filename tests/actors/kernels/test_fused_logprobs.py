"""The fused Triton logprob kernels (actors.kernels.fused_logprobs) against the torch path.

unit: the kernels run in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1
where there is no CUDA) or compiled on CUDA, on small cases (T <= 8, V <= 300, blocks of 64 so a
row takes several blocks and the last one is partial): per-row statistics, gradients,
temperature, `allowed` masks (including rows whose whole slice is masked), targets owned by
another rank, and a tp=2 emulation that combines the statistics of two vocab shards.
dist: the same on 2 gloo processes through vocab_parallel_logprobs with a real tp group.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.engine import logprobs as logprobs_mod  # noqa: E402
from actors.engine.logprobs import combine_row_stats, token_logprobs, vocab_parallel_logprobs  # noqa: E402
from actors.engine.process_groups import build_parallel_groups  # noqa: E402
from actors.kernels.switch import triton_runs  # noqa: E402
from planning.layout import Layout  # noqa: E402
from tests.dist_harness import run_distributed  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not triton_runs(DEVICE):
    pytest.skip("Triton kernels cannot run here (no CUDA and TRITON_INTERPRET is not 1)", allow_module_level=True)

from actors.kernels.fused_logprobs import logprob_grad, logprob_row_stats  # noqa: E402

ATOL = 1e-5
BLOCK = 64  # small blocks: several per row, the last one partial (V = 300)


def _case(seed: int, T: int = 8, V: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, V] float32, targets [T], allowed [T, V] (target always allowed; row 0 allows only
    the first half of the vocab, row 1 only the second half, so a tp=2 shard is all masked there)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=gen) * 4
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[0], targets[1] = 3, V - 5
    allowed = torch.rand(T, V, generator=gen) < 0.5
    allowed[0, V // 2:] = False
    allowed[1, :V // 2] = False
    allowed[torch.arange(T), targets] = True
    return logits.to(DEVICE), targets.to(DEVICE), allowed.to(DEVICE)


def _torch_stats(logits: torch.Tensor, local_target: torch.Tensor, temperature: float,
                 allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the forward kernel computes, in plain torch (float64 for a tight reference)."""
    x = logits.double() / temperature
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    m = x.max(-1).values
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = (x - shift[:, None]).exp().sum(-1)
    owned = (local_target >= 0) & (local_target < logits.shape[1])
    picked = x.gather(-1, local_target.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(-1)
    return m.float(), s.float(), picked.masked_fill(~owned, 0.0).float()


@pytest.mark.unit
@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.7, False), (1.3, True)])
def test_row_stats_kernel(temperature: float, masked: bool) -> None:
    logits, targets, allowed = _case(0)
    mask = allowed if masked else None
    local_target = targets.clone()
    local_target[2], local_target[3] = -7, logits.shape[1] + 11  # owned by other ranks
    m, s, picked = logprob_row_stats(logits, local_target, temperature, mask, block=BLOCK)
    ref_m, ref_s, ref_picked = _torch_stats(logits, local_target, temperature, mask)
    torch.testing.assert_close(m, ref_m, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(s, ref_s, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(picked, ref_picked, atol=ATOL, rtol=1e-5)
    assert picked[2] == 0 and picked[3] == 0


@pytest.mark.unit
def test_row_stats_fully_masked_slice_has_no_nans() -> None:
    logits, targets, allowed = _case(1)
    allowed[4] = False  # this rank's whole slice masked for row 4 (another rank owns its target)
    local_target = targets.clone()
    local_target[4] = -1
    m, s, picked = logprob_row_stats(logits, local_target, 0.9, allowed, block=BLOCK)
    assert m[4] == float("-inf") and s[4] == 0 and picked[4] == 0
    assert not torch.isnan(m).any() and not torch.isnan(s).any() and not torch.isnan(picked).any()


@pytest.mark.unit
@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.6, True)])
def test_grad_kernel(temperature: float, masked: bool) -> None:
    logits, targets, allowed = _case(2)
    mask = allowed if masked else None
    local_target = targets.clone()
    local_target[5] = 1000  # not owned: no one-hot term on this row
    x = (logits / temperature).masked_fill(~mask, float("-inf")) if masked else logits / temperature
    log_z = x.logsumexp(-1)
    grad = torch.linspace(-1.0, 2.0, logits.shape[0], device=DEVICE)
    out = logprob_grad(logits, local_target, log_z, grad, temperature, mask, block=BLOCK)
    owned = (local_target >= 0) & (local_target < logits.shape[1])
    onehot = torch.zeros_like(logits)
    onehot[owned, local_target[owned]] = 1.0
    ref = (onehot - (x - log_z[:, None]).exp()) * (grad / temperature)[:, None]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)


def _logprobs_and_grad(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       allowed: torch.Tensor | None, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.clone().requires_grad_(True)
    out = vocab_parallel_logprobs(x, targets, None, temperature, allowed, use_triton=use_triton)
    weights = torch.linspace(0.5, 1.5, logits.shape[0], device=DEVICE)
    (out * weights).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.unit
@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.7, True), (1.5, True)])
def test_fused_path_matches_torch_path(temperature: float, masked: bool) -> None:
    logits, targets, allowed = _case(3)
    mask = allowed if masked else None
    out, grad = _logprobs_and_grad(logits, targets, temperature, mask, use_triton=True)
    ref_out, ref_grad = _logprobs_and_grad(logits, targets, temperature, mask, use_triton=False)
    scaled = logits / temperature
    if masked:
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    exact = scaled.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out, exact, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_path_half_precision_logits(dtype: torch.dtype) -> None:
    """16-bit logits: statistics in float32, gradient returned in the logits' dtype; values match the
    torch path to float32 rounding, gradients to one rounding of the 16-bit result."""
    logits, targets, allowed = _case(4)
    half = logits.to(dtype)
    out, grad = _logprobs_and_grad(half, targets, 0.8, allowed, use_triton=True)
    ref_out, ref_grad = _logprobs_and_grad(half, targets, 0.8, allowed, use_triton=False)
    assert grad.dtype == dtype
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-3, rtol=1e-2)


@pytest.mark.unit
def test_token_logprobs_passes_use_triton() -> None:
    logits, tokens, _ = _case(5)
    cu = torch.tensor([0, 3, 8], device=DEVICE)
    fused = token_logprobs(logits, tokens, cu, None, 0.9, use_triton=True)
    torch.testing.assert_close(fused, token_logprobs(logits, tokens, cu, None, 0.9, use_triton=False),
                               atol=ATOL, rtol=1e-5)


def _emulated_tp2(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                  allowed: torch.Tensor) -> torch.Tensor:
    """Per-shard kernel statistics combined like combine_row_stats does across a tp=2 group."""
    V_local = logits.shape[1] // 2
    stats = [logprob_row_stats(logits[:, r * V_local:(r + 1) * V_local].contiguous(), targets - r * V_local,
                               temperature, allowed[:, r * V_local:(r + 1) * V_local].contiguous(), block=BLOCK)
             for r in range(2)]
    m = torch.stack([st[0] for st in stats])  # [2, T]
    s = torch.stack([st[1] for st in stats])
    row_max = m.max(0).values  # all-reduce MAX
    total = (s * (m - row_max).exp()).sum(0)  # all-reduce SUM of s * exp(m - M)
    picked = torch.stack([st[2] for st in stats]).sum(0)  # all-reduce SUM
    assert not torch.isnan(total).any()
    return picked - (row_max + total.log())


@pytest.mark.unit
def test_tp2_emulation_matches_full_vocab() -> None:
    logits, targets, allowed = _case(6)
    assert not allowed[0, 150:].any() and not allowed[1, :150].any()  # a shard fully masked on rows 0, 1
    out = _emulated_tp2(logits, targets, 0.8, allowed)
    ref = (logits / 0.8).masked_fill(~allowed, float("-inf")).log_softmax(-1)
    torch.testing.assert_close(out, ref.gather(-1, targets[:, None]).squeeze(-1), atol=ATOL, rtol=1e-5)
    # combine_row_stats with no group is the serial log-sum-exp of one shard's statistics.
    m, s, picked = logprob_row_stats(logits, targets, 0.8, allowed, block=BLOCK)
    picked, log_z = combine_row_stats(m, s, picked, None)
    torch.testing.assert_close(picked - log_z, ref.gather(-1, targets[:, None]).squeeze(-1), atol=ATOL, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("use_triton", [False, True])
def test_nothing_saved_without_grad(use_triton: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference (no_grad, or logits that need no grad) skips probs/saving on both paths."""
    name = "_fused_forward" if use_triton else "_torch_forward"
    original = getattr(logprobs_mod, name)
    seen: list[bool] = []

    def spy(*args: object) -> torch.Tensor:
        seen.append(bool(args[-1]))
        return original(*args)

    monkeypatch.setattr(logprobs_mod, name, spy)
    logits, targets, _ = _case(7)
    x = logits.clone().requires_grad_(True)
    with torch.no_grad():
        vocab_parallel_logprobs(x, targets, use_triton=use_triton)
    vocab_parallel_logprobs(logits, targets, use_triton=use_triton)
    vocab_parallel_logprobs(x, targets, use_triton=use_triton).sum().backward()
    assert seen == [False, False, True]


def fused_tp_worker(rank: int, world_size: int) -> int:
    """vocab_parallel_logprobs with the fused kernels on a real tp group, against the full vocab."""
    groups = build_parallel_groups(Layout(tp=world_size))
    assert groups is not None
    logits, targets, allowed = _case(8)
    V_local = logits.shape[1] // world_size
    cols = slice(rank * V_local, (rank + 1) * V_local)
    weights = torch.linspace(0.5, 1.5, logits.shape[0])
    for mask in (None, allowed):
        shard = logits[:, cols].clone().requires_grad_(True)
        out = vocab_parallel_logprobs(shard, targets, groups.tp_group, 0.7,
                                      None if mask is None else mask[:, cols].contiguous(), use_triton=True)
        (out * weights).sum().backward()
        full = logits.clone().requires_grad_(True)
        scaled = full / 0.7 if mask is None else (full / 0.7).masked_fill(~mask, float("-inf"))
        ref = scaled.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        (ref * weights).sum().backward()
        assert full.grad is not None
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(shard.grad, full.grad[:, cols], atol=ATOL, rtol=1e-5)
    return rank


@pytest.mark.dist
@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo world on CPU tensors")
def test_fused_logprobs_tp2_gloo() -> None:
    assert run_distributed(fused_tp_worker, 2) == [0, 1]
