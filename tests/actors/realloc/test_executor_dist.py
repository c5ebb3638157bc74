"""Parameter reallocation executor (actors.realloc.executor): exact resharding over gloo, plus its schedule
(actors.realloc.schedule), its process-group cache, and the memory rules of actors.realloc.offload.

The dist test spawns 4 processes once and runs the whole grid of (source, destination) placements
inside them: every rank builds the same seeded full model, slices its source shards with
`shard_slice`, executes the plan, and checks its destination shards equal the full model's slices.
A second spawn does the same through the parallel engine (actors.engine.model_engine): outputs under the
destination equal those under the source, and a train (A) -> infer (B) -> A round trip leaves the
trainable copy untouched while B gives the trained outputs.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.model_engine import ModelEngine, SequenceBatch
from actors.engine.optimizer import AdamWConfig
from actors.engine.process_groups import build_parallel_groups
from actors.realloc.executor import ReallocGroups, broadcast_groups, execute_reallocation
from actors.realloc.offload import ModelCopies, offload_to_cpu, reload_to_device
from actors.realloc.schedule import build_schedule, destination_slices, round_sizes
from actors.rl.losses import LossSums
from planning.layout import Layout, Mesh
from planning.models import ModelSpec, param_specs
from planning.plan import Placement
from planning.realloc_plan import ShardSlice, plan_reallocation, rank_params
from tests.dist_harness import run_distributed

GPN = 4  # GPUs per node of the test world: one node of 4 ranks
SPEC = ModelSpec("tiny-realloc", "llama", 64, 32, 64, 4, 4, 2, 8)
TIED = ModelSpec("tiny-tied", "llama", 64, 32, 64, 4, 4, 2, 8, tie_embeddings=True)
CASES = [(SPEC, False), (TIED, False), (SPEC, True)]  # actor, tied actor, critic


def _p(start: int, size: int, layout: str) -> Placement:
    return Placement(Mesh(start, size, GPN), Layout.parse(layout))


# (source, destination): overlapping/disjoint/equal meshes of 1, 2 and 4 ranks; tp 1<->2,
# pp 1<->2, dp changes, tp4 (replicated K/V) <-> tp1.
PAIRS = [
    (_p(0, 1, "tp1"), _p(0, 2, "tp2")),
    (_p(0, 2, "tp2"), _p(0, 1, "tp1")),
    (_p(0, 1, "tp1"), _p(2, 2, "pp2")),
    (_p(2, 2, "pp2"), _p(0, 1, "tp1")),
    (_p(0, 2, "dp2"), _p(1, 1, "tp1")),
    (_p(0, 2, "tp2"), _p(0, 2, "pp2")),
    (_p(0, 2, "pp2"), _p(2, 2, "tp2")),
    (_p(0, 2, "tp2"), _p(2, 2, "tp2")),
    (_p(0, 1, "tp1"), _p(0, 4, "dp4")),
    (_p(0, 4, "dp2tp2"), _p(0, 4, "tp2pp2")),
    (_p(0, 4, "tp2pp2"), _p(0, 2, "tp2")),
    (_p(0, 4, "dp2pp2"), _p(0, 4, "dp2tp2")),
    (_p(2, 2, "tp2"), _p(0, 4, "dp2tp2")),
    (_p(0, 4, "dp4"), _p(3, 1, "tp1")),
    (_p(0, 4, "tp4"), _p(1, 1, "tp1")),
    (_p(0, 1, "tp1"), _p(0, 4, "tp4")),
    (_p(0, 4, "pp4"), _p(0, 4, "dp2tp2")),
]


def _full_model(spec: ModelSpec, critic: bool) -> dict[str, torch.Tensor]:
    """A deterministic fp32 state dict, identical on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return {p.name: torch.randn(p.shape, generator=gen) for p in param_specs(spec, critic)}


def _slice(full: torch.Tensor, piece: ShardSlice) -> torch.Tensor:
    return full if piece.dim is None else full.narrow(piece.dim, piece.start, piece.stop - piece.start)


