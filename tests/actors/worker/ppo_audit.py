"""The fixed rollout and the plain-loop references of the training-path audit
(tests/actors/worker/test_ppo_path.py, test_grpo_remax_path.py).

A tiny fixed rollout (4 rows, prompt lengths 3/2/4/2, response lengths 3/1/2/4) and, computed
independently token by token with Python loops: KL-shaped rewards at the last response token, GAE
with V(s_t) before response token t and a 0 bootstrap after the last one, Bessel-corrected
whitening over response tokens only, the clipped surrogate on exp(new - old), GRPO's consecutive
groups. The model-side numbers (new logprobs, values, entropy) come from a direct full-vocabulary
forward of each sequence alone, not from the engine under test. The train ops run serially
in-process on a one-GPU layout (every group None), as tests/actors/worker/test_worker_units.py
does; lr=0 keeps the weights fixed, so every minibatch of a call sees the same model and its
metrics can be predicted exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from actors.engine.packing import PackedBatch
from actors.engine.process_groups import ParallelGroups
from actors.worker import CallSpec, ModelWorker
from actors.worker.calls import CallContext
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement

SPEC = ModelSpec("ppo-audit", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


ONE = Placement(Mesh(0, 1, 1), Layout())


PROMPT_LENS = (3, 2, 4, 2)


RESPONSE_LENS = (3, 1, 2, 4)


SCORES = (1.0, -0.5, 0.25, 2.0)


NO_EOS = (False, True, False, False)


N = len(PROMPT_LENS)


# ---- the fixed rollout --------------------------------------------------------------------------


def _per_response(values: list[float]) -> list[torch.Tensor]:
    """Split a flat list over the rows' responses -> one float32 tensor [r_i] per row."""
    out, at = [], 0
    for r in RESPONSE_LENS:
        out.append(torch.tensor(values[at:at + r], dtype=torch.float32))
        at += r
    return out


def rollout_columns() -> dict[str, list[Any]]:
    """Per-row columns as producers emit them (token ids, per-response-token floats, scores)."""
    gen = torch.Generator().manual_seed(7)
    n_resp = sum(RESPONSE_LENS)
    return {
        "prompt_ids": [torch.randint(3, SPEC.vocab_size, (p,), generator=gen) for p in PROMPT_LENS],
        "response_ids": [torch.randint(3, SPEC.vocab_size, (r,), generator=gen) for r in RESPONSE_LENS],
        "logprobs": _per_response([-0.4 - 0.3 * k for k in range(n_resp)]),
        "ref_logprobs": _per_response([-0.9 - 0.17 * k + 0.05 * (k % 3) for k in range(n_resp)]),
        "values": _per_response([0.3 - 0.11 * k + 0.2 * (k % 2) for k in range(n_resp)]),
        "rewards": list(SCORES),
        "no_eos": list(NO_EOS),
        "prompt_index": [0, 0, 1, 1],  # as generation writes it for groups of 2 (GRPO)
    }


