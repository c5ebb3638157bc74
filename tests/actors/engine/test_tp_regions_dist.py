"""Under tensor parallelism each block's two inputs enter the tp region once (actors/engine/
parallelize.py's forward pre-hook), not once per projection: the backward all-reduces the
attention input's gradient once for q, k and v together and the MLP input's once for gate and up.
dist: 2 gloo processes build a tp=2 shard (K/V split, and K/V replicated when tp does not divide
the KV heads), count the region entries (and the shared-input projections) in the autograd graph
of the logits, and check the sharded gradients against the serial model's."""

from __future__ import annotations

import pytest
import torch

from actors.engine.model import Transformer
from actors.engine.packing import pack_sequences
from actors.engine.parallelize import build_model_shard
from actors.engine.process_groups import build_parallel_groups
from planning.layout import Layout
from planning.models import ModelSpec, model_preset, tp_split_dim
from tests.dist_harness import run_distributed

REPLICATED_KV = ModelSpec("one-kv-head", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                          n_heads=4, n_kv_heads=1, head_dim=8, max_position_embeddings=64, bos_token_id=1,
                          eos_token_id=2)


def graph_nodes(output: torch.Tensor, kind: str) -> int:
    """Nodes whose name holds `kind` in the autograd graph that produced `output`."""
    seen, stack, count = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += kind in node.name()
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def check_spec(spec: ModelSpec, rank: int, tp: int) -> None:
    groups = build_parallel_groups(Layout(tp=tp))
    shard = build_model_shard(spec, False, Layout(tp=tp), (0, rank, 0), groups, "cpu", torch.float32)
    torch.manual_seed(1)
    tokens, batch = pack_sequences([torch.randint(3, spec.vocab_size, (n,)) for n in (9, 14)])
    logits = shard(tokens, batch)  # [T, V/tp]: this rank's vocab slice
    # Two entries per block (attention input, MLP input) and one for the head's input.
    assert graph_nodes(logits, "_CopyToTP") == 2 * spec.n_layers + 1
    # Inside the region q, k, v (split or replicated) and gate, up each read the input through one
    # node, whose backward writes its gradient once (actors.engine.main_grad.shared_input_linears).
    assert graph_nodes(logits, "_SharedInputLinears") == 2 * spec.n_layers
    logits.pow(2).sum().backward()  # the sum over vocab slices is the serial sum, split by rank

    serial = Transformer(spec, False)
    serial.init_weights(0)
    serial(tokens, batch).pow(2).sum().backward()
    full = dict(serial.named_parameters())
    for name, param in shard.named_parameters():
        if "layers." not in name:
            continue  # the tied embedding's gradient gets its tp sum from the engine, not the model
        dim = tp_split_dim(name, spec, tp)
        expected = full[name].grad if dim is None else full[name].grad.chunk(tp, dim)[rank]
        if dim is None and "_proj" in name:  # replicated K/V: each rank holds a partial gradient
            summed = param.grad.clone()
            torch.distributed.all_reduce(summed, group=groups.tp_group)
            torch.testing.assert_close(summed, expected, rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-5)


def worker(rank: int, world_size: int) -> int:
    for spec in (model_preset("tiny"), REPLICATED_KV):
        check_spec(spec, rank, world_size)
    return rank


@pytest.mark.dist
def test_each_block_input_enters_the_tp_region_once() -> None:
    assert run_distributed(worker, 2) == [0, 1]
