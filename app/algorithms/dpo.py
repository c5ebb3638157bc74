"""DPO (Rafailov et al. 2023): offline preference optimisation on (prompt, chosen, rejected) pairs
against a frozen reference policy; no generation, no reward model, no critic.

Calls of `planning.algorithm_graphs.dpo_graph` (every call sees 2 x n_pairs rows; row 2i is prompt +
chosen answer of pair i and row 2i + 1 is prompt + rejected answer, see `preference_shard`):

  ref_inf      logprobs    ref_logprobs per response token under the reference (temperature 1)
  actor_train  dpo_actor   -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h), with
                           h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)) summed
                           over the answer tokens (actors.rl.losses.dpo_loss), ppo_epochs x
                           ppo_minibatches optimizer steps over shuffled pairs. The engine's dp
                           and micro-batch splits keep each pair together (group_size=2).
                           Metrics: actor/dpo_loss, actor/reward_margin, actor/rewards_chosen,
                           actor/rewards_rejected, actor/reward_accuracy, actor/grad_norm, actor/lr.

The built-in toy preference task (`toy_preference_records`) reuses the count-on prompts of
app.data.toy_task: the chosen answer counts up from the last prompt digit (the toy target), the
rejected one counts down, so a policy that learns the preference also learns the task.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.data import TOY_RESPONSE_LEN, PreferenceExample, PreferenceRecord, generate_toy_prompts, toy_target
from planning.dataflow import MFC


@dataclass(frozen=True)
class DPOHyperparams:
    """DPO's knobs (names as in TRL / veRL); epochs and minibatches come from the batch section."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    epochs: int = 1
    minibatches: int = 1
    shuffle: bool = True
    seed: int = 0
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta={self.beta}: must be > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing}: must be in [0, 0.5)")
        if self.epochs < 1:
            raise ValueError(f"batch.ppo_epochs={self.epochs}: must be >= 1")
        if self.minibatches < 1:
            raise ValueError(f"batch.ppo_minibatches={self.minibatches}: must be >= 1")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches}: must be >= 1 or None")


def call_params(mfc: MFC, hp: DPOHyperparams) -> dict[str, Any]:
    """CallSpec.params of one call of the DPO graph."""
    if mfc.kind == "inference" and mfc.role == "ref":
        return {"op": "logprobs", "temperature": 1.0, "out_key": "ref_logprobs"}
    if mfc.kind == "train" and mfc.role == "actor":
        params: dict[str, Any] = {
            "op": "dpo_actor", "beta": hp.beta, "label_smoothing": hp.label_smoothing, "ppo_epochs": hp.epochs,
            "ppo_minibatches": hp.minibatches, "shuffle": hp.shuffle, "seed": hp.seed, "temperature": 1.0,
        }
        if hp.micro_batches is not None:
            params["micro_batches"] = hp.micro_batches
        return params
    raise ValueError(f"DPO call {mfc.name}: {mfc.kind} on role {mfc.role!r}; DPO runs ref inference and actor "
                     "training only")


def toy_rejected(prompt: str) -> str:
    """A wrong answer of the count-on task: TOY_RESPONSE_LEN digits counting DOWN from the last digit."""
    if not prompt or not prompt[-1].isdigit():
        raise ValueError(f"prompt={prompt!r}: the toy task needs a prompt ending in a digit")
    last = int(prompt[-1])
    return "".join(str((last - 1 - k) % 10) for k in range(TOY_RESPONSE_LEN))


def toy_preference_records(n: int, seed: int) -> list[PreferenceRecord]:
    """n toy pairs (the same for the same seed): chosen = the toy target, rejected = `toy_rejected`
    or, for every other pair, random digits that differ from the target (so both a fixed
    "count down" map and noise are dispreferred)."""
    rng = random.Random(seed * 7919 + 17)
    records = []
    for i, row in enumerate(generate_toy_prompts(n, seed)):
        prompt, chosen = row["prompt"], toy_target(row["prompt"])
        rejected = toy_rejected(prompt)
        if i % 2:
            rejected = chosen
            while rejected == chosen:
                rejected = "".join(rng.choice("0123456789") for _ in range(TOY_RESPONSE_LEN))
        records.append(PreferenceRecord(prompt, chosen, rejected, f"toy:{i}"))
    return records


def preference_shard(batch: Sequence[PreferenceExample]) -> dict[str, Any]:
    """The DPO calls' input: 2 x len(batch) rows, row 2i = (prompt, chosen) and row 2i + 1 =
    (prompt, rejected) of pair i; prompt_ids / response_ids int64 [p] / [r] per row."""
    import torch

    prompts: list[Any] = []
    responses: list[Any] = []
    for example in batch:
        prompt = torch.tensor(example.prompt_ids, dtype=torch.int64)
        prompts += [prompt, prompt.clone()]
        responses += [torch.tensor(example.chosen_ids, dtype=torch.int64),
                      torch.tensor(example.rejected_ids, dtype=torch.int64)]
    from actors.worker import make_shard

    return make_shard(0, {"prompt_ids": prompts, "response_ids": responses,
                          "pair_index": [example.index for example in batch for _ in (0, 1)]})


def preference_tokens(batch: Sequence[PreferenceExample]) -> tuple[int, int]:
    """(prompt tokens, answer tokens) of the 2 x len(batch) sequences of `preference_shard(batch)`."""
    prompt = sum(2 * len(e.prompt_ids) for e in batch)
    answers = sum(len(e.chosen_ids) + len(e.rejected_ids) for e in batch)
    return prompt, answers


__all__ = ["DPOHyperparams", "call_params", "preference_shard", "preference_tokens", "toy_preference_records",
           "toy_rejected"]
