"""What one model function call computes on one worker: generation, rewards, inference, training.

`CallSpec` describes a call (the driver builds it, app/algorithms fill `params`); `run_op` runs it
on this rank's shard and returns `(meta, data)`: a small metadata dict for the driver and, on the
call's data owners, a data shard (see actors.worker.data for the shard format and the row rule).

Ops, chosen by `params["op"]` (or by role and kind, see `default_op`), and the keys they read and
write (per-row lists; `<p>` is params["in_prefix"] / ["out_prefix"], default ""):

  generate     (actors.worker.generate) prompt_ids (+ prompt, answer) -> <p>prompt_ids, <p>response_ids, <p>logprobs
               (of the full temperature-scaled distribution, recomputed when top-k/top-p truncated),
               <p>no_eos, prompt_index (+ prompt, answer, <p>response when a tokenizer is given)
  rule_reward  <p>prompt/<p>response text (or ids + tokenizer), answer -> params["out_key"] ("rewards")
  model_reward prompt_ids, <p>response_ids -> out_key: the reward model's value at the last token
               (with params["reward_text"]: of the rows' text re-tokenized with its own tokenizer)
  logprobs     prompt_ids, response_ids -> out_key ("ref_logprobs"): per response token
  values       prompt_ids, response_ids -> "values": V(state before each response token)
  ppo_actor / ppo_critic / grpo_actor / remax_actor / dpo_actor: training, see actors.worker.train

Inference and training ranks are given every row (the engine splits them over dp by tokens,
and advantages are whitened over the whole batch); their owners return their dp rank's rows.

How a call runs is the plan's `CallExecution` (`CallSpec.execution`): inference and training
split each dp share into micro-batches of at most `micro_batch_tokens` tokens
(`micro_batching`; MAX_MICRO_TOKENS when a call names none, so no call holds the logits of a
whole batch), generation runs a dp rank's rows in `gen_rounds` rounds (actors.worker.generate,
and actors.worker.multiturn for multi-turn calls).
`timed` adds wall-clock times and the call's peak GPU memory on this rank to its metadata.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from actors.engine import ModelEngine, ParallelGroups, SequenceBatch
from actors.worker.data import (
    dp_rows,
    gather_responses,
    import_object,
    is_data_owner,
    load_tokenizer,
    make_shard,
    merge_shards,
    pack_rows,
)
from actors.worker.execution import MicroBatching, plan_micro_batching
from actors.worker.guards import score_rows
from actors.worker.host_pauses import HOST_PAUSE_KEYS, HostPauseClock, collect_after_compile
from actors.worker.memory import MemoryProbe, NoMemoryProbe
from actors.worker.texts import decode_rows
from planning.plan import CallExecution, Placement, check_execution_kind

KINDS = ("generate", "inference", "train")


@dataclass(frozen=True)
class CallSpec:
    """One model function call as the driver submits it to every worker of its mesh."""

    name: str  # MFC name, e.g. "actor_gen"
    role: str  # actor | critic | ref | reward
    kind: str  # generate | inference | train
    placement: Placement
    iteration: int
    n_rows: int  # sequences in the whole call
    params: dict[str, Any] = field(default_factory=dict)
    execution: CallExecution | None = None  # the plan's micro-batching / rounds (None: defaults)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"CallSpec.kind={self.kind!r} (call {self.name}): allowed: {', '.join(KINDS)}")
        if self.n_rows < 1:
            raise ValueError(f"CallSpec.n_rows={self.n_rows} (call {self.name}): must be >= 1")
        if self.execution is not None:
            check_execution_kind(self.name, self.kind, self.execution)

    @property
    def op(self) -> str:
        return str(self.params.get("op") or default_op(self.role, self.kind, self.params))


def default_op(role: str, kind: str, params: dict[str, Any]) -> str:
    """The op of a call whose params name none: PPO's call for (role, kind)."""
    if kind == "generate":
        return "generate"
    if kind == "train":
        return "ppo_critic" if role == "critic" else "ppo_actor"
    if role == "reward":
        return "rule_reward" if params.get("reward_fn") else "model_reward"
    return "values" if role == "critic" else "logprobs"


