"""The batch of one train call: every row's producer shards merged and packed as a `Rollout`.

Shared by the train ops (actors.worker.train, actors.worker.outcome_train) and by the behaviour
policy's logprobs and importance weights (actors.worker.behaviour), which all read it; it sits
below them so none of them imports another for the type. Shapes follow actors.rl.advantages:
per-token tensors are float32 [T] over the packed rows (entry i is about token i), per-row [B].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from actors.engine import SequenceBatch
from actors.worker.calls import CallContext, shareable_prefixes
from actors.worker.data import cu_seqlens_of, merge_shards, pack_rows, scatter_responses


@dataclass(frozen=True)
class Rollout:
    """The whole batch of one train call, packed. tokens int64 [T]; mask, logprobs (sampling),
    ref_logprobs, values, old_logprobs (from an actor_inf call) float32 [T] (zeros on prompts;
    `mask` is also 0 on a multi-turn rollout's observation ids, from its `response_mask`);
    scores float32 [B] (after the no-EOS penalty); cu_seqlens int64 [B+1]; prompt_index int64 [B]
    (which prompt each row answers) when the generation gave it; prompt_lengths: each row's prompt
    tokens (the prefix its neighbours may share, actors.engine.shared_prefix)."""

    tokens: Tensor
    lengths: tuple[int, ...]
    cu_seqlens: Tensor
    mask: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor | None
    values: Tensor | None
    scores: Tensor
    raw_scores: Tensor
    response_lengths: list[int]
    old_logprobs: Tensor | None = None
    prompt_index: Tensor | None = None
    prompt_lengths: tuple[int, ...] | None = None


def load_rollout(ctx: CallContext, inputs: Sequence[dict | None], need: Sequence[str]) -> Rollout:
    """Merge the producer shards of every row into a `Rollout` (keys in `need` are required)."""
    optional = [k for k in ("ref_logprobs", "values", "no_eos", "greedy_rewards", "old_logprobs", "prompt_index",
                            "response_mask") if k not in need]
    cols = merge_shards(inputs, range(ctx.call.n_rows), ["prompt_ids", "response_ids", "logprobs", "rewards", *need],
                        optional=optional)
    tokens, lengths, mask = pack_rows(cols["prompt_ids"], cols["response_ids"])
    plens = [t.numel() for t in cols["prompt_ids"]]
    response_lengths = [t.numel() for t in cols["response_ids"]]
    if "response_mask" in cols:  # multi-turn: observation ids stay out of every loss, KL and advantage
        mask = scatter_responses(cols["response_mask"], plens)
        response_lengths = [int(m.sum()) for m in cols["response_mask"]]  # sampled tokens only
    raw = torch.tensor([float(x) for x in cols["rewards"]], dtype=torch.float32)
    penalty = float(ctx.params.get("no_eos_penalty", 0.0))
    no_eos = torch.tensor([float(x) for x in cols.get("no_eos", [False] * len(lengths))])
    per_token = {k: scatter_responses(cols[k], plens) if k in cols else None
                 for k in ("ref_logprobs", "values", "old_logprobs")}
    index = torch.tensor([int(x) for x in cols["prompt_index"]]) if "prompt_index" in cols else None
    return Rollout(tokens, tuple(lengths), cu_seqlens_of(lengths), mask, scatter_responses(cols["logprobs"], plens),
                   per_token["ref_logprobs"], per_token["values"], raw - penalty * no_eos, raw,
                   response_lengths, per_token["old_logprobs"], index, tuple(plens))


def prompt_batch(ctx: CallContext, r: Rollout, token_data: dict[str, Tensor] | None = None) -> SequenceBatch:
    """The rollout's rows as a batch; with params['share_prompts'] (default true) the engine holds
    each prompt its neighbouring rows share once per micro-batch (actors.engine.shared_prefix)."""
    prefixes = None if r.prompt_lengths is None else shareable_prefixes(ctx, r.prompt_lengths)
    return SequenceBatch(r.tokens, r.lengths, token_data or {}, prefix_lengths=prefixes)


__all__ = ["Rollout", "load_rollout", "prompt_batch"]
