"""Multi-turn generation and its training side under tensor and pipeline parallelism (2 gloo processes).

* generate_turns at tp=2 (the turn source on tp rank 0 only, its answers broadcast), dropping
  finished trajectories from its decode step, samples what the serial loop keeping every row
  samples, token for token, with the same logprobs; on a Qwen2 shape with one KV head, so K/V
  are replicated under tp and the observation prefill takes the kv_index path;
* the training call's logprobs of a multi-turn rollout (ModelEngine.forward_logprobs at tp=2 and
  at pp=2) equal the generation's on every sampled position;
* the policy loss of such a rollout (masked by its response_mask, as actors.worker.rollout packs
  it) has zero gradient at every observation position, under the same layouts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.engine.model import Transformer
from actors.generation import TurnResult, generate_turns
from actors.generation.decoding import GenerationConfig
from actors.generation.sampling import SamplingParams
from planning.layout import Layout
from planning.models import ModelSpec
from tests.actors.generation.test_generate_dist import prompts_for, save_hf, serial_model
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist
torch.set_num_threads(1)

TURNS = [3, 2, 1, 1, 3, 2]  # rows 1 and 2 are two samples of one prompt (prompts_for shares it)
BUDGET = 24
CONFIG = GenerationConfig(4, SamplingParams(temperature=1.0), seed=7, eos_token_id=5)  # compact_fraction 0.75


class ImmediateTurns:
    """Answers every turn at once (deterministic): row r's observation is (20 + r, 21 + r, 22)."""

    def __init__(self, prompts: list[torch.Tensor]) -> None:
        self._prompts, self._ready, self._turns = prompts, [], [0] * len(prompts)

    def prompts(self) -> list[list[int]]:
        return [p.tolist() for p in self._prompts]

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        self._turns[row] += 1
        done = last or self._turns[row] >= TURNS[row]
        self._ready.append(TurnResult(row, () if done else (20 + row, 21 + row, 22), done))

    def poll(self, wait_s: float) -> list[TurnResult]:
        out, self._ready = self._ready, []
        return out

    def pending(self) -> int:
        return len(self._ready)


def summary(out: Any) -> dict[str, list]:
    return {"responses": [r.tolist() for r in out.responses], "logprobs": [lp.tolist() for lp in out.logprobs],
            "masks": [m.tolist() for m in out.response_masks], "compactions": out.stats["compactions"]}


def packed(prompts: list[torch.Tensor], ref: dict[str, list]) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor]:
    """Prompt + response of every row packed, and the loss mask (0 on prompts and observations)."""
    tokens, masks, lengths = [], [], []
    for p, r, m in zip(prompts, ref["responses"], ref["masks"]):
        tokens += [p, torch.tensor(r)]
        masks += [torch.zeros(p.numel()), torch.tensor(m)]
        lengths.append(p.numel() + len(r))
    return torch.cat(tokens), tuple(lengths), torch.cat(masks)


def under_layouts(rank: int, world_size: int, path: str, ref: dict[str, list]) -> dict[str, Any]:
    from actors.engine.hf_io import load_hf_checkpoint
    from actors.engine.model_engine import ModelEngine, SequenceBatch
    from actors.engine.parallelize import build_model_shard
    from actors.engine.process_groups import build_parallel_groups, destroy_parallel_groups
    from actors.rl.losses import ppo_policy_loss

    spec = ModelSpec.from_hf_config(path)
    prompts = prompts_for(spec.vocab_size)
    results: dict[str, Any] = {}
    for text in ("tp2", "pp2"):
        layout = Layout.parse(text)
        groups = build_parallel_groups(layout)
        coords = (groups.dp_rank, groups.tp_rank, groups.pp_rank)
        model = build_model_shard(spec, False, layout, coords, groups, "cpu", torch.float32, seed=None)
        load_hf_checkpoint(path, spec, False, model, groups.tp_rank, layout.tp)
        if layout.pp == 1:
            source = ImmediateTurns(prompts) if groups.tp_rank == 0 else None
            results[f"{text}/generate"] = summary(generate_turns(model.eval(), prompts, CONFIG, BUDGET, source, groups))
        tokens, lengths, mask = packed(prompts, ref)
        engine = ModelEngine(spec, False, groups, "cpu", seed=None, model=model.train())
        batch = SequenceBatch(tokens, lengths)
        results[f"{text}/logprobs"] = engine.forward_logprobs(batch, 1, CONFIG.sampling.temperature).tolist()
        # d loss / d logprobs of the masked policy loss: zero wherever the mask is.
        logprobs = engine.forward_logprobs(batch, 1).detach().requires_grad_(True)
        advantages = torch.linspace(-1.0, 1.0, tokens.numel()) * mask
        ppo_policy_loss(logprobs, logprobs.detach() - 0.1, advantages, mask, 0.2).loss.backward()
        results[f"{text}/grad"] = logprobs.grad.tolist()
        destroy_parallel_groups(groups)
    return results


def test_multiturn_under_tp2_and_pp2_matches_serial(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "Qwen2")
    serial: Transformer = serial_model(path)
    prompts = prompts_for(serial.spec.vocab_size)
    ref = summary(generate_turns(serial, prompts, dataclasses.replace(CONFIG, compact_fraction=0.0), BUDGET,
                                 ImmediateTurns(prompts)))
    assert any(0.0 in m for m in ref["masks"]), "no observation was appended"
    per_rank = run_distributed(under_layouts, 2, str(path), ref)
    for rank_result in per_rank:
        got = rank_result["tp2/generate"]
        assert got["responses"] == ref["responses"] and got["masks"] == ref["masks"]
        assert ref["compactions"] == 0 and got["compactions"] >= 1
        for a, b in zip(got["logprobs"], ref["logprobs"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    tokens, lengths, mask = packed(prompts, ref)
    sampled = [lp for row in ref["logprobs"] for lp in row]
    for text in ("tp2", "pp2"):
        train_side = torch.tensor(per_rank[0][f"{text}/logprobs"])
        # Generation's logprobs, placed on the packed rows: entry i is about token i.
        expected = torch.zeros_like(train_side)
        start = 0
        for p, r in zip(prompts, ref["logprobs"]):
            expected[start + p.numel():start + p.numel() + len(r)] = torch.tensor(r)
            start += p.numel() + len(r)
        on = mask.bool()
        assert torch.allclose(train_side[on], expected[on], atol=1e-5), text
        grad = torch.tensor(per_rank[0][f"{text}/grad"])
        assert torch.all(grad[~on] == 0) and torch.any(grad[on] != 0), text
    assert len(sampled) == tokens.numel() - sum(p.numel() for p in prompts) and len(lengths) == len(prompts)
