"""Worker environment: the defaults every worker gets, and the allocator setting the user may override."""

from __future__ import annotations

import pytest

from cluster.placement import ALLOCATOR_ENV_VAR, DEFAULT_ALLOCATOR_CONF, DEFAULT_WORKER_ENV_VARS, worker_env_vars

pytestmark = pytest.mark.unit


def test_workers_get_expandable_segments_unless_the_user_set_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOCATOR_ENV_VAR, raising=False)
    env = worker_env_vars({"OMP_NUM_THREADS": "1"})
    assert env[ALLOCATOR_ENV_VAR] == DEFAULT_ALLOCATOR_CONF == "expandable_segments:True"
    assert env["OMP_NUM_THREADS"] == "1" and all(env[k] == v for k, v in DEFAULT_WORKER_ENV_VARS.items())
    monkeypatch.setenv(ALLOCATOR_ENV_VAR, "max_split_size_mb:128")  # the user's choice travels to the workers
    assert worker_env_vars()[ALLOCATOR_ENV_VAR] == "max_split_size_mb:128"
    assert worker_env_vars({ALLOCATOR_ENV_VAR: "backend:native"})[ALLOCATOR_ENV_VAR] == "backend:native"
