"""Shared prompts under dp, tp and pp (gloo, 4 processes): outputs and gradients of compact
micro-batches against the serial engine on the same rows packed whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from actors.engine.model_engine import ModelEngine
from actors.engine.process_groups import ParallelGroups, build_parallel_groups, destroy_parallel_groups
from planning.layout import Layout
from planning.models import tp_split_dim
from tests.actors.engine.test_shared_prefix import SPEC, _critic_loss, _policy_loss, make_batch
from tests.dist_harness import run_distributed

# (layout, critic, micro-batches): tp splits the heads and the vocabulary, pp sends the compact
# stream between stages, dp splits the rows (groups may straddle ranks and micro-batches).
CASES = [(Layout(tp=2, pp=2), False, 2), (Layout(dp=2, tp=2), False, 1), (Layout(dp=2, pp=2), True, 2),
         (Layout(tp=4), False, 3)]


def _reference(critic: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    engine = ModelEngine(SPEC, critic, ParallelGroups.serial(), "cpu", torch.float64, seed=0)
    batch = make_batch(shared=False)
    out = engine.forward_values(batch) if critic else engine.forward_logprobs(batch, temperature=0.7)
    _, count = engine.backward_step(batch, _critic_loss if critic else _policy_loss, temperature=0.7,
                                    with_entropy=not critic)
    return out, {name: p.grad / count for name, p in engine.model.named_parameters()}


def shared_worker(rank: int, world_size: int) -> list[str]:
    refs = {critic: _reference(critic) for critic in (False, True)}
    done = []
    for layout, critic, n_micro in CASES:
        groups = build_parallel_groups(layout, list(range(layout.world_size)))
        engine = ModelEngine(SPEC, critic, groups, "cpu", torch.float64, seed=0)
        batch = make_batch(shared=True)
        out = engine.forward_values(batch, n_micro) if critic else engine.forward_logprobs(batch, n_micro, 0.7)
        ref_out, ref_grads = refs[critic]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        _, count = engine.backward_step(batch, _critic_loss if critic else _policy_loss, n_micro, temperature=0.7,
                                        with_entropy=not critic)
        for name, param in engine.model.named_parameters():
            grad = param.grad / count
            if groups.dp_group is not None:
                dist.all_reduce(grad, group=groups.dp_group)
            dim = tp_split_dim(name, SPEC, layout.tp)
            expected = ref_grads[name] if dim is None else ref_grads[name].chunk(layout.tp, dim)[groups.tp_rank]
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{layout} {n}: {m}")
        destroy_parallel_groups(groups)
        done.append(str(layout))
    return done


@pytest.mark.dist
def test_shared_prompts_match_serial_rows_under_every_split() -> None:
    results = run_distributed(shared_worker, 4)
    assert all(r == [str(layout) for layout, _, _ in CASES] for r in results)
