"""The one local Ray instance the ray-tier tests share (import `ray_session` into a test module).

Ray starts once per pytest session with 2 CPUs and 4 virtual GPUs, no dashboard (it costs
seconds), and is shut down when the session ends. Workers get the repository root and tests/ on
PYTHONPATH, so classes defined in test modules and our packages import inside them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

RAY_TEST_CPUS = 2
RAY_TEST_GPUS = 4
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """Local Ray with virtual GPUs for the whole test session (reused if already running)."""
    started_here = not ray.is_initialized()
    if started_here:
        search_path = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])
        # address="local": always a fresh instance, never a cluster someone started with `ray start`.
        ray.init(
            address="local",
            num_cpus=RAY_TEST_CPUS,
            num_gpus=RAY_TEST_GPUS,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": search_path.rstrip(os.pathsep)}},
        )
    yield
    if started_here:
        ray.shutdown()
