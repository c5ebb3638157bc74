"""Multi-turn generation terms of the cost model (`planning.cost`, a generate call whose
`MFC.multi_turn` is set).

A multi-turn trajectory decodes up to batch.gen_len tokens, hands its turn to an environment
(CPU, `env_step_s` seconds, while other trajectories decode), gets the observation's ids prefilled
at its current length in its KV cache (history is never prefilled again), and goes on for up to
`turns` turns; sampled and observed tokens together hold at most the response budget. Priced per
round of sequences, every trajectory in lockstep (the worst case):

* decode: turns * gen_len steps, each attending over the mean context prompt_len + filled / 2,
  where filled = turns * (gen_len + obs_tokens) is what a trajectory holds after its prompt at
  the end (with the config's worst-case turns and default budget: the budget itself); when that
  exceeds the budget, sampled and observed tokens are scaled down alike to fit it;
* observations: one prefill pass per turn over the round's obs_tokens per sequence, attending
  over the cache at the same mean context: the roofline of its matmuls against streaming the
  stage's weights and the round's KV cache once, plus the non-matmul HBM traffic, kernel
  launches and tp all-reduces of a prefill (`observation_parts`, key `obs_prefill_s`);
* environment: turns * env_step_s of idle GPU per round (`env_wait_s`): the round's trajectories
  reach their environment at about the same step, so decoding waits that long each turn;
* KV cache: prompt_len + budget + 1 slots per sequence (`Trajectory.kv_slots`).

Sampling stays per decode step as for single-turn generation. The engine runs multi-turn
generation at pp = 1 only: `MULTI_TURN_PP_REASON` marks any other layout infeasible. A
single-turn call's `trajectory` gives exactly the single-turn numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.cost_terms import CallGeometry, Links, allreduce_s, inference_bytes_per_token_layer
from planning.dataflow import BatchShape, MultiTurn
from planning.layout import Layout

MULTI_TURN_PP_REASON = "multi-turn generation runs at pp=1 (the engine's multi-turn loop has no pipeline)"


@dataclass(frozen=True)
class Trajectory:
    """One sequence of a generate call as the cost model prices it.

    decode_steps: decode steps (every sequence of a round in lockstep). ctx: mean keys a decode
    step (and an observation prefill) attends over. kv_slots: KV-cache slots per sequence.
    turns: turns charged. obs_tokens: observation tokens prefilled per turn. env_step_s: seconds
    of one environment step.
    """

    decode_steps: float
    ctx: float
    kv_slots: int
    turns: float = 1.0
    obs_tokens: float = 0.0
    env_step_s: float = 0.0


def trajectory(batch: BatchShape, multi_turn: MultiTurn | None) -> Trajectory:
    """The trajectory of a generate call of shape `batch` (see the module docstring)."""
    if multi_turn is None:
        return Trajectory(batch.gen_len, batch.prompt_len + batch.gen_len / 2, batch.seq_len)
    budget = multi_turn.budget(batch.gen_len)
    sampled = multi_turn.turns * batch.gen_len
    observed = multi_turn.turns * multi_turn.obs_tokens
    fit = min(1.0, budget / (sampled + observed)) if sampled + observed > 0 else 1.0
    filled = (sampled + observed) * fit
    return Trajectory(
        decode_steps=sampled * fit,
        ctx=batch.prompt_len + filled / 2,
        kv_slots=batch.prompt_len + budget + 1,
        turns=multi_turn.turns,
        obs_tokens=multi_turn.obs_tokens * fit,
        env_step_s=multi_turn.env_step_s,
    )


def observation_parts(geo: CallGeometry, layout: Layout, links: Links, seqs: int, traj: Trajectory,
                      kv_itemsize: float = 2.0) -> dict[str, float]:
    """Seconds of one round of `seqs` sequences spent on observations and environments:
    `obs_prefill_s` (turns prefill passes, absent without observation tokens) and `env_wait_s`.
    The prefill runs the bf16 weights even in an FP8 decode; `kv_itemsize` is the bytes moved
    per cached value of the history read (2 in place from a bf16 cache; an FP8 cache is gathered
    and widened first: planning.cost_passes.kv_read_bytes)."""
    parts = {"env_wait_s": traj.turns * traj.env_step_s}
    if traj.obs_tokens <= 0:
        return parts
    tokens = seqs * traj.obs_tokens
    # The projections run as in a prefill (compute-bound for thousands of tokens, else bound
    # by streaming the weights); the attention reads every row's history, as a decode step does.
    kv_read = seqs * traj.ctx * geo.kv_bytes_per_token_layer * geo.stage_layers * kv_itemsize / 2.0
    matmul = max(tokens * geo.stage_flops_per_token(0.0) / links.flops, 2.0 * geo.stage_params / links.hbm)
    history = kv_read / links.hbm + tokens * geo.stage_layers * geo.attn_flops_per_ctx * traj.ctx / links.flops
    elementwise = tokens * geo.stage_layers * geo.layer_elementwise_bytes / links.elementwise_hbm
    overhead = geo.stage_layers * links.hw.kernel_overhead_s
    tp = geo.stage_layers * 2 * allreduce_s(tokens * geo.spec.hidden_size * 2, layout.tp, links.tp_bw, links.lat)
    parts["obs_prefill_s"] = traj.turns * (matmul + history + elementwise + overhead + tp)
    return parts


def observation_bytes(geo: CallGeometry, layout: Layout, seqs: int, traj: Trajectory) -> float:
    """Working set of one observation prefill of `seqs` sequences (0.0 without observations)."""
    return seqs * traj.obs_tokens * inference_bytes_per_token_layer(geo.spec, layout.tp)


__all__ = ["MULTI_TURN_PP_REASON", "Trajectory", "observation_bytes", "observation_parts", "trajectory"]
