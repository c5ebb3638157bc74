"""Properties of reallocation plans (planning/realloc_plan.py), checked on a grid of layouts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import ModelSpec, model_preset, param_specs
from planning.plan import Placement
from planning.realloc_plan import ShardSlice, plan_reallocation, rank_params, realloc_time_s

TINY = model_preset("tiny")  # 4 heads, 2 KV heads, 4 layers, tied=False
TIED = ModelSpec("tied", "llama", 64, 32, 64, 4, 4, 4, 8, tie_embeddings=True)


def _placements(gpus_per_node: int, n_gpus: int) -> list[Placement]:
    cluster = ClusterSpec(n_gpus // gpus_per_node, gpus_per_node, hardware_preset("cpu"))
    out = []
    for mesh in cluster.meshes:
        for layout in cluster.layouts_for(mesh):
            if layout.tp <= 2 and layout.pp <= 2:
                out.append(Placement(mesh, layout))
    return out


def _coverage(spec: ModelSpec, critic: bool, src: Placement, dst: Placement) -> None:
    """Every element of every destination shard is written exactly once, from a GPU holding it."""
    plan = plan_reallocation(spec, critic, src, dst)
    held: dict[tuple[int, str], ShardSlice] = {}
    for rank in range(src.layout.world_size):
        for p, piece in rank_params(spec, critic, src, rank):
            held[(src.gpu_of_rank(rank), p.name)] = piece
    written: dict[tuple[int, str], np.ndarray] = {}
    shapes = {p.name: p.shape for p in param_specs(spec, critic)}
    for rank in range(dst.layout.world_size):
        for p, piece in rank_params(spec, critic, dst, rank):
            written[(dst.gpu_of_rank(rank), p.name)] = np.zeros(p.shape, dtype=np.int32)
    for t in plan.transfers:
        src_piece = held[(t.src_gpu, t.param)]
        assert src_piece.intersect(t.piece) == t.piece or src_piece.dim is None, (t, src_piece)
        for d in t.dst_gpus:
            counts = written[(d, t.param)]
            idx = [slice(None)] * len(shapes[t.param])
            if t.piece.dim is not None:
                idx[t.piece.dim] = slice(t.piece.start, t.piece.stop)
            counts[tuple(idx)] += 1
    for rank in range(dst.layout.world_size):
        gpu = dst.gpu_of_rank(rank)
        for p, piece in rank_params(spec, critic, dst, rank):
            counts = written[(gpu, p.name)]
            idx = [slice(None)] * len(p.shape)
            if piece.dim is not None:
                idx[piece.dim] = slice(piece.start, piece.stop)
            inside = counts[tuple(idx)]
            assert (inside == 1).all(), f"{p.name} on GPU {gpu}: {src.layout}->{dst.layout} coverage {np.unique(inside)}"
            assert counts.sum() == inside.sum(), f"{p.name} on GPU {gpu}: bytes outside its shard"


@pytest.mark.unit
@pytest.mark.parametrize("spec,critic", [(TINY, False), (TINY, True), (TIED, False)])
def test_every_destination_element_covered_once(spec: ModelSpec, critic: bool) -> None:
    places = _placements(2, 4)
    for src, dst in itertools.product(places, places):
        _coverage(spec, critic, src, dst)


@pytest.mark.unit
def test_identical_placement_moves_nothing() -> None:
    for p in _placements(2, 4):
        plan = plan_reallocation(TINY, False, p, p)
        assert plan.total_bytes() == 0
        assert plan.n_steps == 0
        assert all(t.is_local for t in plan.transfers)


@pytest.mark.unit
def test_prefers_same_gpu_then_same_node() -> None:
    m = 4
    src = Placement(Mesh(0, 8, m), Layout(dp=8))  # a full replica on each of 2 nodes
    dst = Placement(Mesh(4, 4, m), Layout(tp=4))  # node 1 only
    plan = plan_reallocation(TINY, False, src, dst)
    assert plan.total_bytes() == 0  # every slice is on its own GPU already
    src2 = Placement(Mesh(0, 8, m), Layout(dp=2, tp=4))  # one tp=4 replica per node
    dst2 = Placement(Mesh(4, 1, m), Layout())  # GPU 4 of node 1 wants the whole model
    links = plan_reallocation(TINY, False, src2, dst2).bytes_per_link()
    assert links and all(s // m == 1 for (s, _d) in links)  # sources on node 1 only


@pytest.mark.unit
def test_bytes_and_time_scale_with_model() -> None:
    cluster = ClusterSpec(1, 8, hardware_preset("h100-80g"))
    spec = model_preset("llama-7b")
    src = Placement(Mesh(0, 1, 8), Layout())
    dst = Placement(Mesh(0, 8, 8), Layout(tp=8))
    plan = plan_reallocation(spec, False, src, dst)
    # GPU 0 keeps its 1/8 of split weights locally and sends the other 7/8 in bf16; replicated
    # tensors (norms) go whole to each of the 7 other GPUs.
    split = sum(np.prod(p.shape) for p in param_specs(spec) if len(p.shape) == 2)
    replicated = sum(np.prod(p.shape) for p in param_specs(spec) if len(p.shape) == 1)
    assert plan.total_bytes() == 2 * (split * 7 // 8 + replicated * 7)
    t = realloc_time_s(plan, cluster)
    assert spec.n_params() * 2 * 7 / 8 / cluster.hardware.intra_node_bw <= t < 1.0


@pytest.mark.unit
def test_rejects_non_dividing_tp_and_kv_regime_change() -> None:
    spec = ModelSpec("six", "llama", 96, 48, 96, 2, 12, 12, 4)
    mesh = Mesh(0, 6, 6)
    with pytest.raises(ValueError, match="tp degrees 2 -> 3"):
        plan_reallocation(spec, False, Placement(mesh, Layout(dp=3, tp=2)), Placement(mesh, Layout(dp=2, tp=3)))
    kv2 = ModelSpec("kv2", "llama", 64, 32, 64, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="replicated"):
        plan_reallocation(kv2, False, Placement(Mesh(0, 2, 4), Layout(tp=2)), Placement(Mesh(0, 4, 4), Layout(tp=4)))
    # A tp=1 side holds every head and is compatible with either regime.
    assert plan_reallocation(kv2, False, Placement(Mesh(0, 1, 4), Layout()), Placement(Mesh(0, 4, 4), Layout(tp=4))).transfers


@pytest.mark.unit
def test_fast_estimate_matches_full_plan() -> None:
    from planning.realloc_plan import estimate_realloc_s

    cluster = ClusterSpec(2, 8, hardware_preset("h100-80g"))
    spec = model_preset("llama-7b")
    pairs = [
        (Placement(Mesh(0, 8, 8), Layout(dp=2, tp=4)), Placement(Mesh(0, 16, 8), Layout(dp=2, tp=2, pp=4))),
        (Placement(Mesh(0, 16, 8), Layout(tp=8, pp=2)), Placement(Mesh(8, 8, 8), Layout(dp=8))),
        (Placement(Mesh(0, 4, 8), Layout(pp=4)), Placement(Mesh(8, 2, 8), Layout(tp=2))),
    ]
    for src, dst in pairs:
        full = realloc_time_s(plan_reallocation(spec, False, src, dst), cluster)
        assert estimate_realloc_s(spec, False, src, dst, cluster) == pytest.approx(full, rel=0.05)
    assert estimate_realloc_s(spec, False, pairs[0][0], pairs[0][0], cluster) == 0.0
