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


__all__ = ["triton_installed", "triton_interpreting", "triton_on", "triton_runs"]
