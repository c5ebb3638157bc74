"""The multi-copy kernel of actors.kernels.segment_copy and the reallocation tables built for it
(actors.realloc.copies): the kernel (Triton's interpreter on CPU) makes exactly the copies of
its torch reference, for copies out of several source tensors, dense and strided, aligned or not;
every reallocation program of the test pairs fits the kernel, and the executor's kernel path is
exact and refuses inputs it cannot take.
"""

from __future__ import annotations

import pytest
import torch

from actors.kernels.segment_copy import (
    BLOCK_C,
    BLOCK_R,
    Copy2D,
    CopyTable,
    copy_reference,
    resolve_fields,
    source_deltas,
)
from actors.kernels.switch import triton_runs
from actors.realloc.cache import PROGRAMS, PULLS
from actors.realloc.copies import compile_copy_tables, local_copies
from actors.realloc.executor import ReallocGroups, execute_reallocation, release_peer_mappings
from actors.realloc.program import compile_rank_program
from actors.realloc.pull import PeerSources, PullSession, pull_copies, pull_group
from actors.realloc.schedule import build_schedule, source_offsets
from planning.realloc_plan import plan_reallocation
from tests.actors.realloc.test_program import PAIRS, SPEC, _full, _p, _shards

needs_triton = pytest.mark.skipif(not triton_runs("cpu"), reason="Triton's interpreter is not available")


def _random_copies(gen: torch.Generator, sources: list[torch.Tensor], dst_numel: int, n: int) -> list[Copy2D]:
    """Copies to disjoint places of the destination, from random blocks of random sources."""
    copies, at = [], 0
    for _ in range(n):
        src = int(torch.randint(len(sources), (1,), generator=gen))
        total = sources[src].numel()
        cols = int(torch.randint(1, 2 * BLOCK_C + 3, (1,), generator=gen))
        src_stride = cols + int(torch.randint(0, 9, (1,), generator=gen))
        rows = max(1, min(int(torch.randint(1, 3 * BLOCK_R, (1,), generator=gen)), (total - cols) // src_stride))
        dst_stride = cols + int(torch.randint(0, 5, (1,), generator=gen))
        src_offset = int(torch.randint(0, total - ((rows - 1) * src_stride + cols) + 1, (1,), generator=gen))
        if at + rows * dst_stride > dst_numel:
            break
        copies.append(Copy2D(src, src_offset, at, rows, cols, src_stride, dst_stride))
        at += rows * dst_stride
    return copies


@needs_triton
@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype: torch.dtype) -> None:
    from actors.kernels.segment_copy import launch_copies  # noqa: PLC0415 (needs triton)

    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=gen).to(dtype) for n in (5000, 12000, 700)]
    copies = _random_copies(gen, sources, 40000, 12)
    copies.append(Copy2D(1, 0, 39000, 1, 900, 900, 900))  # contiguous: re-cut into full rows
    table = CopyTable.build(copies, sources[0].element_size())
    assert table.n > len(copies) - 1 and table.tiles > table.n
    want = torch.zeros(40000, dtype=dtype)
    copy_reference(table, sources, want)
    got = torch.zeros(40000, dtype=dtype)
    fields = torch.from_numpy(resolve_fields(table, source_deltas(sources)).reshape(-1))
    launch_copies(table, fields, torch.from_numpy(table.tile_start), sources[0], got, aligned=False, programs=5)
    assert torch.equal(got, want) and int((want != 0).sum()) > 10000


@pytest.mark.unit
def test_dense_copies_are_recut_and_unaligned_tables_say_so() -> None:
    table = CopyTable.build([Copy2D(0, 0, 0, 4, 300, 300, 300), Copy2D(0, 3, 2000, 2, 8, 8, 16)], 4)
    # 1200 contiguous elements: 4 rows of 256 and a tail of 176; the strided copy stays as is.
    assert table.fields[:, 2:4].tolist() == [[4, 256], [1, 176], [2, 8]]
    assert table.tile_start[:3].tolist() == [0, 1, 2] and table.tiles == 3 and not table.aligned


@pytest.mark.unit
@pytest.mark.parametrize("pair", range(len(PAIRS)))
@pytest.mark.parametrize("bucket_bytes", [512, 256 * 1024**2])
def test_every_test_program_fits_the_kernel(pair: int, bucket_bytes: int) -> None:
    src, dst = PAIRS[pair]
    plan = plan_reallocation(SPEC, False, src, dst)
    for rank in range(2):
        shards = _shards(src, rank, _full(0))
        shapes = {k: tuple(v.shape) for k, v in shards.items()}
        program = compile_rank_program(build_schedule(plan, 4, bucket_bytes, 64), plan, rank,
                                       source_offsets(plan, rank, shapes), shapes, 4)
        tables = compile_copy_tables(program, list(shapes.values()), 4)
        assert tables is not None and len(tables.rounds) == len(program.p2p_rounds)
        for rnd, messages in zip(tables.rounds, program.p2p_rounds):
            assert len(rnd.buffers) == len(messages)
            assert rnd.staged >= sum(m.numel for m in messages if m.staged)