def _shards(spec: ModelSpec, critic: bool, placement: Placement, gpu: int,
            full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This GPU's shards under `placement` (empty when it is outside the mesh), cloned."""
    if gpu not in placement.mesh.gpus:
        return {}
    mesh_rank = gpu - placement.mesh.start
    return {p.name: _slice(full[p.name], piece).clone() for p, piece in rank_params(spec, critic, placement, mesh_rank)}


SETTINGS = ((1024, 64, 16, False), (1024, 64, 16, True), (256 * 1024**2, 64 * 1024**2, 32 * 1024**2, None))


def _settings(case_index: int) -> tuple[tuple[int, int, int, bool | None], ...]:
    """The settings a case runs: the copy kernel (slow under Triton's CPU interpreter) on the
    first case only; its slicing does not depend on which tensors a model has."""
    return SETTINGS if case_index == 0 else tuple(s for s in SETTINGS if s[3] is not True)


def _grid(rank: int, world_size: int) -> list[dict[tuple[int, int], int]]:
    """Run every (case, pair, bucket size) on this rank; return the bytes it received per link."""
    groups = ReallocGroups()
    links: list[dict[tuple[int, int], int]] = []
    for case_index, (spec, critic) in enumerate(CASES):
        full = _full_model(spec, critic)
        for src, dst in PAIRS:
            plan = plan_reallocation(spec, critic, src, dst)
            groups.ensure(broadcast_groups(plan))
            # A tiny bucket with a tinier lead round forces row-split slices, many rounds of growing
            # and shrinking size and unpacked (direct) messages of every slice of >= 64 bytes, with
            # torch copies and with the copy kernel (Triton's interpreter); the defaults pack every
            # slice of this tiny model into one round.
            for bucket_bytes, direct_min_bytes, lead_bytes, kernels in _settings(case_index):
                src_shards = _shards(spec, critic, src, rank, full)
                before = {k: v.clone() for k, v in src_shards.items()}
                out, stats = execute_reallocation(plan, rank, src_shards, groups, "cpu", torch.float32, bucket_bytes,
                                                  direct_min_bytes, lead_bytes, kernels)
                expected = _shards(spec, critic, dst, rank, full)
                where = f"{spec.name} critic={critic} {src.mesh}/{src.layout} -> {dst.mesh}/{dst.layout} bucket={bucket_bytes}"
                assert sorted(out) == sorted(expected), f"{where}: rank {rank} holds {sorted(out)}"
                for name, tensor in expected.items():
                    assert torch.equal(out[name], tensor), f"{where}: rank {rank} {name} differs"
                assert all(torch.equal(src_shards[k], v) for k, v in before.items()), f"{where}: source modified"
                links.append({(s, rank): b for s, b in stats.bytes_received.items()})
    # Same member sets were asked for again and again: one group per distinct set.
    distinct = {s for spec, critic in CASES for a, b in PAIRS for s in broadcast_groups(plan_reallocation(spec, critic, a, b))}
    assert len(groups) == len(distinct)
    groups.ensure(list(distinct) * 2)
    assert len(groups) == len(distinct)
    return links


@pytest.mark.dist
def test_grid_of_reallocations_is_exact() -> None:
    per_rank = run_distributed(_grid, 4)
    # Bytes each rank received per link add up to the plan's own count (fp32 on the wire).
    i = 0
    for case_index, (spec, critic) in enumerate(CASES):
        for src, dst in PAIRS:
            expected = plan_reallocation(spec, critic, src, dst).bytes_per_link(dtype_bytes=4)
            for _ in _settings(case_index):
                measured: dict[tuple[int, int], int] = {}
                for rank_links in per_rank:
                    measured.update(rank_links[i])
                assert measured == expected, (spec.name, critic, src, dst)
                i += 1


# ---- with the parallel engine: outputs and a train / infer round trip --------------------------------

LENGTHS = (5, 9, 3, 7, 6)
ENGINE_PAIRS = [  # (spec, critic, source, destination)
    (SPEC, False, _p(0, 2, "tp2"), _p(2, 2, "pp2")),
    (TIED, False, _p(0, 4, "dp2tp2"), _p(0, 4, "tp2pp2")),
    (SPEC, True, _p(0, 2, "pp2"), _p(0, 4, "dp2tp2")),
]


def _batch() -> SequenceBatch:
    gen = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    mask = torch.ones(total)
    mask[torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)] = 0.0  # first tokens have no logprob
    return SequenceBatch(torch.randint(0, 64, (total,), generator=gen), LENGTHS,
                         token_data={"mask": mask, "adv": torch.randn(total, generator=gen)})


