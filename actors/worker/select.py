"""The `select_rows` op: one batch made of chosen rows of several producer calls' shards.

DAPO's dynamic sampling (app.run.dynamic_sampling) generates and scores prompts in rounds and keeps
the groups whose rewards differ; this op gathers those rows, every column the rounds' shards hold
for them (token ids, logprobs, rewards, texts), into one shard of rows 0..n-1 that the later calls
read as they would read the generation's. It needs no model (the worker runs it like a rule reward).

params: input_rounds (the round of each input shard, in input order), round_rows (rows of one
round), keep ([round, row] of each output row, in order) and group_size: prompt_index becomes the
kept group's position (output row // group_size), so groups of different rounds never collide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.worker.calls import CallContext
from actors.worker.data import META_KEYS, make_shard, merge_shards


def run_select_rows(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict]:
    """(meta, shard of the kept rows) on the call's single rank."""
    p = ctx.params
    rounds = [int(r) for r in p["input_rounds"]]
    if len(rounds) != len(inputs):
        raise ValueError(f"call {ctx.call.name}: {len(inputs)} input shards but {len(rounds)} input_rounds")
    keep = [(int(r), int(row)) for r, row in p["keep"]]
    if len(keep) != ctx.call.n_rows:
        raise ValueError(f"call {ctx.call.name}: keeps {len(keep)} rows, n_rows={ctx.call.n_rows}")
    rows = range(int(p["round_rows"]))
    columns_by_round: dict[int, dict[str, list[Any]]] = {}
    for r in sorted({r for r, _ in keep}):
        shards = [s for s, sr in zip(inputs, rounds) if sr == r and s is not None]
        keys = sorted({k for s in shards for k in s if k not in META_KEYS})
        columns_by_round[r] = merge_shards(shards, rows, [], optional=keys)
    shared = set.intersection(*(set(c) for c in columns_by_round.values()))
    columns = {key: [columns_by_round[r][key][row] for r, row in keep] for key in sorted(shared)}
    group = int(p.get("group_size", 1))
    columns["prompt_index"] = [position // group for position in range(len(keep))]
    return {"row_start": 0, "n": len(keep), "owner": True}, make_shard(0, columns)


__all__ = ["run_select_rows"]
