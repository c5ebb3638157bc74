"""Which attention kernel `resolve_backend` picks: flash-attn when installed on CUDA in half precision,
then torch's varlen_attn, else SDPA; a forced kernel that cannot run is an error naming why."""

from __future__ import annotations

import pytest
import torch

from actors.engine import attention

pytestmark = pytest.mark.unit
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(("flash", "varlen", "device", "dtype", "expected"), [
    (True, True, CUDA, torch.bfloat16, "flash"),
    (False, True, CUDA, torch.bfloat16, "varlen"),
    (False, False, CUDA, torch.float16, "sdpa"),
    (True, True, CUDA, torch.float32, "sdpa"),   # the fused kernels take fp16/bf16 only
    (True, True, CPU, torch.bfloat16, "sdpa"),
])
def test_auto_selection(monkeypatch: pytest.MonkeyPatch, flash: bool, varlen: bool, device: torch.device,
                        dtype: torch.dtype, expected: str) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: flash)
    monkeypatch.setattr(attention, "varlen_attn_available", lambda: varlen)
    assert attention.resolve_backend("auto", device, dtype) == expected


def test_forced_backend_that_cannot_run_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match="attention backend 'flash': needs CUDA.*installed=False"):
        attention.resolve_backend("flash", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown; allowed: auto, varlen, flash, sdpa"):
        attention.resolve_backend("xformers", CPU, torch.float32)
    assert attention.resolve_backend("sdpa", CUDA, torch.bfloat16) == "sdpa"


def test_kernel_packages_are_looked_up_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # resolve_backend runs for every layer of every micro-batch; a find_spec scan of sys.path
    # each time cost ~60 us an attention call on CUDA.
    looked_up: list[str] = []
    real_find_spec = attention.importlib.util.find_spec

    def counting_find_spec(name: str, *args: object) -> object:
        looked_up.append(name)
        return real_find_spec(name, *args)

    monkeypatch.setattr(attention.importlib.util, "find_spec", counting_find_spec)
    attention.flash_attn_available.cache_clear()
    attention.varlen_attn_available.cache_clear()
    try:
        picks = {attention.resolve_backend("auto", CUDA, torch.bfloat16) for _ in range(16)}
    finally:
        attention.flash_attn_available.cache_clear()
        attention.varlen_attn_available.cache_clear()
    assert len(picks) == 1
    assert sorted(set(looked_up)) == sorted(looked_up)  # each package at most once
    assert "flash_attn" in looked_up
