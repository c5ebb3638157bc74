"""The compiled, cached per-rank reallocation program (actors.realloc.program
`compile_rank_program`, used by actors.realloc.executor): its byte counts, buffers and views agree with
the plan; the destination shards are views of one flat buffer, received straight into where the
layout allows; repeated executions of one plan object reuse the program and stay exact with fresh
source tensors, also for source shards that are non-contiguous, require grad or need a cast.
"""

from __future__ import annotations

import pytest
import torch

import actors.realloc.cache as realloc_cache
from actors.kernels.switch import triton_runs
from actors.realloc.executor import ReallocGroups, execute_reallocation
from actors.realloc.program import ALIGN_BYTES, RankMessage, RankProgram, compile_rank_program
from actors.realloc.schedule import build_schedule, destination_slices, source_offsets
from planning.layout import Layout, Mesh
from planning.models import ModelSpec, param_specs
from planning.plan import Placement
from planning.realloc_plan import ReallocPlan, plan_reallocation, rank_params
from tests.dist_harness import run_distributed

GPN = 2
KERNELS = triton_runs("cpu") or None  # the copy kernel where Triton can run on CPU, else the default
SPEC = ModelSpec("tiny-program", "llama", 64, 32, 64, 3, 4, 2, 8)


def _p(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, GPN), Layout.parse(layout))


PAIRS = [(_p(0, 1, "tp1"), _p(0, 2, "tp2")), (_p(0, 2, "tp2"), _p(0, 2, "pp2")), (_p(0, 2, "pp2"), _p(1, 1, "tp1")),
         (_p(0, 1, "tp1"), _p(1, 1, "tp1"))]


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
    shapes = {k: tuple(v.shape) for k, v in _shards(src, rank, _full(0)).items()}
    schedule = build_schedule(plan, 4, bucket_bytes, 64)
    return compile_rank_program(schedule, plan, rank, source_offsets(plan, rank, shapes), shapes, 4)


def _check_message(m: RankMessage, flat_numel: int) -> None:
    assert sum(m.sizes) == m.numel and all(n > 0 for n in m.sizes)
    if m.send:
        # Cat runs write the segments back to back, covering the buffer exactly once.
        assert [r.offset for r in m.runs] == [sum(r.numel for r in m.runs[:i]) for i in range(len(m.runs))]
        assert sum(r.numel for r in m.runs) == m.numel and sum(len(r.sources) for r in m.runs) == len(m.sizes)
        for r in m.runs:
            assert torch.empty(r.shape).stride() == r.stride
            assert all(length > 0 for v in r.sources for _, _, length in v.narrows)
    elif m.direct is not None:
        assert 0 <= m.direct and m.direct + m.numel <= flat_numel and not (m.dense or m.strided)
    else:  # unpacked: every segment exactly once, inside the flat buffer
        assert sorted(k for k, _ in m.dense + m.strided) == list(range(len(m.sizes)))
        for k, v in m.dense + m.strided:
            assert torch.Size(v.shape).numel() == m.sizes[k] and v.offset >= 0
            assert v.offset + sum((s - 1) * st for s, st in zip(v.shape, v.stride)) < flat_numel


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
        held = destination_slices(plan, rank)
        assert dict(program.out_shapes) == {n: s.shard_shape(shape) for n, (shape, s) in held.items()}
        # The destination shards tile the flat buffer in order, aligned, without overlapping.
        end = 0
        for shape, stride, offset in program.out_views:
            assert offset >= end and offset % (ALIGN_BYTES // 4) == 0 and torch.empty(shape).stride() == stride
            end = offset + torch.Size(shape).numel()
        assert end == program.flat_numel
        for messages in program.p2p_rounds:
            assert sum(m.numel for m in messages if m.staged) <= program.staging_half <= program.staging_half_all
            for m in messages:
                _check_message(m, program.flat_numel)
        for m in program.broadcasts:
            _check_message(m, program.flat_numel)


@pytest.mark.unit
def test_whole_tensors_need_no_views_and_land_in_place() -> None:
    # tp1 -> tp1 on another GPU moves whole tensors: no view needs a narrow (unless a tiny bucket
    # splits them into rows), and every message is received straight into the destination buffer
    # (nothing to stage or unpack), row-split tensors included.
    plan = plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(1, 1, "tp1"))
    for bucket_bytes in (512, 256 * 1024**2):
        sender, receiver = (_program(plan, _p(0, 1, "tp1"), rank, bucket_bytes) for rank in (0, 1))
        views = [v for ms in sender.p2p_rounds for m in ms for r in m.runs for v in r.sources]
        assert views and all(v.narrows == () and v.key is None for v in views) == (bucket_bytes > 512)
        received = [m for ms in receiver.p2p_rounds for m in ms]
        assert received and all(m.direct is not None for m in received) and receiver.staging_half == 0


