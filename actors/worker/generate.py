"""The single-turn generation op of a worker (`run_generate`) and what every generation op shares:
its settings per dp rank and round (`generation_config`, `generation_seed`), which prompts a dp
rank's rows answer (`samples_per_prompt`, `prompt_columns`), and the full-distribution logprobs
of truncated sampling. actors.worker.multiturn builds the multi-turn op on the same pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from actors.engine import SequenceBatch
from actors.generation import GenerationConfig, SamplingParams
from actors.worker.calls import CallContext, micro_batching, owner_result, shard_of_my_rows
from actors.worker.data import gather_responses, load_tokenizer, merge_shards, pack_rows
from actors.worker.execution import generate_in_rounds, generation_rounds


def generation_seed(base: int, iteration: int, first_row: int) -> int:
    """Seed of one dp rank's generation: distinct per iteration and per first row, so dp ranks
    never share random numbers (a single rank starting at row 0 matches a serial run)."""
    return (base * 1_000_003 + iteration * 10_007 + first_row * 101) % (2**62)


def generation_config(ctx: CallContext, first_row: int, round_rows: range | None = None) -> GenerationConfig:
    """The generation settings of this dp rank (rows from `first_row`); `round_rows`: the rows,
    relative to `first_row`, of the round being generated (None: all of this rank's rows)."""
    p, spec = ctx.params, ctx.need_engine().spec
    greedy = bool(p.get("greedy", False))
    sampling = SamplingParams(0.0 if greedy else float(p.get("temperature", 1.0)), int(p.get("top_k", 0)),
                              float(p.get("top_p", 1.0)))
    if "max_new_tokens" not in p:
        raise ValueError(f"call {ctx.call.name}: params['max_new_tokens'] is required for generation")
    return GenerationConfig(
        max_new_tokens=int(p["max_new_tokens"]), sampling=sampling,
        seed=generation_seed(int(p.get("seed", 0)), ctx.call.iteration, first_row),
        eos_token_id=p.get("eos_token_id", spec.eos_token_id), ignore_eos=bool(p.get("ignore_eos", False)),
        pad_token_id=int(p.get("pad_token_id", 0)),
        use_cuda_graph=ctx.device.type == "cuda" and bool(p.get("cuda_graph", True)),
        compile_decode=ctx.device.type == "cuda" and bool(p.get("compile", False)),
        fp8_weights=bool(p.get("fp8", False)),
        kv_cache_dtype=str(p.get("kv_cache_dtype", "auto")),
        compact_fraction=float(p.get("compact_fraction", GenerationConfig.compact_fraction)),
        uniform_offset=round_rows.start if round_rows is not None else 0,
        uniform_total=len(ctx.my_rows) if round_rows is not None else None,
    )


def samples_per_prompt(ctx: CallContext) -> int:
    """params["n_samples"] of a generation call (rows per prompt), checked against its rows."""
    n_samples = int(ctx.params.get("n_samples", 1))
    if n_samples < 1 or ctx.call.n_rows % n_samples:
        raise ValueError(f"call {ctx.call.name}: n_samples={n_samples} must be >= 1 and divide n_rows={ctx.call.n_rows}")
    return n_samples


def prompt_columns(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict[str, list[Any]], list[int]]:
    """The prompts this dp rank's rows answer (prompt_ids, and prompt / answer where given) and,
    per row, its prompt's index in those columns (row r answers prompt r // n_samples)."""
    n_samples, rows = samples_per_prompt(ctx), ctx.my_rows
    prompt_rows = range(rows.start // n_samples, (rows.stop - 1) // n_samples + 1)
    cols = merge_shards(inputs, prompt_rows, ["prompt_ids"], optional=["prompt", "answer"])
    return cols, [r // n_samples - prompt_rows.start for r in rows]


def run_generate(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """Sample responses for this dp rank's rows; row r answers prompt r // n_samples."""
    engine, p = ctx.need_engine(), ctx.params
    n_samples = samples_per_prompt(ctx)
    rows = ctx.my_rows
    cols, index = prompt_columns(ctx, inputs)
    # One device tensor per prompt, shared by its rows: generation prefills it once for them all.
    distinct = [ids.to(ctx.device) for ids in cols["prompt_ids"]]
    prompts = [distinct[i] for i in index]
    # The host copies the shard hands back: the inputs themselves, not one device-to-host copy
    # (and stream synchronisation) per row.
    host_prompts = [cols["prompt_ids"][i].cpu() for i in index]
    rounds = generation_rounds(ctx.call.execution, len(prompts))
    out = generate_in_rounds(engine.model, engine.groups, prompts, rounds,
                             lambda part: generation_config(ctx, rows.start, part))
    # The phases' seconds (summed over rounds) are averaged over the ranks by the driver.
    meta = {"response_lengths": out.lengths, "gen_tokens": int(sum(out.lengths)), "gen_rounds": out.rounds,
            **{f"gen/{key}": value for key, value in out.seconds.items()}}
    responses, logprobs = out.responses, out.logprobs
    if out.sampling.truncates:  # collective over the mesh: every rank, before the owner check
        logprobs = full_distribution_logprobs(ctx, host_prompts, responses, out.sampling.temperature)
    if not ctx.owner:
        return owner_result(ctx, {}, meta)
    prefix = str(p.get("out_prefix", ""))
    columns: dict[str, list[Any]] = {
        f"{prefix}prompt_ids": host_prompts,
        f"{prefix}response_ids": responses,
        f"{prefix}logprobs": logprobs,
        f"{prefix}no_eos": out.no_eos,
        "prompt_index": [r // n_samples for r in rows],
    }
    for key in ("prompt", "answer"):
        if key in cols:
            columns[key] = [cols[key][i] for i in index]
    tokenizer = load_tokenizer(p.get("tokenizer"))
    if tokenizer is not None:  # two samples for the console; the reward call decodes the rest
        meta["samples"] = [{"prompt": columns["prompt"][i] if "prompt" in columns else None,
                            "response": tokenizer.decode(responses[i].tolist(), skip_special_tokens=True)}
                           for i in range(min(2, len(index)))]
    return shard_of_my_rows(ctx, columns, meta)


def full_distribution_logprobs(ctx: CallContext, prompts: list[Tensor], responses: list[Tensor],
                               temperature: float) -> list[Tensor]:
    """Logprobs [r_i] of this dp rank's responses under the full temperature-scaled distribution.

    Top-k/top-p sampling draws from a truncated, renormalised distribution, but the ref call and
    the train layout compute logprobs of the full one (as veRL does). The rollout's `logprobs`
    feed the KL penalty against the ref and, without recomputation, the PPO ratio, so they must
    be of the same distribution: otherwise the KL to an identical ref is -log(kept mass) > 0.
    Collective over the mesh: the rows (token ids) are gathered over dp, then the engine splits
    the forward over dp as for any inference call and every rank keeps its own rows.
    """
    engine, groups = ctx.need_engine(), ctx.groups
    mine = list(zip(prompts, responses))
    rows = mine
    if groups.dp_group is not None:
        gathered: list[Any] = [None] * groups.layout.dp
        dist.all_gather_object(gathered, mine, group=groups.dp_group)  # dp rank order = row order
        rows = [row for part in gathered for row in part]
    tokens, lengths, _ = pack_rows([q for q, _ in rows], [r for _, r in rows])
    mb = micro_batching(ctx)
    per_token = engine.forward_logprobs(SequenceBatch(tokens, tuple(lengths)), mb.n_micro, temperature,
                                        gather_dp=True, micro_batch_tokens=mb.tokens)
    per_row = gather_responses(per_token, [q.numel() for q, _ in rows], [r.numel() for _, r in rows])
    start = ctx.my_rows.start
    return per_row[start:start + len(mine)]


__all__ = [
    "full_distribution_logprobs", "generation_config", "generation_seed", "prompt_columns", "run_generate",
    "samples_per_prompt",
]