def _pg_loss(logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    return LossSums((-logprobs * data["adv"] * data["mask"]).sum(), data["mask"].sum())


def _engine(spec: ModelSpec, critic: bool, placement: Placement, rank: int, seed: int | None,
            optim: AdamWConfig | None = None) -> ModelEngine | None:
    """This rank's engine under `placement`; every rank of the world calls it (groups are collective)."""
    groups = build_parallel_groups(placement.layout, list(placement.mesh.gpus))
    if groups is None:
        return None
    return ModelEngine(spec, critic, groups, "cpu", seed=seed, optim_config=optim)


def _params(engine: ModelEngine | None) -> dict[str, torch.Tensor]:
    return {} if engine is None else {n: p.detach() for n, p in engine.model.named_parameters()}


@torch.no_grad()
def _load(engine: ModelEngine | None, shards: dict[str, torch.Tensor]) -> None:
    if engine is not None:
        params = dict(engine.model.named_parameters())
        assert sorted(params) == sorted(shards), (sorted(params), sorted(shards))
        for name, param in params.items():
            param.copy_(shards[name])


def _outputs(engine: ModelEngine | None) -> torch.Tensor | None:
    if engine is None:
        return None
    return engine.forward_values(_batch()) if engine.critic else engine.forward_logprobs(_batch())


def _engine_cases(rank: int, world_size: int) -> dict[str, object]:
    """Outputs under source and destination per pair, then the round trip; compared by the parent."""
    groups = ReallocGroups()
    result: dict[str, object] = {}
    for i, (spec, critic, src, dst) in enumerate(ENGINE_PAIRS):
        source = _engine(spec, critic, src, rank, seed=0)
        target = _engine(spec, critic, dst, rank, seed=None)  # uninitialised until reallocated into
        plan = plan_reallocation(spec, critic, src, dst)
        groups.ensure(broadcast_groups(plan))
        out, _ = execute_reallocation(plan, rank, _params(source), groups, "cpu", torch.float32)
        _load(target, out)
        result[f"pair{i}"] = (_outputs(source), _outputs(target))
    result["round_trip"] = _round_trip(rank, groups)
    return result


def _round_trip(rank: int, groups: ReallocGroups) -> dict[str, object]:
    """Train two steps under A (tp2 on ranks 0-1), reallocate to B (tp2pp2 on 0-3) and back."""
    home, infer = _p(0, 2, "tp2"), _p(0, 4, "tp2pp2")
    optim = AdamWConfig(lr=1e-2, max_grad_norm=1.0)
    actor = _engine(SPEC, False, home, rank, seed=0, optim=optim)
    before = _outputs(actor)
    for _ in range(2):
        if actor is not None:
            actor.train_step(_batch(), _pg_loss)
    trained = {n: t.clone() for n, t in _params(actor).items()}
    copies = ModelCopies("actor", trainable=True)
    copies.load(home, _params(actor))
    to_b, back = plan_reallocation(SPEC, False, home, infer), plan_reallocation(SPEC, False, infer, home)
    groups.ensure(broadcast_groups(to_b) + broadcast_groups(back))
    out, _ = execute_reallocation(to_b, rank, copies.shards(copies.source_for(infer)), groups, "cpu", torch.float32)
    copies.add(infer, out)
    inference = _engine(SPEC, False, infer, rank, seed=None)
    _load(inference, copies.shards(infer))
    returned, _ = execute_reallocation(back, rank, copies.shards(infer), groups, "cpu", torch.float32)
    copies.after_call(infer, next_placement=home)  # the inference copy is released
    untouched = all(torch.equal(p, trained[n]) for n, p in _params(actor).items())
    exact_back = sorted(returned) == sorted(trained) and all(torch.equal(returned[n], t) for n, t in trained.items())
    return {"before": before, "trained": _outputs(actor), "inference": _outputs(inference),
            "untouched": untouched, "exact_back": exact_back, "held": copies.placements == (home,)}


@pytest.mark.dist
def test_engine_outputs_and_round_trip() -> None:
    per_rank = run_distributed(_engine_cases, 4)
    for i, (spec, critic, src, dst) in enumerate(ENGINE_PAIRS):
        src_out = next(r[f"pair{i}"][0] for r in per_rank if r[f"pair{i}"][0] is not None)
        for rank, r in enumerate(per_rank):
            if r[f"pair{i}"][1] is not None:  # every destination rank sees the source's outputs
                torch.testing.assert_close(r[f"pair{i}"][1], src_out, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{spec.name} critic={critic} {src} -> {dst} rank {rank}: {m}")
    trips = [r["round_trip"] for r in per_rank]
    assert all(t["untouched"] and t["exact_back"] and t["held"] for t in trips), trips
    trained, before = trips[0]["trained"], trips[0]["before"]
    assert (trained - before).abs().max() > 1e-3  # two steps did change the model
    for t in trips:  # all four ranks hold the inference copy; it gives the trained outputs
        torch.testing.assert_close(t["inference"], trained, atol=1e-5, rtol=1e-5)


# ---- single-process checks -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("src,dst", PAIRS[:12])
def test_destination_slices_match_rank_params(src: Placement, dst: Placement) -> None:
    for spec, critic in CASES:
        plan = plan_reallocation(spec, critic, src, dst)
        for gpu in range(GPN):
            got = destination_slices(plan, gpu)
            want = {} if gpu not in dst.mesh.gpus else {
                p.name: (p.shape, piece) for p, piece in rank_params(spec, critic, dst, gpu - dst.mesh.start)}
            norm = {k: (s, ShardSlice(None, 0, s[0]) if c.dim is None else c) for k, (s, c) in want.items()}
            assert got == norm, (spec.name, critic, gpu)


@pytest.mark.unit
@pytest.mark.parametrize("bucket_bytes,lead_bytes", [(64, 0), (1000, 0), (1000, 40), (256 * 1024**2, 32 * 1024**2)])
def test_schedule_covers_every_element_once_within_bucket(bucket_bytes: int, lead_bytes: int) -> None:
    plan = plan_reallocation(SPEC, False, _p(0, 2, "tp2"), _p(0, 4, "tp2pp2"))
    limit = bucket_bytes // 4 // 2  # fp32 elements; two rounds in flight share a bucket
    schedule = build_schedule(plan, 4, bucket_bytes, lead_bytes=lead_bytes)
    seen: dict[object, int] = {}
    for rnd in schedule.p2p_rounds:
        per_gpu: dict[int, int] = {}
        for m in rnd:
            assert len(m.receivers) == 1
            for gpu in (m.src, m.receivers[0]):
                per_gpu[gpu] = per_gpu.get(gpu, 0) + m.numel
        # One message may be a single row larger than the share; otherwise a GPU stays in budget.
        assert all(n <= max(limit, 32) for n in per_gpu.values()), per_gpu
    for m in [m for rnd in schedule.p2p_rounds for m in rnd] + list(schedule.broadcasts):
        for seg in m.segments:
            seen[seg.transfer] = seen.get(seg.transfer, 0) + seg.numel
    remote = [t for t in plan.transfers if not t.is_local]
    assert seen == {t: t.numel for t in remote}
    assert set(schedule.local) == {t for t in plan.transfers if t.is_local}


@pytest.mark.unit
@pytest.mark.parametrize("total", [1, 40, 70, 100, 300, 830, 1178, 2357, 5000])
def test_round_sizes_ramp_up_and_down_within_the_cap(total: int) -> None:
    cap, lead = 768, 32
    sizes = round_sizes(total, cap, lead)
    assert sum(sizes) == total and all(0 < s <= cap for s in sizes), sizes
    if total >= 3 * lead:  # short first and last rounds: nothing overlaps their copies
        assert sizes[0] == sizes[-1] == lead, sizes
    top = sizes.index(max(sizes))
    assert sizes[:top + 1] == sorted(sizes[:top + 1]) and sizes[top:] == sorted(sizes[top:], reverse=True), sizes
    assert round_sizes(5000, cap, 0) == [cap] * 7  # no ramp: every round's budget is the cap


@pytest.mark.unit
def test_rejected_before_any_byte_moves() -> None:
    # K/V (2 heads) split under tp2, replicated under tp4: the two shardings do not line up.
    with pytest.raises(ValueError, match="K/V heads"):
        plan_reallocation(SPEC, False, _p(0, 2, "tp2"), _p(0, 4, "tp4"))
    # tp 2 and 3 do not divide each other (a node of 6 GPUs).
    spec6 = ModelSpec("six", "llama", 96, 48, 96, 2, 12, 6, 4)
    src = Placement(Mesh(0, 6, 6), Layout(dp=3, tp=2))
    dst = Placement(Mesh(0, 6, 6), Layout(dp=2, tp=3))
    with pytest.raises(ValueError, match="do not divide"):
        plan_reallocation(spec6, False, src, dst)
    # The executor checks its inputs before any communication (no process group exists here).
    plan = plan_reallocation(SPEC, False, _p(0, 1, "tp1"), _p(1, 1, "tp1"))
    with pytest.raises(ValueError, match="lacks"):
        execute_reallocation(plan, 0, {}, ReallocGroups(), "cpu", torch.float32)
    bad = {p.name: torch.zeros(3) for p in param_specs(SPEC)}
    with pytest.raises(ValueError, match="has shape"):
        execute_reallocation(plan, 0, bad, ReallocGroups(), "cpu", torch.float32)


@pytest.mark.unit
def test_local_only_reallocation_needs_no_group() -> None:
    # dp2 on GPUs 0-1 -> tp1 on GPU 1: GPU 1 already holds everything, a pure local copy.
    plan = plan_reallocation(SPEC, False, _p(0, 2, "dp2"), _p(1, 1, "tp1"))
    assert plan.n_steps == 0
    full = _full_model(SPEC, False)
    src = _shards(SPEC, False, _p(0, 2, "dp2"), 1, full)
    out, stats = execute_reallocation(plan, 1, src, ReallocGroups(), "cpu", torch.float32)
    assert all(torch.equal(out[k], full[k]) for k in full) and sorted(out) == sorted(full)
    assert all(out[k].data_ptr() != src[k].data_ptr() for k in out)
    assert stats.local_bytes == sum(t.numel() for t in full.values()) * 4 and stats.total_received == 0


@pytest.mark.unit
def test_offload_round_trip_is_exact() -> None:
    full = _full_model(SPEC, False)
    cpu = offload_to_cpu(full)
    assert all(torch.equal(cpu[k], full[k]) and cpu[k].data_ptr() != full[k].data_ptr() for k in full)
    back = reload_to_device(cpu, "cpu", torch.bfloat16)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], full[k].bfloat16()) for k in full)