@dataclass(frozen=True)
class CallContext:
    """Everything an op needs on this rank: the call, the engine of the role under the call's
    placement (None for rule rewards), this rank's groups and its rank inside the mesh."""

    call: CallSpec
    engine: ModelEngine | None
    groups: ParallelGroups
    mesh_rank: int
    device: torch.device

    @property
    def params(self) -> dict[str, Any]:
        return self.call.params

    @property
    def owner(self) -> bool:
        return is_data_owner(self.groups.layout, self.mesh_rank)

    @property
    def my_rows(self) -> range:
        return dp_rows(self.call.n_rows, self.groups.layout.dp, self.groups.dp_rank)

    def need_engine(self) -> ModelEngine:
        if self.engine is None:
            raise ValueError(f"call {self.call.name}: op {self.call.op!r} needs a loaded model for role {self.call.role!r}")
        return self.engine


def owner_result(ctx: CallContext, columns: dict[str, list[Any]], meta: dict[str, Any]) -> tuple[dict, dict | None]:
    """(meta, shard of this dp rank's rows) on owners; (meta, None) elsewhere."""
    rows = ctx.my_rows
    meta = {**meta, "row_start": rows.start, "n": len(rows), "owner": ctx.owner}
    if not ctx.owner:
        return meta, None
    picked = {key: values[rows.start:rows.stop] if len(values) == ctx.call.n_rows else values
              for key, values in columns.items()}
    return meta, make_shard(rows.start, picked)


def shard_of_my_rows(ctx: CallContext, columns: dict[str, list[Any]], meta: dict[str, Any]) -> tuple[dict, dict]:
    """Columns that already hold exactly this dp rank's rows -> (meta, shard)."""
    rows = ctx.my_rows
    return {**meta, "row_start": rows.start, "n": len(rows), "owner": True}, make_shard(rows.start, columns)


# ---- rewards ------------------------------------------------------------------------------------


