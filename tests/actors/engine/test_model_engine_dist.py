"""The parallel engine against the serial model, for every (dp, tp, pp) with dp * tp * pp <= 4.

One spawn of 4 gloo processes loops over the cases (layouts of 2 ranks use ranks 0-1; the other
two only take part in creating the groups). For each case every rank builds the serial engine
locally as the reference and checks: forward logprobs / values equal the serial ones; gradients
after one backward (summed over dp, scaled by 1/count) equal the serial gradients' slices; three
optimizer steps give the serial losses and gradient norms. The same spawn then runs every layout
with a micro-batch token budget (the plan's `micro_batch_tokens`): a dp share of N tokens runs
ceil(N / budget) micro-batches and gives the logprobs, values and gradients of one micro-batch.
Unit tests cover the pieces that need no processes: micro-batch splitting, the LR schedule and
ShardedAdamW against torch's AdamW.
"""

from __future__ import annotations

import faulthandler
import math

import pytest
import torch
import torch.distributed as dist

from actors.engine.model_engine import ModelEngine, SequenceBatch
from actors.engine.optimizer import OPTIMIZER_STATE_KEYS, AdamWConfig, ShardedAdamW, lr_at
from actors.engine.pipeline import split_by_tokens
from actors.engine.process_groups import ParallelGroups, build_parallel_groups, destroy_parallel_groups
from actors.rl.losses import LossSums, value_loss
from planning.layout import Layout
from planning.models import ModelSpec, tp_split_dim
from tests.dist_harness import run_distributed

GQA = ModelSpec("tiny-gqa", "llama", 64, 32, 64, 4, 4, 2, 8, max_position_embeddings=64)
TIED = ModelSpec("tiny-tied", "qwen2", 64, 32, 64, 4, 4, 2, 8, tie_embeddings=True, qkv_bias=True,
                 max_position_embeddings=64)
OPTIM = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, total_steps=3)
LENGTHS = (5, 9, 3, 7, 6, 4, 8)
ALL_LAYOUTS = [Layout(2, 1, 1), Layout(1, 2, 1), Layout(1, 1, 2), Layout(4, 1, 1), Layout(1, 4, 1),
               Layout(1, 1, 4), Layout(2, 2, 1), Layout(2, 1, 2), Layout(1, 2, 2)]
# (spec, critic, layout, n_micro): every layout for the GQA actor (tp=4 replicates K/V), tied
# embeddings under tp and pp, and the critic head under tp+pp and dp+pp.
CASES = ([(GQA, False, layout, 3) for layout in ALL_LAYOUTS]
         + [(TIED, False, Layout(tp=2, pp=2), 2), (TIED, False, Layout(pp=4), 4), (TIED, False, Layout(tp=4), 1),
            (TIED, False, Layout(dp=2, pp=2), 2)]
         + [(GQA, True, Layout(tp=2, pp=2), 3), (GQA, True, Layout(dp=2, pp=2), 2)])
TOL = {"atol": 1e-5, "rtol": 1e-5}
BUDGET = 8  # tokens per micro-batch: 2 to 6 micro-batches per dp share of LENGTHS


def make_batch() -> SequenceBatch:
    gen = torch.Generator().manual_seed(7)
    total = sum(LENGTHS)
    mask = (torch.rand(total, generator=gen) < 0.8).float()
    starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
    mask[starts] = 0.0  # a sequence's first token has no logprob
    return SequenceBatch(
        tokens=torch.randint(0, 64, (total,), generator=gen),
        lengths=LENGTHS,
        token_data={"mask": mask, "adv": torch.randn(total, generator=gen),
                    "old_values": torch.randn(total, generator=gen) * 0.1,
                    "returns": torch.randn(total, generator=gen)},
    )


