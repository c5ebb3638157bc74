"""ShardedAdamW with part of its state in host memory (actors.engine.optimizer_offload) against the
same optimizer with everything on the device: the same weights and states bit for bit, steps,
moves and checkpoints alike (the update runs the same elementwise kernels on the same values).

Chunks are made small (4096 elements) so parameters straddle chunk boundaries and the
device/host split; a dist case checks dp=2 (the host part's master reaches the all-gather).
"""

from __future__ import annotations

import pytest
import torch

from actors.engine import ModelEngine, ParallelGroups, SequenceBatch
from actors.engine.optimizer import OPTIMIZER_STATE_KEYS, AdamWConfig, ShardedAdamW
from actors.engine.optimizer_offload import ALIGN, ChunkStreamer, HostState, device_elements
from actors.engine.process_groups import build_parallel_groups
from actors.rl import LossSums, sft_loss
from actors.worker.state import load_role_state, save_role_state
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement
from tests.dist_harness import run_distributed

CONFIG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, total_steps=6)
# Sizes chosen to cross 4096-element chunks and the split inside parameters (29,571 elements).
SHAPES = {"a.weight": (130, 97), "a.norm": (97,), "b.weight": (61, 200), "b.bias": (200,), "c.weight": (41, 13)}


def make_params(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=gen))) for name, shape in SHAPES.items()]


def set_grads(params: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def train(optimizer: ShardedAdamW, params: list[tuple[str, torch.nn.Parameter]], steps: range) -> None:
    for step in steps:
        set_grads(params, step)
        optimizer.step()
        optimizer.zero_grad()


def offloaded(params: list[tuple[str, torch.nn.Parameter]], fraction: float, dp_group: object = None,
              norm_group: object = None) -> ShardedAdamW:
    optimizer = ShardedAdamW(params, CONFIG, dp_group, norm_group, host_fraction=fraction)
    optimizer.offload_chunk = ALIGN
    return optimizer


def assert_same(a: ShardedAdamW, b: ShardedAdamW) -> None:
    for p, q in zip(a.params, b.params):
        assert torch.equal(p, q)
    for key in OPTIMIZER_STATE_KEYS:
        whole_a, whole_b = a.full_state(key), b.full_state(key)
        assert all(torch.equal(whole_a[n], whole_b[n]) for n in whole_a), key


@pytest.mark.unit
def test_device_elements_moves_at_least_the_fraction_on_aligned_boundaries() -> None:
    assert device_elements(100_000, 0.0) == 100_000
    for fraction in (0.1, 0.5, 0.99, 1.0):
        split = device_elements(100_000, fraction)
        assert split % ALIGN == 0 and 100_000 - split >= fraction * 100_000
    assert device_elements(3000, 0.2) == 0  # a slice smaller than one alignment goes whole
    with pytest.raises(ValueError, match=r"host_fraction=1.5: must be in \[0, 1\]"):
        device_elements(10, 1.5)
    with pytest.raises(ValueError, match="multiple of 4096"):
        ChunkStreamer(HostState(10, pin=False), torch.device("cpu"), chunk_elements=1000)


@pytest.mark.unit
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_offloaded_steps_equal_the_all_device_steps_bit_for_bit(fraction: float) -> None:
    torch.set_num_threads(1)
    ref_params, off_params = make_params(0), make_params(0)
    ref, off = ShardedAdamW(ref_params, CONFIG, None, None), offloaded(off_params, fraction)
    assert off.host is not None and off.split == device_elements(off.slice_size, fraction)
    assert off.master.numel() == off.split and off.host.n == off.slice_size - off.split
    assert len(ChunkStreamer(off.host, off.device, off.offload_chunk).ranges()) >= 3
    train(ref, ref_params, range(4))
    train(off, off_params, range(4))
    assert_same(ref, off)


@pytest.mark.unit
def test_offloaded_state_moves_both_ways_and_continues_exactly() -> None:
    """full_state of an offloaded optimizer (host views) loaded into an all-device one and back,
    as a move to another layout or another plan would: the next steps equal the unmoved ones."""
    torch.set_num_threads(1)
    stay_params = make_params(1)
    stay = offloaded(stay_params, 0.5)
    train(stay, stay_params, range(2))
    on_device_params = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in stay_params]
    on_device = ShardedAdamW(on_device_params, CONFIG, None, None)
    for key in OPTIMIZER_STATE_KEYS:
        views = stay.full_state(key, on_host=True)
        assert all(v.device.type == "cpu" and v.shape == SHAPES[n] for n, v in views.items())
        on_device.load_full_state(key, views)
    on_device.steps_done = stay.steps_done
    back_params = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in stay_params]
    back = offloaded(back_params, 0.8)
    for key in OPTIMIZER_STATE_KEYS:
        back.load_full_state(key, on_device.full_state(key))
    back.steps_done = stay.steps_done
    for optimizer, params in ((stay, stay_params), (on_device, on_device_params), (back, back_params)):
        train(optimizer, params, range(2, 4))
    assert_same(stay, on_device)
    assert_same(stay, back)