def run_rule_reward(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """fn(prompt, response, answer) for this dp rank's rows, on its data owner only."""
    p = ctx.params
    if not ctx.owner:
        return owner_result(ctx, {}, {})
    spec = p.get("reward_fn")
    fn = spec if callable(spec) else import_object(str(spec), "params['reward_fn']")
    prefix = str(p.get("in_prefix", ""))
    rows = ctx.my_rows
    cols = merge_shards(inputs, rows, [], optional=["prompt", f"{prefix}response", "answer", "prompt_ids",
                                                    f"{prefix}prompt_ids", f"{prefix}response_ids", "prompt_index"])
    tokenizer = None
    texts: dict[str, list[str]] = {}
    for key in ("prompt", "response"):
        source = key if key == "prompt" else f"{prefix}response"
        if source in cols:
            texts[key] = cols[source]
            continue
        ids_key = f"{prefix}{key}_ids" if f"{prefix}{key}_ids" in cols else f"{key}_ids"
        if ids_key not in cols:
            raise ValueError(f"call {ctx.call.name}: rule reward needs {source!r} text or {ids_key!r} with a tokenizer")
        tokenizer = tokenizer or load_tokenizer(p.get("tokenizer"))
        if tokenizer is None:
            raise ValueError(f"call {ctx.call.name}: params['tokenizer'] is required to decode {ids_key!r}")
        texts[key] = decode_rows(tokenizer, cols[ids_key])
    answers = cols.get("answer", [None] * len(rows))
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    scores = score_rows(fn, str(name), texts["prompt"], texts["response"], answers, rows.start, ctx.call.name,
                        ctx.call.iteration, p, cols.get("prompt_index"))
    out_key = str(p.get("out_key", "rewards"))
    return shard_of_my_rows(ctx, {out_key: scores}, {"rewards": scores})


def _packed_inputs(ctx: CallContext, inputs: Sequence[dict | None], prefix: str = "") -> tuple[SequenceBatch, list[int], list[int]]:
    """Every row of the call packed: (batch, prompt lengths, response lengths)."""
    cols = merge_shards(inputs, range(ctx.call.n_rows), [f"{prefix}prompt_ids", f"{prefix}response_ids"])
    prompts, responses = cols[f"{prefix}prompt_ids"], cols[f"{prefix}response_ids"]
    tokens, lengths, _ = pack_rows(prompts, responses)
    plens = [t.numel() for t in prompts]
    # Rows of one prompt sit next to each other: the engine can hold each prompt once.
    batch = SequenceBatch(tokens, tuple(lengths), prefix_lengths=shareable_prefixes(ctx, plens))
    return batch, plens, [t.numel() for t in responses]


def shareable_prefixes(ctx: CallContext, prompt_lengths: Sequence[int]) -> tuple[int, ...] | None:
    """`SequenceBatch.prefix_lengths` for rows with these prompt lengths: a micro-batch then holds
    a prompt its neighbouring rows share once (actors.engine.shared_prefix); None with
    params['share_prompts'] false (every row whole)."""
    return tuple(int(n) for n in prompt_lengths) if bool(ctx.params.get("share_prompts", True)) else None


def micro_batching(ctx: CallContext) -> MicroBatching:
    """How this inference or train call splits its dp shares (`plan_micro_batching`)."""
    return plan_micro_batching(ctx.call.execution, ctx.params.get("micro_batches"), ctx.groups.layout.pp)


def run_model_reward(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """A reward model's score: its head's output at each sequence's last token. With
    params["reward_text"] (a reward model with another tokenizer than the actor's) the sequences
    are the rows' text re-tokenized with its own tokenizer (`retokenized_batch`), else the
    actor's ids as they are."""
    engine = ctx.need_engine()
    prefix = str(ctx.params.get("in_prefix", ""))
    meta: dict[str, Any] = {}
    if ctx.params.get("reward_text"):
        batch, cut = retokenized_batch(ctx, inputs, prefix, ctx.params["reward_text"])
        mine = cut[ctx.my_rows.start:ctx.my_rows.stop]
        # Sequences cut to the reward model's max_length: summed over the owners (each counts its rows).
        meta = {"summed": {"reward/truncated": float(sum(mine))} if ctx.owner else {},
                "reward/seq_len_mean": sum(batch.lengths) / len(batch.lengths)}
    else:
        batch = _packed_inputs(ctx, inputs, prefix)[0]
    mb = micro_batching(ctx)
    scores_per_pos = engine.forward_values(batch, mb.n_micro, shift=False, gather_dp=True,
                                           micro_batch_tokens=mb.tokens).float().cpu()
    ends = torch.cumsum(torch.tensor(batch.lengths), 0) - 1
    scores = scores_per_pos[ends].tolist()
    out_key = str(ctx.params.get("out_key", "rewards"))
    return owner_result(ctx, {out_key: scores}, {**meta, "rewards": scores[ctx.my_rows.start:ctx.my_rows.stop]})


def retokenized_batch(ctx: CallContext, inputs: Sequence[dict | None], prefix: str,
                      text: dict[str, Any]) -> tuple[SequenceBatch, list[bool]]:
    """Every row of the call as the reward model's tokenizer sees it, packed (one sequence per
    row), and which rows were cut to its max_length. The bridge (`text["bridge"]`, by name:
    app.data.tokenizers.RewardText) decodes the response with the actor's tokenizer, renders it
    with the prompt text and re-tokenizes; every rank builds the same batch from the same rows."""
    cols = merge_shards(inputs, range(ctx.call.n_rows), [f"{prefix}prompt_ids", f"{prefix}response_ids"],
                        optional=["prompt"])
    prompts = cols.get("prompt", [None] * ctx.call.n_rows)
    rows, cut = reward_text_bridge(text).rows(prompts, [t.tolist() for t in cols[f"{prefix}prompt_ids"]],
                                              [t.tolist() for t in cols[f"{prefix}response_ids"]])
    lengths = tuple(len(row) for row in rows)
    tokens = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=sum(lengths))  # [sum(lengths)]
    return SequenceBatch(torch.from_numpy(tokens), lengths), cut


def reward_text_bridge(text: dict[str, Any]) -> Any:
    """The text bridge `text` describes, built once per worker process and description."""
    return _bridge(tuple(sorted(text.items())))


@functools.lru_cache(maxsize=4)
def _bridge(items: tuple[tuple[str, Any], ...]) -> Any:
    kwargs = dict(items)
    factory = import_object(str(kwargs.pop("bridge")), "params['reward_text']['bridge']")
    return factory(**kwargs)


# ---- inference ----------------------------------------------------------------------------------


def run_logprobs(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """Token logprobs of every response under this model (the sampling temperature applies)."""
    engine = ctx.need_engine()
    batch, plens, rlens = _packed_inputs(ctx, inputs)
    temperature = float(ctx.params.get("temperature", 1.0))
    mb = micro_batching(ctx)
    logprobs = engine.forward_logprobs(batch, mb.n_micro, temperature, gather_dp=True, micro_batch_tokens=mb.tokens)
    per_row = gather_responses(logprobs, plens, rlens)
    return owner_result(ctx, {str(ctx.params.get("out_key", "ref_logprobs")): per_row}, {})


def run_values(ctx: CallContext, inputs: Sequence[dict | None]) -> tuple[dict, dict | None]:
    """Critic values V(state before each response token)."""
    engine = ctx.need_engine()
    batch, plens, rlens = _packed_inputs(ctx, inputs)
    mb = micro_batching(ctx)
    values = engine.forward_values(batch, mb.n_micro, shift=True, gather_dp=True, micro_batch_tokens=mb.tokens)
    per_row = gather_responses(values, plens, rlens)
    return owner_result(ctx, {str(ctx.params.get("out_key", "values")): per_row}, {})


def timed(fn: Callable[[CallContext, Sequence[dict | None]], tuple[dict, dict | None]],
          ctx: CallContext, inputs: Sequence[dict | None],
          memory: MemoryProbe | None = None, pauses: HostPauseClock | None = None) -> tuple[dict, dict | None]:
    """Run an op and add wall-clock start/end (seconds since the epoch), this rank's peak memory
    during it (`peak_allocated_bytes` / `peak_reserved_bytes`, None on CPU) and, with a pause
    clock, what stalled the host in it (`gc_s`, `gc_full`, `compiles`, `compile_s`:
    actors.worker.host_pauses; None without) and the garbage collection since the worker's
    previous call ended (`gc_before_s`; None without a clock or before the first call) to its meta.
    After a GPU call whose compile ran full collections, one more, outside its time
    (`collect_after_compile`; the next call's `gc_before_s` shows it)."""
    probe = memory if memory is not None else NoMemoryProbe()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    probe.reset()
    paused_before, gc_before_s = pauses.call_started() if pauses is not None else (None, None)
    start = time.time()
    meta, data = fn(ctx, inputs)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    end = time.time()
    peak = probe.peak()
    paused = (asdict(pauses.call_ended(paused_before)) if pauses is not None and paused_before is not None
              else dict.fromkeys(HOST_PAUSE_KEYS))
    if ctx.device.type == "cuda":
        collect_after_compile(paused["compiles"], paused["gc_full"])
    return {"call": ctx.call.name, "iteration": ctx.call.iteration, "start": start, "end": end,
            "seconds": end - start, "peak_allocated_bytes": peak.allocated_bytes if peak else None,
            "peak_reserved_bytes": peak.reserved_bytes if peak else None, **paused, "gc_before_s": gc_before_s,
            **meta}, data


__all__ = [
    "KINDS",
    "CallContext",
    "CallSpec",
    "decode_rows",
    "default_op",
    "micro_batching",
    "owner_result",
    "retokenized_batch",
    "reward_text_bridge",
    "run_logprobs",
    "run_model_reward",
    "run_rule_reward",
    "run_values",
    "shard_of_my_rows",
    "shareable_prefixes",
    "timed",
]
