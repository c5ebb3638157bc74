"""Reallocation on two GPUs over NCCL (gpu tier: run on the device, skipped elsewhere): every path
of the executor (pull over CUDA IPC, NCCL rounds with the copy kernel, NCCL rounds with torch
copies) gives exactly the destination slices of the full model for the test pairs and a
replication (tp1 on GPU 0 -> dp2 on both), in fp32 and bf16, also when the same plan runs again
with new source tensors (the pull path maps them anew); and the same again where each process
sees only its own GPU, as under Ray (the peers' shards are then mapped from a GPU the process
cannot name).
"""

from __future__ import annotations

import pytest
import torch

from actors.realloc.executor import ReallocGroups, broadcast_groups, execute_reallocation
from actors.realloc.pull import pull_group
from planning.realloc_plan import plan_reallocation
from tests.actors.realloc.test_program import PAIRS, SPEC, _full, _p, _shards
from tests.dist_harness import run_distributed

PATHS = {"pull": {"pull": True}, "nccl+kernel": {"pull": False, "copy_kernels": True},
         "nccl+torch": {"pull": False, "copy_kernels": False}}


def _moves(rank: int, world_size: int, one_gpu_each: bool = False) -> list[str]:
    device = torch.device("cuda", 0 if one_gpu_each else rank)
    if one_gpu_each:
        assert torch.cuda.device_count() == 1, "the harness should leave each rank only its own GPU"
    groups = ReallocGroups()
    checked = []
    for src, dst in PAIRS + [(_p(0, 1, "tp1"), _p(0, 2, "dp2"))]:
        plan = plan_reallocation(SPEC, False, src, dst)
        groups.ensure(broadcast_groups(plan) + ((pull_group(plan),) if pull_group(plan) else ()))
        for name, options in PATHS.items():
            for seed in (1, 2):  # new source tensors each time
                for dtype in (torch.float32, torch.bfloat16):
                    full = {k: v.to(dtype) for k, v in _full(seed).items()}
                    shards = {k: v.to(device) for k, v in _shards(src, rank, full).items()}
                    out, _ = execute_reallocation(plan, rank, shards, groups, device, dtype, **options)
                    expected = _shards(dst, rank, full)
                    assert sorted(out) == sorted(expected), (name, src, dst, rank)
                    for key, tensor in expected.items():
                        assert torch.equal(out[key].cpu(), tensor), (name, src, dst, seed, dtype, rank, key)
            checked.append(f"{src.mesh}/{src.layout}->{dst.mesh}/{dst.layout} {name}")
    return checked


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("one_gpu_each", [False, True], ids=["both-visible", "one-visible-gpu-per-process"])
def test_every_path_is_exact_on_two_gpus(one_gpu_each: bool) -> None:
    # one_gpu_each: each process sees only its own GPU, as Ray starts a GPU actor.
    results = run_distributed(_moves, 2, one_gpu_each, backend="nccl", timeout_s=300, one_gpu_each=one_gpu_each)
    assert results[0] == results[1] and len(results[0]) == 3 * (len(PAIRS) + 1)