def shards_of(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Two producer shards (rows 0-1 and 2-3), in reverse order, as the driver may hand them."""
    return [{"row_start": start, "n": 2, **{k: v[start:start + 2] for k, v in columns.items()}} for start in (2, 0)]


def context(params: dict[str, Any], n_rows: int = N, dp: int = 1, iteration: int = 0) -> CallContext:
    """A CallContext without an engine (for the pure parts of the train ops)."""
    placement = Placement(Mesh(0, dp, dp), Layout(dp=dp))
    groups = ParallelGroups(Layout(dp=dp), 0, 0, 0, None, None, None, None, None, (0,), tuple(range(dp)))
    call = CallSpec("actor_train", "actor", "train", placement, iteration, n_rows, params)
    return CallContext(call, None, groups, 0, torch.device("cpu"))


# ---- plain-loop references ----------------------------------------------------------------------


def rows_of(columns: dict[str, list[Any]], key: str) -> list[list[float]]:
    return [t.tolist() for t in columns[key]]


def expected_token_rewards(columns: dict[str, list[Any]], kl_coef: float, penalty: float = 0.0) -> list[list[float]]:
    """r_t = -kl_coef * (logp_t - ref_t) on every response token, plus the score (minus the no-EOS
    penalty) on the last one."""
    out = []
    for i, (lp, ref) in enumerate(zip(rows_of(columns, "logprobs"), rows_of(columns, "ref_logprobs"))):
        rewards = [-kl_coef * (a - b) for a, b in zip(lp, ref)]
        rewards[-1] += SCORES[i] - penalty * float(NO_EOS[i])
        out.append(rewards)
    return out


def expected_gae(rewards: list[list[float]], values: list[list[float]], gamma: float,
                 lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """(advantages, returns) per row: delta_t = r_t + gamma V_{t+1} - V_t, V after the end = 0."""
    advs, rets = [], []
    for r, v in zip(rewards, values):
        adv, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            next_value = v[t + 1] if t + 1 < len(r) else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            adv[t] = running
        advs.append(adv)
        rets.append([a + b for a, b in zip(adv, v)])
    return advs, rets


def whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def aggregate(rows: list[list[float]], agg: str) -> float:
    if agg == "token-mean":
        flat = [x for row in rows for x in row]
        return sum(flat) / len(flat)
    return sum(sum(row) / len(row) for row in rows) / len(rows)


def response_entries(per_token: torch.Tensor) -> list[list[float]]:
    """A packed [T] tensor -> each row's response entries (the rows are packed in order)."""
    out, at = [], 0
    for p, r in zip(PROMPT_LENS, RESPONSE_LENS):
        out.append(per_token[at + p:at + p + r].tolist())
        at += p + r
    return out


# ---- a serial worker and direct forwards ----------------------------------------------------------


def serial_worker(lr: float = 0.0) -> ModelWorker:
    """actor (trained), critic (trained) and ref (frozen, same init as the actor) on one CPU rank."""
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("actor", SPEC, False, ONE, None, 0, True, {"lr": lr})
    worker.load_model("critic", SPEC, True, ONE, None, 1, True, {"lr": lr})
    worker.load_model("ref", SPEC, False, ONE, None, 0, False, {})
    return worker


def run(worker: ModelWorker, role: str, kind: str, params: dict[str, Any], *inputs: dict, n: int = N) -> tuple:
    return worker.run_call(CallSpec(f"{role}_{kind}", role, kind, ONE, 0, n, params), *inputs)


def module(worker: ModelWorker, role: str) -> torch.nn.Module:
    return worker._roles[role].engines[ONE].model


def weights(worker: ModelWorker, role: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module(worker, role).named_parameters()}


@torch.no_grad()
def direct_outputs(model: torch.nn.Module, columns: dict[str, list[Any]], temperature: float = 1.0,
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """Each row forwarded alone: per response token t, (log p(token_t), entropy of the
    distribution that predicts token_t), from the full logits at position t - 1 / temperature."""
    logprobs, entropies = [], []
    for prompt, response in zip(columns["prompt_ids"], columns["response_ids"]):
        tokens = torch.cat([prompt, response]).long()
        logits = model(tokens, PackedBatch.from_lengths([tokens.numel()])).float() / temperature  # [L, V]
        logp = torch.log_softmax(logits, dim=-1)
        positions = range(prompt.numel() - 1, tokens.numel() - 1)
        logprobs.append([float(logp[pos, tokens[pos + 1]]) for pos in positions])
        entropies.append([float(-(logp[pos].exp() * logp[pos]).sum()) for pos in positions])
    return logprobs, entropies


@torch.no_grad()
def direct_values(critic: torch.nn.Module, columns: dict[str, list[Any]]) -> list[list[float]]:
    """V(s_t) for each response token t: the value head at the position just before it."""
    out = []
    for prompt, response in zip(columns["prompt_ids"], columns["response_ids"]):
        tokens = torch.cat([prompt, response]).long()
        values = critic(tokens, PackedBatch.from_lengths([tokens.numel()]))  # [L]
        out.append([float(values[pos]) for pos in range(prompt.numel() - 1, tokens.numel() - 1)])
    return out


def surrogate(new: list[list[float]], old: list[list[float]], adv: list[list[float]], eps_low: float,
              eps_high: float, dual: float | None) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Per token: (clipped PPO loss, clip active, dual clip active), as in Schulman et al. / Ye et al."""
    losses, clipped_rows, lower_rows = [], [], []
    for new_row, old_row, adv_row in zip(new, old, adv):
        row_loss, row_clip, row_lower = [], [], []
        for n, o, a in zip(new_row, old_row, adv_row):
            ratio = math.exp(n - o)
            unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = max(unclipped, clipped)
            lower = dual is not None and a < 0 and loss > -a * dual
            row_loss.append(min(loss, -a * dual) if dual is not None and a < 0 else loss)
            row_clip.append(float(clipped > unclipped))
            row_lower.append(float(lower))
        losses.append(row_loss)
        clipped_rows.append(row_clip)
        lower_rows.append(row_lower)
    return losses, clipped_rows, lower_rows


# ---- GRPO's group advantages ----------------------------------------------------------------------


def expected_grpo(scores: list[float], group: int, scale_by_std: bool) -> list[float]:
    out = []
    for start in range(0, len(scores), group):
        members = scores[start:start + group]
        mean = sum(members) / group
        std = math.sqrt(sum((s - mean) ** 2 for s in members) / (group - 1))
        out += [(s - mean) / (std + 1e-6) if scale_by_std else s - mean for s in members]
    return out


# ---- a generated rollout --------------------------------------------------------------------------


def generated_rollout(worker: ModelWorker, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """Generate 4 responses, score them with fixed numbers, add the ref's logprobs and zero values."""
    prompts = {"row_start": 0, "n": N, "prompt_ids": [torch.tensor([1, 5 + i, 9, 3 + 2 * i]) for i in range(N)]}
    _, gen = run(worker, "actor", "generate", {"op": "generate", "max_new_tokens": 5, "seed": 11, **sampling}, prompts)
    temperature = {"temperature": sampling.get("temperature", 1.0)}
    _, ref = run(worker, "ref", "inference", {"op": "logprobs", **temperature}, gen)
    extra = {"row_start": 0, "n": N, "rewards": list(SCORES),
             "values": [torch.zeros(t.numel()) for t in gen["response_ids"]]}
    return [gen, ref, extra]


def meta_returns(extra: dict[str, Any]) -> float:
    """Mean GAE return of the zero-valued rollout with KL 0: each token's return is its row's
    score (gamma = lam = 1, rewards only at the end, V = 0)."""
    tokens = [s for s, v in zip(extra["rewards"], extra["values"]) for _ in range(v.numel())]
    return sum(tokens) / len(tokens)


__all__ = ["NO_EOS", "ONE", "PROMPT_LENS", "RESPONSE_LENS", "SCORES", "SPEC", "N", "_per_response", "aggregate", "context", "direct_outputs", "direct_values", "expected_gae", "expected_grpo", "expected_token_rewards", "generated_rollout", "meta_returns", "module", "response_entries", "rollout_columns", "rows_of", "run", "serial_worker", "shards_of", "surrogate", "weights", "whiten"]
