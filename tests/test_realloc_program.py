"""The compiled, cached per-rank reallocation program (actors/realloc_schedule.py
`compile_rank_program`, used by actors/realloc.py): its byte counts and views agree with the plan,
and repeated executions of one plan object (cache hits) stay exact with fresh source tensors.
"""

from __future__ import annotations

import pytest
import torch

from actors.realloc import ReallocGroups, execute_reallocation
from actors.realloc_schedule import RankProgram, build_schedule, compile_rank_program, destination_slices
from planning.layout import Layout, Mesh
from planning.models import ModelSpec, param_specs
from planning.plan import Placement
from planning.realloc_plan import ReallocPlan, Transfer, plan_reallocation, rank_params
from tests.dist_harness import run_distributed

GPN = 2
SPEC = ModelSpec("tiny-program", "llama", 64, 32, 64, 3, 4, 2, 8)


def _p(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, GPN), Layout.parse(layout))


PAIRS = [(_p(0, 1, "tp1"), _p(0, 2, "tp2")), (_p(0, 2, "tp2"), _p(0, 2, "pp2")), (_p(0, 2, "pp2"), _p(1, 1, "tp1"))]


def _full(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=gen) for p in param_specs(SPEC)}


def _shards(placement: Placement, gpu: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if gpu not in placement.mesh.gpus:
        return {}
    out = {}
    for p, piece in rank_params(SPEC, False, placement, gpu - placement.mesh.start):
        t = full[p.name]
        out[p.name] = (t if piece.dim is None else t.narrow(piece.dim, piece.start, piece.stop - piece.start)).clone()
    return out


def _program(plan: ReallocPlan, src: Placement, rank: int, bucket_bytes: int) -> RankProgram:
    full = _full(0)
    shards = _shards(src, rank, full)
    shapes = {k: tuple(v.shape) for k, v in shards.items()}
    # Source shards of these layouts start at piece.start rounded down to a shard's extent.
    offsets: dict[Transfer, int] = {}
    for t in plan.transfers:
        if t.src_gpu == rank:
            dim = t.piece.dim
            extent = None if dim is None else shapes[t.param][dim]
            offsets[t] = 0 if dim is None else (t.piece.start // extent) * extent
    schedule = build_schedule(plan, 4, bucket_bytes, 64)
    return compile_rank_program(schedule, plan, rank, offsets, shapes)


@pytest.mark.unit
@pytest.mark.parametrize("bucket_bytes", [512, 256 * 1024**2])
@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_program_bytes_and_buffers_agree_with_plan(pair: int, bucket_bytes: int) -> None:
    src, dst = PAIRS[pair]
    plan = plan_reallocation(SPEC, False, src, dst)
    links = plan.bytes_per_link(dtype_bytes=4)
    for rank in range(GPN):
        program = _program(plan, src, rank, bucket_bytes)
        assert {(rank, r): n * 4 for r, n in program.bytes_sent} == {k: v for k, v in links.items() if k[0] == rank}
        assert {(s, rank): n * 4 for s, n in program.bytes_received} == {k: v for k, v in links.items() if k[1] == rank}
        assert program.local_numel * 4 == sum(t.numel * 4 for t in plan.transfers if t.is_local and t.src_gpu == rank)
        assert dict(program.out_shapes) == {n: s.shard_shape(shape) for n, (shape, s) in destination_slices(plan, rank).items()}
        for messages in program.p2p_rounds:
            assert sum(m.numel for m in messages) <= program.staging_half
            for m in messages:
                # Segments lie back to back in the packed buffer, in order.
                sizes = [torch.Size(v.shape).numel() for v in m.views]
                assert list(m.offsets) == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == m.numel
                for v in m.views:
                    assert torch.empty(v.shape).stride() == v.packed_stride
                    assert all(length > 0 for _, _, length in v.narrows)


@pytest.mark.unit
def test_whole_tensor_views_have_no_narrows() -> None:
    # tp1 -> tp1 on another GPU moves whole tensors: no view needs a narrow on either side.
    plan = plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(1, 1, "tp1"))
    for rank in range(GPN):
        program = _program(plan, _p(0, 1, "tp1"), rank, 256 * 1024**2)
        views = [v for ms in program.p2p_rounds for m in ms for v in m.views]
        assert views and all(v.narrows == () for v in views)


def _repeat(rank: int, world_size: int) -> int:
    """Run each plan object several times with fresh source values; every result must be exact."""
    torch.set_num_threads(1)
    groups = ReallocGroups()
    checked = 0
    for src, dst in PAIRS:
        plan = plan_reallocation(SPEC, False, src, dst)
        for bucket_bytes in (512, 256 * 1024**2):
            for seed in (1, 2, 3):  # the 2nd and 3rd calls reuse the cached program
                full = _full(seed)
                out, stats = execute_reallocation(plan, rank, _shards(src, rank, full), groups, "cpu", torch.float32,
                                                  bucket_bytes, 64)
                expected = _shards(dst, rank, full)
                assert sorted(out) == sorted(expected), (src, dst, rank)
                for name, tensor in expected.items():
                    assert torch.equal(out[name], tensor), (src, dst, bucket_bytes, seed, rank, name)
                links = plan.bytes_per_link(dtype_bytes=4)
                assert stats.total_sent == sum(v for (s, _), v in links.items() if s == rank)
                checked += len(expected)
    return checked


@pytest.mark.dist
def test_repeated_reallocations_stay_exact() -> None:
    checked = run_distributed(_repeat, GPN)
    assert all(n > 0 for n in checked)
