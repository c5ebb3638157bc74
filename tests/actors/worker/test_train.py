"""The actor's old logprobs taken from its training forward (one minibatch, one epoch) instead of
a separate forward pass: ratios exactly 1 and the recomputing path's gradient, with and without
truncated importance weights against the sampling logprobs (FP8 rollouts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors.engine import ModelEngine, SequenceBatch
from actors.worker import CallSpec, ModelWorker
from actors.worker.data import pack_rows
from actors.rl import truncated_is_weights
from actors.worker.behaviour import forward_is_metrics
from actors.worker.train import policy_loss_fn, reuses_forward_logprobs
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement

pytestmark = pytest.mark.unit

SPEC = ModelSpec("reuse", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
ONE = Placement(Mesh(0, 1, 1), Layout())
PROMPT_LENS, RESPONSE_LENS = (3, 2, 4, 2, 5, 3), (6, 1, 2, 4, 3, 5)
TEMPERATURE = 0.7


def actor_worker() -> ModelWorker:
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("actor", SPEC, False, ONE, None, 0, True, {"lr": 1e-2})
    return worker


def rollout() -> dict[str, list[Any]]:
    gen = torch.Generator().manual_seed(3)
    return {"prompt_ids": [torch.randint(3, SPEC.vocab_size, (p,), generator=gen) for p in PROMPT_LENS],
            "response_ids": [torch.randint(3, SPEC.vocab_size, (r,), generator=gen) for r in RESPONSE_LENS],
            "logprobs": [-torch.rand(r, generator=gen) - 0.5 for r in RESPONSE_LENS],
            "rewards": [1.0, 0.0, 2.0, 0.5, -1.0, 0.25], "prompt_index": [0, 0, 1, 1, 2, 2],  # GRPO groups of 2
            "row_start": 0, "n": len(PROMPT_LENS)}


def grads(engine: ModelEngine) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    engine.model.zero_grad(set_to_none=True)
    return out


def test_only_one_minibatch_and_one_epoch_reuse_the_forward() -> None:
    assert reuses_forward_logprobs({})
    assert reuses_forward_logprobs({"ppo_minibatches": 1, "ppo_epochs": 1})
    assert not reuses_forward_logprobs({"ppo_minibatches": 2})
    assert not reuses_forward_logprobs({"ppo_epochs": 2})
    assert not reuses_forward_logprobs({"recompute_logprobs": False})  # the sampling logprobs are wanted


def test_reused_logprobs_give_ratio_one_and_the_recomputing_gradient() -> None:
    engine = actor_worker()._roles["actor"].engines[ONE]
    cols = rollout()
    tokens, lengths, mask = pack_rows(cols["prompt_ids"], cols["response_ids"])
    advantages = torch.linspace(-1.0, 1.5, tokens.numel()) * mask
    sample = torch.zeros(tokens.numel())
    sample[mask.bool()] = torch.cat(cols["logprobs"])
    # The recomputing path: a separate (eval-mode) forward, then the step on the same weights.
    old = engine.forward_logprobs(SequenceBatch(tokens, tuple(lengths)), 2, TEMPERATURE).float() * mask
    params = {"clip_eps": 0.2, "loss_agg": "token-mean"}
    data = {"mask": mask, "advantages": advantages}
    recomputed, _ = engine.backward_step(SequenceBatch(tokens, tuple(lengths), {**data, "old_logprobs": old}),
                                         policy_loss_fn(params), 2, TEMPERATURE)
    want = grads(engine)
    reused, _ = engine.backward_step(SequenceBatch(tokens, tuple(lengths), {**data, "sample_logprobs": sample}),
                                     policy_loss_fn(params, old_from_forward=True), 2, TEMPERATURE)
    got = grads(engine)
    # Ratio exactly 1 on every token: no clipping, KL(old || new) exactly 0, loss = -mean(A).
    assert reused["ppo_kl"] == 0.0 and reused["pg_clipfrac"] == 0.0
    assert reused["pg_loss"] == pytest.approx(-float(advantages.sum() / mask.sum()), abs=1e-6)
    assert reused["pg_loss"] == pytest.approx(recomputed["pg_loss"], abs=1e-6)
    assert reused["old_logprob_diff"] == pytest.approx(float(((old - sample).abs() * mask).sum() / mask.sum()),
                                                       abs=1e-5)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reused_forward_importance_weights_match_the_recomputing_path(level: str) -> None:
    engine = actor_worker()._roles["actor"].engines[ONE]
    cols = rollout()
    tokens, lengths, mask = pack_rows(cols["prompt_ids"], cols["response_ids"])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    advantages = torch.linspace(-1.0, 1.5, tokens.numel()) * mask
    old = engine.forward_logprobs(SequenceBatch(tokens, tuple(lengths)), 2, TEMPERATURE).float() * mask
    # Sampling logprobs near the model's, off by up to +-0.6 a token: some weights pass the threshold.
    noise = (torch.rand(tokens.numel(), generator=torch.Generator().manual_seed(5)) - 0.5) * 1.2
    sample = (old + noise) * mask
    params = {"clip_eps": 0.2, "loss_agg": "token-mean", "rollout_is": level, "rollout_is_threshold": 1.2}
    weights, stats = truncated_is_weights(old, sample, mask, cu, level, 1.2)
    assert 0 < stats["rollout_is_truncated"] < 1  # the case covers truncated and kept weights
    data = {"mask": mask, "advantages": advantages}
    recomputed, _ = engine.backward_step(
        SequenceBatch(tokens, tuple(lengths), {**data, "old_logprobs": old, "is_weights": weights}),
        policy_loss_fn(params), 2, TEMPERATURE)
    want = grads(engine)
    reused, _ = engine.backward_step(SequenceBatch(tokens, tuple(lengths), {**data, "sample_logprobs": sample}),
                                     policy_loss_fn(params, old_from_forward=True), 2, TEMPERATURE)
    got = grads(engine)
    assert reused["pg_loss"] == pytest.approx(recomputed["pg_loss"], abs=1e-6)
    metrics = forward_is_metrics({f"actor/{k}": v for k, v in reused.items()})
    for name, value in stats.items():
        assert metrics[f"actor/{name}"] == pytest.approx(value, rel=1e-5), name
    assert not any(key.startswith("actor/is_") for key in metrics)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_grpo_op_skips_the_separate_forward_with_one_minibatch(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = actor_worker()
    engine = worker._roles["actor"].engines[ONE]
    cols = rollout()
    params = {"op": "grpo_actor", "group_size": 2, "temperature": TEMPERATURE, "ppo_minibatches": 1}

    def no_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the old logprobs were recomputed by a separate forward pass")

    monkeypatch.setattr(engine, "forward_logprobs", no_forward)
    meta, _ = worker.run_call(CallSpec("actor_train", "actor", "train", ONE, 0, len(PROMPT_LENS), params), cols)
    assert meta["actor/ppo_kl"] == 0.0 and meta["actor/pg_clipfrac"] == 0.0 and meta["actor/optimizer_steps"] == 1.0
    assert meta["actor/old_logprob_diff"] > 0  # the made-up sampling logprobs differ from the model's
    # FP8 rollouts' importance weights come from the same forward: still no separate pass.
    meta, _ = worker.run_call(CallSpec("actor_train", "actor", "train", ONE, 1, len(PROMPT_LENS),
                                       {**params, "rollout_is": "token"}), cols)
    assert {"actor/rollout_is_mean", "actor/rollout_is_max", "actor/rollout_is_truncated"} <= set(meta)
    # The random model's logprobs (~ -log 64) sit far below the made-up sampling ones: weights < 1.
    assert 0 < meta["actor/rollout_is_mean"] <= meta["actor/rollout_is_max"] < 1
    assert meta["actor/rollout_is_truncated"] == 0.0
    monkeypatch.undo()
    meta, _ = worker.run_call(CallSpec("actor_train", "actor", "train", ONE, 2, len(PROMPT_LENS),
                                       {**params, "ppo_minibatches": 2}), cols)
    assert meta["actor/optimizer_steps"] == 2.0  # two minibatches: recomputed, as before