@pytest.mark.unit
def test_split_source_shards_are_cut_once() -> None:
    # tp1 -> tp2 on GPU 0: every split parameter is cut in two (one half kept, one sent) by one
    # split per call; the views then need no narrows.
    plan = plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(0, 2, "tp2"))
    program = _program(plan, _p(0, 1, "tp1"), 0, 256 * 1024**2)
    split_params = {t.param for t in plan.transfers if t.piece.dim is not None}
    assert len(program.splits) == len(split_params) and all(len(sizes) == 2 for _, _, sizes in program.splits)
    views = [v for r in program.local_runs for v in r.sources] + [v for p in program.local_pairs for v in p.src]
    views += [v for ms in program.p2p_rounds for m in ms for r in m.runs for v in r.sources]
    assert views and all(v.narrows == () for v in views)


@pytest.mark.unit
def test_outputs_are_views_of_one_buffer_and_programs_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    # dp2 -> tp1 on GPU 1 is all local: runs in one process without a process group.
    plan = plan_reallocation(SPEC, False, _p(0, 2, "dp2"), _p(1, 1, "tp1"))
    compiled: list[RankProgram] = []
    original = realloc_cache.compile_rank_program

    def counting(*args: object) -> RankProgram:
        compiled.append(original(*args))  # type: ignore[arg-type]
        return compiled[-1]

    monkeypatch.setattr(realloc_cache, "compile_rank_program", counting)
    for seed in (1, 2, 3):
        full = _full(seed)
        out, _ = execute_reallocation(plan, 1, _shards(_p(0, 2, "dp2"), 1, full), ReallocGroups(), "cpu", torch.float32)
        assert sorted(out) == sorted(full) and all(torch.equal(out[k], v) for k, v in full.items())
        assert len({t.untyped_storage().data_ptr() for t in out.values()}) == 1
        assert all(t.is_contiguous() and not t.requires_grad and not t.is_inference() for t in out.values())
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in out.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two shards overlap
        out["model.norm.weight"].add_(1.0)  # the shards are ordinary tensors, writable in place
    assert len(compiled) == 1  # the second and third calls reused the compiled program
    # The same shards in another order (views index them by position) compile anew, still exact.
    full = _full(4)
    reordered = dict(reversed(list(_shards(_p(0, 2, "dp2"), 1, full).items())))
    out, _ = execute_reallocation(plan, 1, reordered, ReallocGroups(), "cpu", torch.float32)
    assert len(compiled) == 2 and all(torch.equal(out[k], v) for k, v in full.items())
    # Other source shapes are checked against the plan before anything moves.
    wrong = {k: v[:, :4] if v.dim() == 2 else v for k, v in reordered.items()}
    with pytest.raises(ValueError, match="has shape"):
        execute_reallocation(plan, 1, wrong, ReallocGroups(), "cpu", torch.float32)


def _sources(kind: str, src: Placement, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shards = _shards(src, rank, full)
    if kind == "strided":  # same values, non-contiguous storage (transposed copies)
        return {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in shards.items()}
    if kind == "grad":
        return {k: torch.nn.Parameter(v) for k, v in shards.items()}
    return shards


def _repeat(rank: int, world_size: int) -> int:
    """Run each plan object several times with fresh source values; every result must be exact."""
    torch.set_num_threads(1)
    groups = ReallocGroups()
    checked = 0
    for src, dst in PAIRS:
        plan = plan_reallocation(SPEC, False, src, dst)
        links = plan.bytes_per_link(dtype_bytes=4)
        for bucket_bytes in (512, 256 * 1024**2):
            # The 2nd and later calls reuse the cached program; the copy kernel (Triton's interpreter)
            # re-resolves its tables for each call's fresh source tensors.
            for seed, kernels in ((1, False), (2, False), (3, KERNELS), (4, KERNELS)):
                full = _full(seed)
                out, stats = execute_reallocation(plan, rank, _shards(src, rank, full), groups, "cpu", torch.float32,
                                                  bucket_bytes, 64, copy_kernels=kernels)
                expected = _shards(dst, rank, full)
                assert sorted(out) == sorted(expected), (src, dst, rank)
                for name, tensor in expected.items():
                    assert torch.equal(out[name], tensor), (src, dst, bucket_bytes, seed, rank, name)
                assert stats.total_sent == sum(v for (s, _), v in links.items() if s == rank)
                checked += len(expected)
            for kind in ("strided", "grad", "cast"):
                full = _full(7)
                dtype = torch.bfloat16 if kind == "cast" else torch.float32
                out, _ = execute_reallocation(plan, rank, _sources(kind, src, rank, full), groups, "cpu", dtype,
                                              bucket_bytes, 64)
                for name, tensor in _shards(dst, rank, full).items():
                    assert torch.equal(out[name], tensor.to(dtype)), (kind, src, dst, bucket_bytes, rank, name)
                    assert not out[name].requires_grad
    return checked


@pytest.mark.dist
def test_repeated_reallocations_stay_exact() -> None:
    checked = run_distributed(_repeat, GPN)
    assert all(n > 0 for n in checked)
