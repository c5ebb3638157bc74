"""Shared pytest setup: tier markers and skipping of the gpu tier where there is no CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter (numpy on CPU), so their tests check the
# same kernel code the GPU compiles. It must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
