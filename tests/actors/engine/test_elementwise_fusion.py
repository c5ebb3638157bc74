"""The fused elementwise path (torch.compile of the norms, rotary, SwiGLU gate and residual add;
actors.engine.model.set_elementwise_fusion) against eager on CUDA in bf16: the same logits and
gradients to bf16 rounding. CUDA shards fuse by default; the CPU path (the parity tests) is eager."""

from __future__ import annotations

import pytest
import torch

from actors.engine.model import Transformer, set_elementwise_fusion
from actors.engine.packing import pack_sequences
from actors.engine.parallelize import build_model_shard
from planning.layout import Layout
from planning.models import model_preset


@pytest.mark.unit
def test_cuda_shards_fuse_and_cpu_shards_do_not() -> None:
    spec = model_preset("tiny")
    shard = build_model_shard(spec, False, Layout(), (0, 0, 0), None, "cpu", torch.float32)
    assert not any(getattr(m, "fuse_elementwise", False) for m in shard.modules())
    set_elementwise_fusion(shard, True)
    assert shard.model.layers["0"].mlp.fuse_elementwise and shard.model.norm.fuse_elementwise


@pytest.mark.gpu
def test_fused_elementwise_matches_eager_on_cuda() -> None:
    torch.manual_seed(0)
    spec = model_preset("tiny")
    model = Transformer(spec)
    model.init_weights(0)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    tokens, batch = pack_sequences([torch.randint(0, spec.vocab_size, (n,)) for n in (37, 120, 5)], "cuda")

    def run(fuse: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        set_elementwise_fusion(model, fuse)
        model.zero_grad()
        logits = model(tokens, batch)
        torch.log_softmax(logits.float(), -1)[:, 3].sum().backward()
        return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

    eager_logits, eager_grads = run(False)
    fused_logits, fused_grads = run(True)
    assert torch.allclose(fused_logits, eager_logits, atol=3e-2, rtol=3e-2)
    for name, grad in eager_grads.items():
        scale = grad.abs().max().item() + 1e-6
        assert (fused_grads[name] - grad).abs().max().item() <= 0.05 * scale, name
