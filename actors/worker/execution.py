"""How a call runs as its plan says: the micro-batching of inference and training, and the rounds
of generation (`planning.plan.CallExecution`, chosen by the cost model, carried by `CallSpec`).

* Inference and training: `plan_micro_batching` gives the engine a token budget per
  micro-batch (`ModelEngine.micro_batch_split` cuts each dp share into ceil(tokens / budget)
  micro-batches of whole sequences). A call without a plan (a one-off job, or the generation
  call's recomputed logprobs) gets MAX_MICRO_TOKENS, the cost model's cap, so no call ever holds
  the logits of a whole batch at once.
* Generation: `generation_rounds` cuts a dp rank's rows into the plan's rounds and
  `generate_in_rounds` runs them one after another, each with its own KV cache (freed before
  the next). Each round draws, per sequence, the random numbers a single call over all the
  rank's rows would draw (GenerationConfig.uniform_offset), so rounds change memory, not samples.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from collections import Counter
from dataclasses import dataclass, field

from torch import Tensor, nn

from actors.engine import ParallelGroups
from actors.generation import GenerationConfig, GenerationOutput, SamplingParams, generate
from planning.call_levels import MAX_MICRO_TOKENS
from planning.plan import CallExecution


@dataclass(frozen=True)
class MicroBatching:
    """How the engine splits each dp share: at least n_micro micro-batches, and at most `tokens`
    tokens each (`ModelEngine.micro_batch_split`)."""

    n_micro: int
    tokens: int


def plan_micro_batching(execution: CallExecution | None, min_micro: int | None, pp: int) -> MicroBatching:
    """The plan's token budget (and at least `min_micro` micro-batches when an algorithm sets
    one); without a plan, MAX_MICRO_TOKENS per micro-batch and at least pp of them."""
    planned = execution.micro_batch_tokens if execution is not None else None
    default_count = 1 if planned is not None else pp
    return MicroBatching(int(min_micro or default_count), planned or MAX_MICRO_TOKENS)


def generation_rounds(execution: CallExecution | None, n_rows: int) -> list[range]:
    """`n_rows` rows cut into the plan's `gen_rounds` contiguous, near-equal rounds (one round
    without a plan; never an empty round)."""
    wanted = execution.gen_rounds if execution is not None and execution.gen_rounds else 1
    rounds = max(1, min(n_rows, wanted))
    return [range(k * n_rows // rounds, (k + 1) * n_rows // rounds) for k in range(rounds)]


@dataclass(frozen=True)
class RoundsOutput:
    """A generation over all its rounds, per row on the host: response ids int64 [r_i], their
    sampling logprobs float32 [r_i], response lengths and no-EOS flags; `seconds`: each phase of
    the rounds added up (`actors.generation.loop.PhaseClock`, plus "to_host_s", moving the
    output to the host)."""

    responses: list[Tensor]
    logprobs: list[Tensor]
    lengths: list[int]
    no_eos: list[bool]
    sampling: SamplingParams
    rounds: int
    seconds: dict[str, float] = field(default_factory=dict)


def generate_in_rounds(model: nn.Module, groups: ParallelGroups, prompts: list[Tensor], rounds: list[range],
                       config_for: Callable[[range], GenerationConfig]) -> RoundsOutput:
    """Generate `prompts` round after round (`config_for(round_rows)` gives each round's settings);
    every rank of the mesh calls it with the same rounds."""
    responses: list[Tensor] = []
    logprobs: list[Tensor] = []
    lengths: list[int] = []
    no_eos: list[bool] = []
    seconds: Counter[str] = Counter()
    sampling = SamplingParams()
    for part in rounds:
        config = config_for(part)
        sampling = config.sampling
        result = generate(model, prompts[part.start:part.stop], config, groups)
        started = time.perf_counter()
        rows = rows_on_host(result)
        responses.extend(rows[0])
        logprobs.extend(rows[1])
        lengths.extend(rows[2])
        no_eos.extend(rows[3])
        seconds.update({**result.stats, "to_host_s": time.perf_counter() - started})
        del result  # the round's device tensors go before the next round allocates its cache
    return RoundsOutput(responses, logprobs, lengths, no_eos, sampling, len(rounds), dict(seconds))


def rows_on_host(out: GenerationOutput) -> tuple[list[Tensor], list[Tensor], list[int], list[bool]]:
    """Per sequence: response ids int64 [r_i], logprobs float32 [r_i], length, no-EOS flag, moved
    to the host in one copy per tensor (not one per row) and cut there. Each row is its own
    tensor (a clone), so pickling a row does not carry the whole call's storage."""
    host = out.cpu()
    responses = [r.clone() for r in host.responses()]
    logprobs = [lp.clone() for lp in host.response_logprobs()]
    return responses, logprobs, host.response_lengths.tolist(), host.no_eos.tolist()


__all__ = ["MicroBatching", "RoundsOutput", "generate_in_rounds", "generation_rounds", "plan_micro_batching",
           "rows_on_host"]