@needs_triton
@pytest.mark.unit
def test_executor_kernel_path_is_exact_and_checks_its_inputs() -> None:
    # dp2 -> tp1 on GPU 1 is all local copies: one process, no process group.
    plan = plan_reallocation(SPEC, False, _p(0, 2, "dp2"), _p(1, 1, "tp1"))
    full = _full(5)
    out, _ = execute_reallocation(plan, 1, _shards(_p(0, 2, "dp2"), 1, full), ReallocGroups(), "cpu", torch.float32,
                                  copy_kernels=True)
    assert sorted(out) == sorted(full) and all(torch.equal(out[k], v) for k, v in full.items())
    strided = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in _shards(_p(0, 2, "dp2"), 1, full).items()}
    with pytest.raises(ValueError, match="contiguous"):
        execute_reallocation(plan, 1, strided, ReallocGroups(), "cpu", torch.float32, copy_kernels=True)
    out, _ = execute_reallocation(plan, 1, strided, ReallocGroups(), "cpu", torch.float32)  # torch copies
    assert all(torch.equal(out[k], v) for k, v in full.items())


@pytest.mark.unit
@pytest.mark.parametrize("pair", range(len(PAIRS)))
@pytest.mark.parametrize("bucket_bytes", [512, 256 * 1024**2])
def test_pull_copies_rebuild_the_destination(pair: int, bucket_bytes: int) -> None:
    # The pull path's table (local copies + reads from the peer's shards), applied by the torch
    # reference on CPU with the peer's shards as plain tensors: every destination shard exact.
    src, dst = PAIRS[pair]
    plan = plan_reallocation(SPEC, False, src, dst)
    full = _full(3)
    shards = {rank: _shards(src, rank, full) for rank in range(2)}
    schedule = build_schedule(plan, 4, bucket_bytes, 64)
    for rank in range(2):
        shapes = {k: tuple(v.shape) for k, v in shards[rank].items()}
        program = compile_rank_program(schedule, plan, rank, source_offsets(plan, rank, shapes), shapes, 4)
        peer = 1 - rank
        peers = {peer: PeerSources(len(shapes), tuple(shards[peer]), tuple(tuple(v.shape) for v in shards[peer].values()))}
        copies = local_copies(program, list(shapes.values())) + pull_copies(plan, schedule, program, rank, peers)
        flat = torch.full((program.flat_numel,), float("nan"))
        copy_reference(CopyTable.build(copies, 4), list(shards[rank].values()) + list(shards[peer].values()), flat)
        outs = {name: flat.as_strided(*view) for name, view in zip(program.out_names, program.out_views)}
        expected = _shards(dst, rank, full)
        assert sorted(outs) == sorted(expected), (rank, pair)
        assert all(torch.equal(outs[k], v) for k, v in expected.items()), (rank, pair)


@pytest.mark.unit
def test_pull_group_only_for_moves_between_gpus_of_one_node() -> None:
    assert pull_group(plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(0, 2, "tp2"))) == (0, 1)
    assert pull_group(plan_reallocation(SPEC, False, _p(0, 2, "tp2"), _p(0, 2, "pp2"))) == (0, 1)
    # All local (GPU 1 holds a full replica): nothing to pull, no group needed.
    assert pull_group(plan_reallocation(SPEC, False, _p(0, 2, "dp2"), _p(1, 1, "tp1"))) is None
    # From node 0 to node 1 (2 GPUs per node): CUDA IPC does not reach, NCCL moves it.
    assert pull_group(plan_reallocation(SPEC, False, _p(0, 2, "tp2"), _p(2, 2, "tp2"))) is None


@pytest.mark.unit
def test_release_peer_mappings_drops_every_pull_session() -> None:
    plan = plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(0, 2, "tp2"))
    shapes = {k: tuple(v.shape) for k, v in _shards(_p(0, 1, "tp1"), 0, _full(0)).items()}
    program, schedule = PROGRAMS.get(plan, 0, 4, (1024, 64, 0), _shards(_p(0, 1, "tp1"), 0, _full(0)))
    cpu = torch.device("cpu")

    def make() -> PullSession:
        return PullSession(plan, schedule, program, 0, tuple(shapes), cpu)

    session = PULLS.get(program, cpu, make)
    assert PULLS.get(program, cpu, make) is session  # kept
    release_peer_mappings()
    assert len(PULLS) == 0
    assert PULLS.get(program, cpu, make) is not session
    release_peer_mappings()
