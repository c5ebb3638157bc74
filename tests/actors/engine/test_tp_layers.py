"""Tensor-parallel layers and vocab-parallel logprobs/entropy against the serial computation.

unit: the serial paths (group None) against torch's own ops. dist: 2 and 4 gloo processes, each
computing the sharded layer and comparing its output and gradients with the full computation
(which every rank can do locally from the same seeded tensors).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.engine.logprobs import token_logprobs, vocab_parallel_entropy, vocab_parallel_logprobs
from actors.engine.process_groups import build_parallel_groups
from actors.engine.tp_layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
)
from planning.layout import Layout
from tests.dist_harness import run_distributed

ATOL = 1e-5


def _serial_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     allowed: torch.Tensor | None) -> torch.Tensor:
    scaled = logits / temperature
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    return scaled.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def _serial_entropy(logits: torch.Tensor, temperature: float, allowed: torch.Tensor | None) -> torch.Tensor:
    scaled = logits / temperature
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    logp = scaled.log_softmax(-1)
    return -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(-1)


def _case(seed: int, T: int = 7, V: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=gen) * 3
    targets = torch.randint(0, V, (T,), generator=gen)
    allowed = torch.rand(T, V, generator=gen) < 0.6
    allowed[torch.arange(T), targets] = True  # the sampled token is always allowed
    return logits, targets, allowed


@pytest.mark.unit
@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.7, True)])
def test_serial_logprobs_and_entropy_match_torch(temperature: float, masked: bool) -> None:
    logits, targets, allowed = _case(0)
    mask = allowed if masked else None
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    weights = torch.linspace(0.5, 1.5, logits.shape[0])
    ours = vocab_parallel_logprobs(ours_in, targets, None, temperature, mask)
    ref = _serial_logprobs(ref_in, targets, temperature, mask)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-5)
    ((ours * weights).sum() + vocab_parallel_entropy(ours_in, None, temperature, mask).sum()).backward()
    ((ref * weights).sum() + _serial_entropy(ref_in, temperature, mask).sum()).backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=ATOL, rtol=1e-5)


@pytest.mark.unit
def test_token_logprobs_convention() -> None:
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    logits = torch.randn(7, 10)
    out = token_logprobs(logits, tokens, cu)
    logp = logits.log_softmax(-1)
    expected = torch.tensor([0.0, logp[0, 1], logp[1, 4], 0.0, logp[3, 5], logp[4, 9], logp[5, 2]])
    torch.testing.assert_close(out, expected)


@pytest.mark.unit
def test_layers_without_group_are_plain() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    col = ColumnParallelLinear(8, 6, True, None)
    row = RowParallelLinear(6, 8, True, None)
    emb = VocabParallelEmbedding(12, 8, None)
    for module in (col, row, emb):
        for p in module.parameters():
            torch.nn.init.normal_(p)
    torch.testing.assert_close(col(x), F.linear(x, col.weight, col.bias))
    torch.testing.assert_close(row(col(x)), F.linear(col(x), row.weight, row.bias))
    ids = torch.tensor([0, 11, 5])
    torch.testing.assert_close(emb(ids), emb.weight[ids])


def _full_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(5, 8, generator=gen),
        "col_w": torch.randn(12, 8, generator=gen), "col_b": torch.randn(12, generator=gen),
        "row_w": torch.randn(8, 12, generator=gen), "row_b": torch.randn(8, generator=gen),
        "emb": torch.randn(16, 8, generator=gen), "ids": torch.randint(0, 16, (9,), generator=gen),
        "logits": torch.randn(7, 16, generator=gen) * 3,
    }


def _check_linear_layers(tp_group: torch.distributed.ProcessGroup, rank: int, tp: int) -> None:
    """Column -> row MLP-like chain and a replicated projection: outputs and all gradients."""
    t = _full_tensors(1)
    col = ColumnParallelLinear(8, 12, True, tp_group)
    row = RowParallelLinear(12, 8, True, tp_group)
    rep = ReplicatedLinear(8, 12, False, tp_group)
    with torch.no_grad():
        col.weight.copy_(t["col_w"].chunk(tp, 0)[rank])
        col.bias.copy_(t["col_b"].chunk(tp, 0)[rank])
        row.weight.copy_(t["row_w"].chunk(tp, 1)[rank])
        row.bias.copy_(t["row_b"])
        rep.weight.copy_(t["col_w"])
    x = t["x"].clone().requires_grad_(True)
    # Replicated projection: each rank uses only its own output columns, like KV heads per q head.
    rep_part = rep(x).chunk(tp, -1)[rank]
    y = row(torch.tanh(col(x)) + rep_part)
    y.square().sum().backward()
    torch.distributed.all_reduce(rep.weight.grad, group=tp_group)  # what sync_model_parallel_grads does

    w1, b1, w2, b2, w3 = (t[k].clone().requires_grad_(True) for k in ("col_w", "col_b", "row_w", "row_b", "col_w"))
    xr = t["x"].clone().requires_grad_(True)
    yr = F.linear(torch.tanh(F.linear(xr, w1, b1)) + F.linear(xr, w3), w2, b2)
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(col.weight.grad, w1.grad.chunk(tp, 0)[rank], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(col.bias.grad, b1.grad.chunk(tp, 0)[rank], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(row.weight.grad, w2.grad.chunk(tp, 1)[rank], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(row.bias.grad, b2.grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(rep.weight.grad, w3.grad, atol=ATOL, rtol=1e-5)


def _check_embedding_and_head(tp_group: torch.distributed.ProcessGroup, rank: int, tp: int) -> None:
    """Vocab-parallel embedding, tied head and vocab-parallel logprobs/entropy end to end."""
    t = _full_tensors(2)
    emb = VocabParallelEmbedding(16, 8, tp_group)
    head = TiedVocabParallelHead(emb)
    with torch.no_grad():
        emb.weight.copy_(t["emb"].chunk(tp, 0)[rank])
    targets = torch.roll(t["ids"], -1)
    h = emb(t["ids"])
    logits = head(torch.tanh(h))  # [T, V/tp]
    logprobs = vocab_parallel_logprobs(logits, targets, tp_group, 0.8)
    loss = (logprobs - 0.1 * vocab_parallel_entropy(logits, tp_group)).sum()
    loss.backward()

    w = t["emb"].clone().requires_grad_(True)
    ref_logits = F.linear(torch.tanh(w[t["ids"]]), w)
    ref = (_serial_logprobs(ref_logits, targets, 0.8, None) - 0.1 * _serial_entropy(ref_logits, 1.0, None)).sum()
    ref.backward()
    torch.testing.assert_close(h, w[t["ids"]].detach(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(emb.weight.grad, w.grad.chunk(tp, 0)[rank], atol=ATOL, rtol=1e-5)


def _check_masked_logprobs(tp_group: torch.distributed.ProcessGroup, rank: int, tp: int) -> None:
    """Top-k/top-p style masks and temperature on sharded logits: values and logit gradients."""
    logits, targets, allowed = _case(3)
    shard = logits.chunk(tp, -1)[rank].clone().requires_grad_(True)
    mask = allowed.chunk(tp, -1)[rank]
    weights = torch.linspace(0.5, 1.5, logits.shape[0])
    out = vocab_parallel_logprobs(shard, targets, tp_group, 0.7, mask)
    ent = vocab_parallel_entropy(shard, tp_group, 0.7, mask)
    ((out * weights).sum() + ent.sum()).backward()
    full = logits.clone().requires_grad_(True)
    ref = _serial_logprobs(full, targets, 0.7, allowed)
    ref_ent = _serial_entropy(full, 0.7, allowed)
    ((ref * weights).sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(shard.grad, full.grad.chunk(tp, -1)[rank], atol=ATOL, rtol=1e-5)


def tp_layers_worker(rank: int, world_size: int) -> int:
    groups = build_parallel_groups(Layout(tp=world_size))
    assert groups is not None and groups.tp_rank == rank
    _check_linear_layers(groups.tp_group, rank, world_size)
    _check_embedding_and_head(groups.tp_group, rank, world_size)
    _check_masked_logprobs(groups.tp_group, rank, world_size)
    return rank


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_layers_match_serial(world_size: int) -> None:
    assert run_distributed(tp_layers_worker, world_size) == list(range(world_size))