SPEC = ModelSpec("offload-ckpt", "llama", vocab_size=64, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=16, max_position_embeddings=64)


def _loss(logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
    return sft_loss(logprobs.float(), data["mask"])


def _batch(step: int) -> SequenceBatch:
    gen = torch.Generator().manual_seed(step)
    lengths = (7, 5, 9)
    mask = torch.ones(sum(lengths))
    return SequenceBatch(torch.randint(3, 64, (sum(lengths),), generator=gen), lengths, {"mask": mask})


def _engine(fraction: float) -> ModelEngine:
    return ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", torch.float32, seed=0, optim_config=CONFIG,
                       optimizer_host_fraction=fraction)


@pytest.mark.unit
def test_resume_from_a_checkpoint_with_offloaded_state_equals_the_uninterrupted_run(tmp_path: object) -> None:
    torch.set_num_threads(1)
    whole = _engine(0.0)
    for step in range(3):
        whole.train_step(_batch(step), _loss)
    first = _engine(0.6)
    for step in range(2):
        first.train_step(_batch(step), _loss)
    assert first.optimizer.host is not None
    placement = Placement(Mesh(0, 1, 1), Layout())
    save_role_state(first, tmp_path)
    resumed = _engine(0.6)
    load_role_state(resumed, SPEC, False, placement, placement, 0, tmp_path)
    resumed.optimizer.reload_master()
    assert resumed.optimizer.steps_done == 2
    resumed.train_step(_batch(2), _loss)
    for (name, p), (_, q) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name


def dp_worker(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    groups = build_parallel_groups(Layout(dp=2))
    ref_params, off_params = make_params(2), make_params(2)
    ref = ShardedAdamW(ref_params, CONFIG, groups.dp_group, groups.mesh_group)
    off = offloaded(off_params, 0.7, groups.dp_group, groups.mesh_group)
    assert off.host is not None and off.lo == rank * off.slice_size
    train(ref, ref_params, range(3))
    train(off, off_params, range(3))
    assert_same(ref, off)
    return "ok"


@pytest.mark.dist
def test_offloaded_steps_equal_the_all_device_steps_at_dp2() -> None:
    assert run_distributed(dp_worker, 2) == ["ok", "ok"]


@pytest.mark.gpu
def test_streamed_cuda_steps_equal_the_all_device_steps() -> None:
    """On CUDA with bf16 parameters: the host part streamed on its own copy streams (pinned,
    registered host buffer) gives the all-device optimizer's weights and states bit for bit."""
    device = torch.device("cuda")

    def cuda_params() -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, torch.nn.Parameter(p.detach().to(device, torch.bfloat16))) for n, p in make_params(3)]

    ref_params, off_params = cuda_params(), cuda_params()
    ref, off = ShardedAdamW(ref_params, CONFIG, None, None), offloaded(off_params, 0.6)
    assert off.host is not None and off.host.registered and off.host.buffer.is_pinned()
    for optimizer, params in ((ref, ref_params), (off, off_params)):
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device, torch.bfloat16)
            optimizer.step()
            optimizer.zero_grad()
    assert_same(ref, off)
