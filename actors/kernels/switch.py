"""When the hand-written Triton kernels of actors/ run, and how their tests run them on CPU.

Kernels (decode attention, fused sampling, fused logprobs) are optional fast paths for CUDA: every
one has a plain-torch twin that is the reference and the CPU path. `triton_on(device)` is the
single switch the callers use: True on a CUDA device when `triton` imports. On CPU the kernels run
only when a caller asks for them explicitly and Triton's interpreter is on (TRITON_INTERPRET=1 set
before triton is imported; tests/conftest.py does this where there is no CUDA), so the tests
check the same kernel source the GPU compiles, against the torch twin.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_installed() -> bool:
    """Whether the `triton` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (numpy on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_installed()


def triton_on(device: torch.device | str) -> bool:
    """Whether the Triton fast paths run by default for tensors on `device`: CUDA with triton."""
    return torch.device(device).type == "cuda" and triton_installed() and not triton_interpreting()


def triton_runs(device: torch.device | str) -> bool:
    """Whether a kernel launched explicitly can run for tensors on `device` (CUDA, or CPU under
    the interpreter); callers that are asked for a Triton kernel check this and fail clearly."""
    kind = torch.device(device).type
    return (kind == "cuda" and triton_installed()) or (kind == "cpu" and triton_interpreting())


# e4m3 (float8_e4m3fn, Triton's fp8e4nv) in hardware: compute capability 8.9 (Ada) and later. Below
# it Triton refuses the type in any kernel ("type fp8e4nv not supported in this architecture") and
# torch._scaled_mm has no FP8 path; torch's own casts still work there (in software).
E4M3_MIN_CAPABILITY = (8, 9)


def e4m3_native(device: torch.device | str) -> bool:
    """Whether `device` handles e4m3 natively: CUDA of compute capability >= 8.9. On the CPU
    torch (and Triton's interpreter) emulate it; other CUDA GPUs lack it."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= E4M3_MIN_CAPABILITY


def triton_reads_e4m3(device: torch.device | str) -> bool:
    """Whether a Triton kernel may load e4m3 tensors on `device`: the interpreter (CPU) can, CUDA
    only from compute capability 8.9."""
    return torch.device(device).type != "cuda" or e4m3_native(device)


__all__ = ["E4M3_MIN_CAPABILITY", "e4m3_native", "triton_installed", "triton_interpreting", "triton_on",
           "triton_reads_e4m3", "triton_runs"]
