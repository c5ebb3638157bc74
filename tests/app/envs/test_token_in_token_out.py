"""Token in, token out, end to end on a real byte-level BPE tokenizer and chat template: a tiny
random Qwen2 chat model plays an echo tool through EnvSessions and the multi-turn decode loop;
the trajectory the train call packs is exactly the ids the actor sampled plus the observation ids
the environments' chat-template deltas produced, byte for byte, and its loss mask is 1 exactly on
the sampled ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors.engine.model import Transformer
from actors.generation import TurnResult, generate_turns
from actors.generation.decoding import GenerationConfig
from actors.generation.sampling import SamplingParams
from actors.worker.data import pack_rows, scatter_responses
from app.envs.sessions import EnvSessions
from planning.models import ModelSpec
from tests.tiny_chat_model import build_tiny_chat_model

pytestmark = pytest.mark.unit
HERE = "tests.app.envs.test_token_in_token_out"


class EchoTool:
    """Answers every action with its length and a fixed word; done after three steps."""

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, sample: dict[str, Any]) -> str:
        return f"Add {sample['prompt']} and 3."

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.steps += 1
        return f"got {len(action_text)} characters", 0.5, self.steps >= 3, {}


class Recording:
    """A TurnSource wrapper that keeps what went through it: actions in, observation ids out."""

    def __init__(self, inner: EnvSessions) -> None:
        self.inner = inner
        self.log: dict[int, list[tuple[str, list[int]]]] = {}

    def prompts(self) -> list[list[int]]:
        return self.inner.prompts()

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        self.log.setdefault(row, []).append(("action", list(action_ids)))
        self.inner.submit(row, action_ids, last)

    def poll(self, wait_s: float) -> list[TurnResult]:
        found = self.inner.poll(wait_s)
        for result in found:
            if not result.done:
                self.log[result.row].append(("observation", list(result.observation_ids)))
        return found

    def pending(self) -> int:
        return self.inner.pending()


def test_trained_ids_are_the_sampled_ids_plus_the_observation_ids(tmp_path: Path) -> None:
    directory = build_tiny_chat_model(tmp_path / "chat")
    from actors.engine.hf_io import load_hf_checkpoint

    spec = ModelSpec.from_hf_config(directory)
    model = Transformer(spec, device="meta")
    model.to_empty(device="cpu")
    load_hf_checkpoint(directory, spec, False, model)
    sessions = EnvSessions(env=f"{HERE}:EchoTool", samples=[{"prompt": str(n)} for n in (4, 17, 250)],
                           tokenizer=str(directory), chat_template=True, observation_role="tool", max_turns=4,
                           max_observation_tokens=48, env_timeout_s=10.0, env_workers=3, reward_discount=1.0)
    source = Recording(sessions)
    prompts = [torch.tensor(ids) for ids in source.prompts()]
    config = GenerationConfig(6, SamplingParams(temperature=1.0), seed=3, eos_token_id=spec.eos_token_id)
    out = generate_turns(model.eval(), prompts, config, budget=200, source=source)
    outcomes = sessions.outcomes()
    sessions.close()
    for row, events in source.log.items():
        expected = [t for _, ids in events for t in ids]
        assert out.responses[row].tolist() == expected  # byte for byte
        mask = [float(kind == "action") for kind, ids in events for _ in ids]
        assert out.response_masks[row].tolist() == mask
        assert [kind for kind, _ in events][:2] == ["action", "observation"]
        assert outcomes[row]["turns"] == sum(kind == "action" for kind, _ in events)
    # What the train call packs (actors.worker.rollout): the same ids, the mask on sampled ids only.
    tokens, _, _ = pack_rows(prompts, out.responses)
    mask = scatter_responses(out.response_masks, [p.numel() for p in prompts])
    assert torch.equal(tokens, torch.cat([torch.cat([p, r]) for p, r in zip(prompts, out.responses)]))
    assert int(mask.sum()) == sum(len(ids) for e in source.log.values() for kind, ids in e if kind == "action")