@pytest.mark.unit
def test_model_copies_trainable_rules() -> None:
    home, gen, other = _p(0, 2, "tp2"), _p(0, 4, "dp2tp2"), _p(2, 2, "pp2")
    full = _full_model(SPEC, False)
    copies = ModelCopies("actor", trainable=True)
    copies.load(home, _shards(SPEC, False, home, 0, full))
    copies.add(gen, _shards(SPEC, False, gen, 0, full))
    copies.after_call(gen, next_placement=gen)  # the next call reuses the generation copy
    assert copies.holds(gen) and copies.source_for(other) == home
    copies.after_call(gen, next_placement=home)
    assert copies.placements == (home,)
    copies.add(other, {})
    copies.after_call(home, next_placement=None)  # the training copy is never released
    copies.after_train()  # a train step makes every other copy stale
    assert copies.placements == (home,) and not copies.offloaded
    with pytest.raises(ValueError, match="stays in place"):
        copies.offload()


@pytest.mark.unit
def test_model_copies_frozen_offload_and_reload() -> None:
    first, second = _p(0, 1, "tp1"), _p(0, 2, "tp2")
    full = _full_model(SPEC, True)
    copies = ModelCopies("reward", trainable=False)
    copies.load(first, _shards(SPEC, True, first, 0, full))
    copies.after_call(first, next_placement=first)
    assert copies.holds(first) and not copies.offloaded
    copies.after_call(first, next_placement=second)
    assert copies.offloaded and copies.placements == ()
    with pytest.raises(ValueError, match="reload"):
        copies.source_for(second)
    copies.reload("cpu")
    assert copies.source_for(second) == first
    assert all(torch.equal(copies.shards(first)[k], full[k]) for k in full)
    copies.add(second, _shards(SPEC, True, second, 0, full))  # the newest copy becomes home
    copies.after_call(second, next_placement=second)
    assert copies.placements == (second,) and copies.home == second
    copies.after_call(second, next_placement=None)
    assert copies.offloaded
    copies.reload("cpu")
    expected = _shards(SPEC, True, second, 0, full)
    assert all(torch.equal(copies.shards(second)[k], v) for k, v in expected.items())
    copies.release_all()  # e.g. a rank outside the next mesh: nothing held, nothing offloaded
    assert not copies.offloaded and copies.placements == ()
    copies.offload()  # nothing on the device: a no-op
    copies.reload("cpu")
    assert copies.placements == ()
