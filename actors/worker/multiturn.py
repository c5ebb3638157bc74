"""Multi-turn generation and the environment's reward as worker ops.

`run_generate` hands a call whose params carry `env` to `run_generate_turns`: on each dp rank,
tp rank 0 builds the environments of its rows (`params["env"]["sessions"]`, a `TurnSource` named
'module:Class', `app.envs.sessions:EnvSessions` by default; built by name because actors/ never
imports app/) from the rows' samples (prompt text, answer, prompt index), takes their prompts,
shares them over the tp group, and runs `actors.generation.multiturn.generate_turns` round by
round (one set of environments per round). Its rows carry, beside the single-turn keys:

  response_mask  float32 [r]: 1 on sampled ids, 0 on observation ids (every loss, KL, entropy
                 and advantage of the train calls masks with it: actors.worker.train.load_rollout)
  env_reward     the trajectory's (discounted) sum of step rewards; turns; env_end (why it ended)

`run_env_reward` (op `env_reward`, model-free) turns env_reward into the `rewards` the
algorithms read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from actors.engine import broadcast_from_first
from actors.generation import generate_turns
from actors.worker.calls import CallContext, owner_result, shard_of_my_rows
from actors.worker.data import import_object, load_tokenizer, merge_shards
from actors.worker.execution import generation_rounds
from actors.worker.generate import (
    full_distribution_logprobs,
    generation_config,
    prompt_columns,
    run_generate,
    samples_per_prompt,
)

DEFAULT_SESSIONS = "app.envs.sessions:EnvSessions"
# Environment metrics summed over rounds and dp ranks by the driver; the rest are averaged.
SUMMED_METRICS = ("env/errors", "env/timeouts", "env/truncated_observations", "env/truncated_prompts", "env/length_cut",
                  "env/seconds", "env/steps", "env/max_turns_cut")


def _is_counter(key: str) -> bool:
    """Counters add up over rounds and dp ranks (the decode loop's gen/* ones too, but its longest wait)."""
    return key in SUMMED_METRICS or (key.startswith("gen/") and key != "gen/max_wait_s")


def _samples(ctx: CallContext, inputs: Sequence[dict | None]) -> list[dict[str, Any]]:
    """What each of this dp rank's rows shows its environment: prompt text, answer, indices."""
    n_samples = samples_per_prompt(ctx)
    cols, index = prompt_columns(ctx, inputs)
    return [{"prompt": cols["prompt"][i] if "prompt" in cols else None,
             "answer": cols["answer"][i] if "answer" in cols else None,
             "prompt_index": r // n_samples, "sample_index": r % n_samples}
            for r, i in zip(ctx.my_rows, index)]


def shared_prompt_tensors(prompt_ids: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each row's prompt as an int64 device tensor; rows with equal ids share one tensor, so that
    generation prefills that prompt once for them all (actors.generation.prefill)."""
    keys = [tuple(ids) for ids in prompt_ids]
    distinct = {key: torch.tensor(key, dtype=torch.int64, device=device) for key in dict.fromkeys(keys)}
    return [distinct[key] for key in keys]


def _round(ctx: CallContext, samples: list[dict[str, Any]], part: range, env: dict[str, Any],
           ) -> tuple[Any, list[dict[str, Any]], dict[str, float]]:
    """One round of rows: environments built, prompts shared, trajectories generated."""
    engine = ctx.need_engine()
    source = None
    if ctx.groups.tp_rank == 0:
        factory = import_object(str(env.get("sessions", DEFAULT_SESSIONS)), "params['env']['sessions']")
        source = factory(samples=[samples[i] for i in part], **env["kwargs"])
    try:
        prompt_ids = broadcast_from_first(source.prompts() if source is not None else None, ctx.groups.tp_group)
        prompts = shared_prompt_tensors(prompt_ids, ctx.device)
        config = generation_config(ctx, ctx.my_rows.start, part if len(part) < len(samples) else None)
        out = generate_turns(engine.model, prompts, config, int(env["budget"]), source, engine.groups)
        outcomes = source.outcomes() if source is not None else []
        metrics = source.metrics() if source is not None else {}
    finally:
        if source is not None:
            source.close()
    return out, outcomes, {**metrics, **{f"gen/{k}": v for k, v in out.stats.items()}}


def _merge_metrics(per_round: list[dict[str, float]], weights: list[int]) -> dict[str, float]:
    """Sum the counters, weight the means by the rows of each round (max for *_max)."""
    merged: dict[str, float] = {}
    for key in sorted({k for m in per_round for k in m}):
        values = [(m[key], w) for m, w in zip(per_round, weights) if key in m]
        if _is_counter(key):
            merged[key] = float(sum(v for v, _ in values))
        elif key.endswith(("_max", "max_wait_s")):
            merged[key] = float(max(v for v, _ in values))
        else:
            merged[key] = float(sum(v * w for v, w in values) / max(sum(w for _, w in values), 1))
    return merged


def run_generate_turns(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """Multi-turn trajectories for this dp rank's rows; row r answers prompt r // n_samples."""
    p, env = ctx.params, ctx.params["env"]
    n_samples = samples_per_prompt(ctx)
    samples = _samples(ctx, inputs)
    rounds = generation_rounds(ctx.call.execution, len(samples))
    outs, outcomes, metrics = [], [], []
    for part in rounds:
        out, outcome, metric = _round(ctx, samples, part, env)
        outs.append(out)
        outcomes += outcome
        metrics.append(metric)
    prompts = [t for out in outs for t in out.prompts]
    responses = [t for out in outs for t in out.responses]
    masks = [t for out in outs for t in out.response_masks]
    logprobs = [t for out in outs for t in out.logprobs]
    sampling = outs[0].sampling
    if sampling.truncates:  # collective over the mesh: every rank, before the owner check
        full = full_distribution_logprobs(ctx, prompts, responses, sampling.temperature)
        logprobs = [lp * mask for lp, mask in zip(full, masks)]
    lengths = [int(m.sum()) for m in masks]
    merged = _merge_metrics(metrics, [len(r) for r in rounds])
    # Means are averaged over the dp ranks by the driver; counters go under "summed" (added up).
    meta: dict[str, Any] = {"response_lengths": lengths, "gen_tokens": sum(lengths), "gen_rounds": len(rounds),
                            **{k: v for k, v in merged.items() if not _is_counter(k)},
                            "summed": {k: v for k, v in merged.items() if _is_counter(k)}}
    if not ctx.owner:
        return owner_result(ctx, {}, meta)
    rows = ctx.my_rows
    columns: dict[str, list[Any]] = {
        "prompt_ids": prompts, "response_ids": responses, "logprobs": logprobs, "response_mask": masks,
        "no_eos": [bool(x) for out in outs for x in out.no_eos], "prompt_index": [r // n_samples for r in rows],
        "env_reward": [float(o["reward"]) for o in outcomes], "turns": [int(o["turns"]) for o in outcomes],
        "env_end": [str(o["end_reason"]) for o in outcomes],
    }
    for key in ("prompt", "answer"):
        columns[key] = [s[key] for s in samples]
    meta["env_rewards"] = columns["env_reward"]
    meta["samples"] = _console_samples(p.get("tokenizer"), prompts, responses, masks, columns["env_end"])
    return shard_of_my_rows(ctx, columns, meta)


def _console_samples(tokenizer_spec: str | None, prompts: list[Any], responses: list[Any], masks: list[Any],
                     ends: list[str], count: int = 2) -> list[dict[str, str]]:
    """The first rows decoded for samples.jsonl and the console: the prompt, then each turn's
    sampled text and each observation as `[observation] ...`, and why the trajectory ended."""
    tokenizer = load_tokenizer(tokenizer_spec)
    if tokenizer is None:
        return []
    out = []
    for i in range(min(count, len(prompts))):
        ids, mask = responses[i].tolist(), masks[i].tolist()
        pieces, start = [], 0
        for end in range(1, len(ids) + 1):  # one piece per run of equal mask values
            if end == len(ids) or mask[end] != mask[start]:
                text = tokenizer.decode(ids[start:end], skip_special_tokens=True)
                pieces.append(text if mask[start] else f"[observation] {text}")
                start = end
        out.append({"prompt": tokenizer.decode(prompts[i].tolist(), skip_special_tokens=True),
                    "response": " | ".join(pieces), "end": ends[i]})
    return out


def run_env_reward(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """The environments' rewards of this dp rank's rows as `rewards` (on its data owner)."""
    if not ctx.owner:
        return owner_result(ctx, {}, {})
    rows = ctx.my_rows
    cols = merge_shards(inputs, rows, ["env_reward"])
    scores = [float(x) for x in cols["env_reward"]]
    out_key = str(ctx.params.get("out_key", "rewards"))
    return shard_of_my_rows(ctx, {out_key: scores}, {"rewards": scores})


def run_generation(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """The `generate` op: multi-turn when the call's params carry `env`, else single-turn."""
    if ctx.params.get("env"):
        return run_generate_turns(ctx, inputs)
    return run_generate(ctx, inputs)


__all__ = ["DEFAULT_SESSIONS", "run_env_reward", "run_generate_turns", "run_generation"]
