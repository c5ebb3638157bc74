"""A trained model's checkpoint state, resharded onto other layouts and GPU counts by the
reallocation plan, is the same state element for element (actors.worker.state).

On 4 gloo ranks: an actor and a critic train two steps under dp2 on GPUs 0-1 (ZeRO-1: each dp
rank holds half of the fp32 master weights and AdamW moments) and save their state. Each is
then loaded, through `ModelWorker.load_state`, under tp2 x pp2 on all four GPUs and under one
GPU (rank 3, a GPU count the saved run did not have) and saved again. The full tensors assembled
from each saved state (weights, master, exp_avg, exp_avg_sq) must be equal, exactly, and so must
the optimizer's step count; one more train step from the reloaded dp2 state equals the step the
original run takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from actors.engine import SequenceBatch
from actors.rl import LossSums
from actors.worker import ModelWorker, placement_group_sets
from planning.layout import Layout, Mesh
from planning.models import ModelSpec, param_specs
from planning.plan import Placement
from planning.realloc_plan import shard_slice
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

SPEC = ModelSpec("state-test", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
OPTIM = {"lr": 1e-2, "max_grad_norm": 1.0, "weight_decay": 0.01}
SAVED = Placement(Mesh(0, 2, 4), Layout(dp=2))
TARGETS = {"tp2pp2": Placement(Mesh(0, 4, 4), Layout(tp=2, pp=2)), "one_gpu": Placement(Mesh(3, 1, 4), Layout()),
           "dp2": SAVED}
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")


def loss(out: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    return LossSums((out * data["w"]).sum(), torch.tensor(float(out.numel())))


def batch() -> SequenceBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 7, 4, 6)
    tokens = torch.randint(0, SPEC.vocab_size, (sum(lengths),), generator=gen)
    return SequenceBatch(tokens, lengths, {"w": torch.randn(sum(lengths), generator=gen)})


def train_step(worker: ModelWorker, role: str, placement: Placement) -> None:
    engine = worker._roles[role].engines[placement]
    engine.train_step(batch(), loss, n_micro=2)


def reshard(rank: int, world: int, root: str) -> dict[str, int]:
    worker = ModelWorker(rank, world, device="cpu")
    sets = [s for p in (SAVED, *TARGETS.values()) for s in placement_group_sets(p)] + [(0, 1, 2, 3)]
    worker.ensure_groups(sets)
    steps = {}
    for index, (role, critic) in enumerate((("actor", False), ("critic", True))):
        worker.load_model(role, SPEC, critic, SAVED, None, 7 + index, True, OPTIM)
        if rank in SAVED.mesh.gpus:
            for _ in range(2):
                train_step(worker, role, SAVED)
            worker.save_state(role, f"{root}/saved/{role}")
        torch.distributed.barrier()
        for name, target in TARGETS.items():
            worker.load_model(role, SPEC, critic, target, None, 100 + index, True, OPTIM)  # other random init
            if rank in target.mesh.gpus:
                worker.load_state(role, f"{root}/saved/{role}", SAVED)
                steps[f"{role}/{name}"] = worker._roles[role].engines[target].optimizer.steps_done
                if name == "dp2":  # one step on from the reloaded state
                    train_step(worker, role, target)
                worker.save_state(role, f"{root}/{name}/{role}")
            torch.distributed.barrier()
        if rank in SAVED.mesh.gpus:  # the original run's next step, for comparison
            worker.load_model(role, SPEC, critic, SAVED, None, 7 + index, True, OPTIM)
            for _ in range(3):
                train_step(worker, role, SAVED)
            worker.save_state(role, f"{root}/continued/{role}")
        torch.distributed.barrier()
    return steps


def assemble(directory: Path, critic: bool, layout: Layout) -> dict[str, torch.Tensor]:
    """Full tensors kind/name from the per-(tp, pp) files of a saved state."""
    full: dict[str, torch.Tensor] = {}
    for param in param_specs(SPEC, critic):
        for kind in KINDS:
            out = torch.full(param.shape, float("nan"))
            for tp in range(layout.tp):
                piece = shard_slice(SPEC, param, layout.tp, tp)
                for pp in range(layout.pp):
                    with safe_open(str(directory / f"tp{tp}-pp{pp}.safetensors"), framework="pt") as handle:
                        key = f"{kind}/{param.name}"
                        if key not in handle.keys():
                            continue
                        index = [slice(None)] * len(param.shape)
                        if piece.dim is not None:
                            index[piece.dim] = slice(piece.start, piece.stop)
                        out[tuple(index)] = handle.get_tensor(key).float()
            assert not out.isnan().any(), f"{directory}: {kind}/{param.name} not covered"
            full[f"{kind}/{param.name}"] = out
    return full


def test_state_reshards_exactly_onto_other_layouts_and_gpu_counts(tmp_path: Path) -> None:
    steps = run_distributed(reshard, 4, str(tmp_path))
    assert all(s == 2 for per_rank in steps for s in per_rank.values())  # the LR schedule's step
    assert {key for per_rank in steps for key in per_rank} == {f"{r}/{n}" for r in ("actor", "critic") for n in TARGETS}
    for role, critic in (("actor", False), ("critic", True)):
        saved = assemble(tmp_path / "saved" / role, critic, SAVED.layout)
        assert any(t.abs().sum() > 0 for k, t in saved.items() if k.startswith("exp_avg/"))  # it trained
        for name in ("tp2pp2", "one_gpu"):
            loaded = assemble(tmp_path / name / role, critic, TARGETS[name].layout)
            for key, tensor in saved.items():
                assert torch.equal(tensor, loaded[key]), f"{role} {name}: {key} differs"
        continued = assemble(tmp_path / "continued" / role, critic, SAVED.layout)
        resumed = assemble(tmp_path / "dp2" / role, critic, SAVED.layout)
        for key, tensor in continued.items():
            assert torch.equal(tensor, resumed[key]), f"{role}: the step after resuming differs in {key}"