def actor_loss(logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    """Policy-gradient-like sum with an entropy bonus (exercises the entropy path), a summed
    statistic and a largest one (reduced by max over micro-batches and dp)."""
    mask = data["mask"]
    per_token = -logprobs * data["adv"] - 0.01 * data["entropy"]
    return LossSums((per_token * mask).sum(), mask.sum(), {"logprob": (logprobs.detach() * mask).sum()},
                    {"surprise_max": (-logprobs.detach() * mask).max()})


def critic_loss(values: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    return value_loss(values, data["old_values"], data["returns"], data["mask"], clip_range=0.2)


def _forward(engine: ModelEngine, batch: SequenceBatch, n_micro: int) -> torch.Tensor:
    return engine.forward_values(batch, n_micro) if engine.critic else engine.forward_logprobs(batch, n_micro)


def _loss_fn(critic: bool):  # noqa: ANN202 - returns one of the two loss functions above
    return critic_loss if critic else actor_loss


def serial_reference(spec: ModelSpec, critic: bool, batch: SequenceBatch, device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """Outputs, gradients (normalised) and three-step metrics of the serial engine."""
    engine = ModelEngine(spec, critic, ParallelGroups.serial(), device, dtype, seed=0, optim_config=OPTIM)
    out = _forward(engine, batch, 1)
    _, count = engine.backward_step(batch, _loss_fn(critic), 1, with_entropy=True)
    grads = {name: p.grad.detach() / count for name, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad()
    steps = [engine.train_step(batch, _loss_fn(critic), 1, with_entropy=True) for _ in range(3)]
    return {"out": out, "grads": grads, "steps": steps}


def _check_grads(engine: ModelEngine, groups: ParallelGroups, ref_grads: dict[str, torch.Tensor], count: float) -> None:
    tp = groups.layout.tp
    for name, param in engine.model.named_parameters():
        grad = param.grad.detach().clone() / count
        if groups.dp_group is not None:
            dist.all_reduce(grad, group=groups.dp_group)
        dim = tp_split_dim(name, engine.spec, tp)
        expected = ref_grads[name] if dim is None else ref_grads[name].chunk(tp, dim)[groups.tp_rank]
        torch.testing.assert_close(grad.cpu(), expected.cpu(), **TOL, msg=lambda m: f"grad {name}: {m}")


def run_case(spec: ModelSpec, critic: bool, layout: Layout, n_micro: int, ref: dict[str, object],
             device: str = "cpu") -> None:
    groups = build_parallel_groups(layout, list(range(layout.world_size)))
    if groups is None:
        return
    batch = make_batch()
    engine = ModelEngine(spec, critic, groups, device, seed=0, optim_config=OPTIM)
    torch.testing.assert_close(_forward(engine, batch, n_micro).cpu(), ref["out"].cpu(), **TOL)
    _, count = engine.backward_step(batch, _loss_fn(critic), n_micro, with_entropy=True)
    _check_grads(engine, groups, ref["grads"], count)
    engine.optimizer.zero_grad()
    for step, expected in enumerate(ref["steps"]):
        got = engine.train_step(batch, _loss_fn(critic), n_micro, with_entropy=True)
        for key in ("loss", "grad_norm", "lr", "count") + (() if critic else ("logprob", "surprise_max")):
            assert math.isclose(got[key], expected[key], rel_tol=1e-5, abs_tol=1e-5), \
                (step, key, got[key], expected[key])
    destroy_parallel_groups(groups)


def run_budget_case(spec: ModelSpec, critic: bool, layout: Layout, ref: dict[str, object]) -> int | None:
    """Forward and gradients with the token budget against the serial single micro-batch;
    returns the number of micro-batches of this rank's dp share (None off the layout)."""
    groups = build_parallel_groups(layout, list(range(layout.world_size)))
    if groups is None:
        return None
    batch = make_batch()
    engine = ModelEngine(spec, critic, groups, "cpu", seed=0, optim_config=OPTIM)
    share = engine.dp_share(batch)
    n_micro = len(engine.micro_batch_split(share, 1, BUDGET))
    assert n_micro == math.ceil(share.tokens.numel() / BUDGET), (n_micro, share.tokens.numel())
    out = (engine.forward_values(batch, micro_batch_tokens=BUDGET) if critic
           else engine.forward_logprobs(batch, micro_batch_tokens=BUDGET))
    torch.testing.assert_close(out, ref["out"], **TOL)
    _, count = engine.backward_step(batch, _loss_fn(critic), with_entropy=True, micro_batch_tokens=BUDGET)
    _check_grads(engine, groups, ref["grads"], count)
    destroy_parallel_groups(groups)
    return n_micro


def engine_worker(rank: int, world_size: int) -> tuple[list[str], list[int | None]]:
    batch = make_batch()
    refs = {(spec.name, critic): serial_reference(spec, critic, batch)
            for spec, critic in {(spec, critic) for spec, critic, _, _ in CASES}}
    done = []
    for spec, critic, layout, n_micro in CASES:
        try:
            run_case(spec, critic, layout, n_micro, refs[(spec.name, critic)])
        except AssertionError as err:
            raise AssertionError(f"{spec.name} critic={critic} {layout} n_micro={n_micro}: {err}") from err
        done.append(f"{spec.name}/{'critic' if critic else 'actor'}/{layout}")
    counts = []
    for layout in ALL_LAYOUTS:
        for critic in (False, True):
            try:
                counts.append(run_budget_case(GQA, critic, layout, refs[(GQA.name, critic)]))
            except AssertionError as err:
                raise AssertionError(f"budget {BUDGET}, {layout}, critic={critic}: {err}") from err
    return done, counts


@pytest.mark.dist
def test_engine_matches_serial_for_every_layout() -> None:
    results = run_distributed(engine_worker, 4)
    done, counts = results[0]
    assert done == [f"{s.name}/{'critic' if c else 'actor'}/{lay}" for s, c, lay, _ in CASES]
    # Rank 0 is in every layout; the whole batch (42 tokens) at dp=1 takes ceil(42 / 8) = 6.
    assert None not in counts and max(counts) == 6 and min(counts) >= 2, counts


def gpu_engine_worker(rank: int, world_size: int) -> list[str]:
    """The two-rank cases on CUDA over NCCL in float32 (exact), then a bf16 run against serial bf16."""
    faulthandler.dump_traceback_later(150, exit=True)  # a hung collective prints every stack, then exits
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = f"cuda:{rank}"
    batch = make_batch()
    cases = [case for case in CASES if case[2].world_size == 2] + [
        (TIED, False, Layout(tp=2), 2), (TIED, False, Layout(pp=2), 2), (GQA, True, Layout(pp=2), 2),
        (GQA, True, Layout(tp=2), 1)]
    refs = {(spec.name, critic): serial_reference(spec, critic, batch, device)
            for spec, critic in {(spec, critic) for spec, critic, _, _ in cases}}
    done = []
    for spec, critic, layout, n_micro in cases:
        run_case(spec, critic, layout, n_micro, refs[(spec.name, critic)], device)
        done.append(f"{spec.name}/{layout}")
    bf16_ref = serial_reference(GQA, False, batch, device, torch.bfloat16)["steps"]
    for layout in (Layout(tp=2), Layout(pp=2), Layout(dp=2)):
        groups = build_parallel_groups(layout)
        engine = ModelEngine(GQA, False, groups, device, torch.bfloat16, seed=0, optim_config=OPTIM)
        losses = [engine.train_step(batch, actor_loss, 2, with_entropy=True)["loss"] for _ in range(3)]
        # bf16 rounding differs with the reduction order; the trajectory must still agree closely.
        assert all(abs(a - b["loss"]) < 2e-2 for a, b in zip(losses, bf16_ref)), (layout, losses, bf16_ref)
        done.append(f"bf16/{layout}")
    return done


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_engine_nccl_matches_serial() -> None:
    results = run_distributed(gpu_engine_worker, 2, backend="nccl", timeout_s=200)
    assert results[0] == results[1] and len(results[0]) == 10


# ---- single-process pieces ---------------------------------------------------------------------


@pytest.mark.unit
def test_split_by_tokens_is_contiguous_balanced_and_complete() -> None:
    lengths = [5, 9, 3, 7, 6, 4, 8]
    for parts in range(1, len(lengths) + 1):
        split = split_by_tokens(lengths, parts)
        assert [i for r in split for i in r] == list(range(len(lengths)))
        assert all(len(r) > 0 for r in split)
    assert split_by_tokens([4, 4, 4, 4], 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="n_parts=5"):
        split_by_tokens([1, 2, 3, 4], 5)


@pytest.mark.unit
def test_lr_schedule_warmup_then_cosine() -> None:
    config = AdamWConfig(lr=1.0, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    lrs = [lr_at(config, s) for s in range(8)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert math.isclose(lrs[4], 0.1 + 0.9 * 0.5, rel_tol=1e-9)
    assert math.isclose(lrs[6], 0.1) and math.isclose(lrs[7], 0.1)
    with pytest.raises(ValueError, match="total_steps"):
        AdamWConfig(warmup_steps=3, total_steps=2)


@pytest.mark.unit
def test_sharded_adamw_alone_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    matrix = torch.nn.Parameter(torch.randn(4, 3))
    norm = torch.nn.Parameter(torch.ones(3))
    ref_matrix = torch.nn.Parameter(matrix.detach().clone())
    ref_norm = torch.nn.Parameter(norm.detach().clone())
    config = AdamWConfig(lr=0.1, betas=(0.9, 0.99), weight_decay=0.2, max_grad_norm=None)
    ours = ShardedAdamW([("w", matrix), ("norm.weight", norm)], config, None, None)
    groups = [{"params": [ref_matrix], "weight_decay": 0.2}, {"params": [ref_norm], "weight_decay": 0.0}]
    ref = torch.optim.AdamW(groups, lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    for step in range(3):
        x = torch.randn(5, 4)
        for w, n in ((matrix, norm), (ref_matrix, ref_norm)):
            ((x @ w) * n).square().sum().backward()
        stats = ours.step(grad_scale=1.0)
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
        assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
        torch.testing.assert_close(matrix.detach(), ref_matrix.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(norm.detach(), ref_norm.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.unit
def test_sharded_adamw_state_moves_whole_and_continues_exactly() -> None:
    """full_state -> load_full_state into an optimizer over other tensors (as after a move to
    another layout): the next steps equal those of the optimizer that never moved."""
    torch.manual_seed(1)
    params = [("w", torch.nn.Parameter(torch.randn(4, 3))), ("norm.weight", torch.nn.Parameter(torch.ones(3)))]
    config = AdamWConfig(lr=0.1, weight_decay=0.1, max_grad_norm=None)
    stay = ShardedAdamW(params, config, None, None)

    def step(opt: ShardedAdamW, x: torch.Tensor) -> None:
        w, n = opt.params
        ((x @ w) * n).square().sum().backward()
        opt.step()
        opt.zero_grad()

    inputs = [torch.randn(5, 4) for _ in range(4)]
    for x in inputs[:2]:
        step(stay, x)
    copies = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in params]
    moved = ShardedAdamW(copies, config, None, None)
    for key in OPTIMIZER_STATE_KEYS:
        whole = stay.full_state(key)
        assert {k: tuple(v.shape) for k, v in whole.items()} == {"w": (4, 3), "norm.weight": (3,)}
        moved.load_full_state(key, whole)
    moved.steps_done = stay.steps_done
    for x in inputs[2:]:
        step(stay, x)
        step(moved, x)
    for (_, a), (_, b) in zip(params, copies):
        torch.testing.assert_close(a.detach(), b.detach(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="allowed: master"):
        stay.full_state("momentum")
