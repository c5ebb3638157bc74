"""Audit of the PPO / GRPO / ReMax training path: the worker's train ops against plain loops.

Every expected number here is computed independently, token by token, with Python loops over a
tiny fixed rollout (4 rows, prompt lengths 3/2/4/2, response lengths 3/1/2/4): KL-shaped rewards
at the last response token, GAE with V(s_t) before response token t and a 0 bootstrap after the
last one, Bessel-corrected whitening over response tokens only, the clipped surrogate on
exp(new - old), the clipped value loss around the OLD values, GRPO's consecutive groups, ReMax's
greedy baseline. The model-side numbers (new logprobs, values, entropy) come from a direct
full-vocabulary forward of each sequence alone, not from the engine under test.

The train ops run serially in-process on a one-GPU layout (every group None), as
tests/actors/worker/test_worker_units.py does; lr=0 keeps the weights fixed, so every minibatch of a call sees
the same model and its metrics can be predicted exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from actors.engine.packing import PackedBatch
from actors.engine.process_groups import ParallelGroups
from actors.worker import CallSpec, ModelWorker
from actors.worker.calls import CallContext
from actors.worker.train import load_rollout, minibatch_rows, ppo_returns
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


# ---- advantages (pure) ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("gamma,lam,do_whiten,penalty", [(1.0, 0.95, True, 0.0), (0.9, 0.7, False, 0.5),
                                                        (1.0, 1.0, True, 1.0)])
def test_ppo_advantages_and_returns_match_plain_gae(gamma: float, lam: float, do_whiten: bool, penalty: float) -> None:
    columns = rollout_columns()
    params = {"kl_coef": 0.1, "gamma": gamma, "lam": lam, "whiten": do_whiten, "no_eos_penalty": penalty}
    ctx = context(params)
    rollout = load_rollout(ctx, shards_of(columns), ["values"])
    adv, ret, kl = ppo_returns(ctx, rollout)
    rewards = expected_token_rewards(columns, 0.1, penalty)
    want_adv, want_ret = expected_gae(rewards, rows_of(columns, "values"), gamma, lam)
    if do_whiten:
        want_adv = whiten(want_adv)
    for got, want in ((adv, want_adv), (ret, want_ret)):
        for got_row, want_row in zip(response_entries(got), want):
            assert got_row == pytest.approx(want_row, abs=1e-5)
    # Prompt tokens carry nothing: every non-response entry is exactly 0.
    prompt = rollout.mask == 0
    assert bool((adv[prompt] == 0).all() and (ret[prompt] == 0).all() and (kl[prompt] == 0).all())
    want_kl = [[a - b for a, b in zip(lp, ref)] for lp, ref in zip(rows_of(columns, "logprobs"),
                                                                    rows_of(columns, "ref_logprobs"))]
    assert response_entries(kl) == [pytest.approx(row, abs=1e-6) for row in want_kl]


@pytest.mark.unit
def test_single_token_responses_give_whitened_score_minus_value() -> None:
    gen = torch.Generator().manual_seed(3)
    n = 5
    scores = [0.5, -1.0, 2.0, 0.0, 1.5]
    values = [0.1, 0.4, -0.3, 0.2, 1.0]
    columns = {"prompt_ids": [torch.randint(3, 60, (2 + i,), generator=gen) for i in range(n)],
               "response_ids": [torch.randint(3, 60, (1,), generator=gen) for _ in range(n)],
               "logprobs": [torch.tensor([-1.0]) for _ in range(n)], "rewards": scores,
               "values": [torch.tensor([v]) for v in values]}
    for gamma, lam in ((1.0, 0.95), (0.5, 0.3)):  # one step: gamma and lam cannot matter
        ctx = context({"gamma": gamma, "lam": lam, "whiten": True}, n_rows=n)
        rollout = load_rollout(ctx, [{"row_start": 0, "n": n, **columns}], ["values"])
        adv, ret, kl = ppo_returns(ctx, rollout)
        assert kl is None
        want = whiten([[s - v] for s, v in zip(scores, values)])
        assert adv[rollout.mask.bool()].tolist() == pytest.approx([w[0] for w in want], abs=1e-5)
        assert ret[rollout.mask.bool()].tolist() == pytest.approx(scores, abs=1e-6)  # A + V = score


@pytest.mark.unit
def test_minibatches_partition_rows_deterministically_per_seed_epoch_and_iteration() -> None:
    params = {"ppo_minibatches": 3, "seed": 5}
    first = [minibatch_rows(context(params, n_rows=10), 10, epoch) for epoch in range(3)]
    again = [minibatch_rows(context(params, n_rows=10), 10, epoch) for epoch in range(3)]
    assert first == again  # every rank computes the same split without talking
    for parts in first:
        assert sorted(r for part in parts for r in part) == list(range(10))
        assert sorted(len(part) for part in parts) == [3, 3, 4]
    assert first[0] != first[1]  # reshuffled per epoch
    assert minibatch_rows(context(params, 10, iteration=1), 10, 0) != first[0]
    assert minibatch_rows(context({**params, "seed": 6}, 10), 10, 0) != first[0]
    unshuffled = minibatch_rows(context({**params, "shuffle": False}, 10), 10, 0)
    assert unshuffled == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="ppo_minibatches=3 leaves fewer than dp=2 rows"):
        minibatch_rows(context(params, n_rows=5, dp=2), 5, 0)


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


# ---- PPO actor ------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_actor_lr0_ratio_is_one_and_pg_loss_is_minus_mean_advantage(agg: str) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    before = weights(worker, "actor")
    params = {"op": "ppo_actor", "kl_coef": 0.1, "gamma": 1.0, "lam": 0.95, "whiten": False, "loss_agg": agg,
              "ppo_epochs": 2, "ppo_minibatches": 1, "clip_eps": 0.2}
    meta, data = run(worker, "actor", "train", params, *shards_of(columns))
    assert data is None
    adv, _ = expected_gae(expected_token_rewards(columns, 0.1), rows_of(columns, "values"), 1.0, 0.95)
    assert meta["actor/optimizer_steps"] == 2.0
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(adv, agg), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"], abs=1e-7)
    assert meta["actor/pg_clipfrac"] == 0.0 and meta["actor/pg_clipfrac_lower"] == 0.0
    assert abs(meta["actor/ppo_kl"]) < 1e-5 and meta["actor/grad_norm"] > 0
    assert meta["actor/advantages_mean"] == pytest.approx(aggregate(adv, "token-mean"), abs=1e-5)
    # actor/kl: k1 of the rollout (sampling logprobs minus ref logprobs) over response tokens.
    kl = [[a - b for a, b in zip(lp, ref)] for lp, ref in zip(rows_of(columns, "logprobs"),
                                                                rows_of(columns, "ref_logprobs"))]
    assert meta["actor/kl"] == pytest.approx(aggregate(kl, "token-mean"), abs=1e-6)
    new, _ = direct_outputs(module(worker, "actor"), columns)
    diff = [[abs(a - b) for a, b in zip(x, y)] for x, y in zip(new, rows_of(columns, "logprobs"))]
    assert meta["actor/old_logprob_diff"] == pytest.approx(aggregate(diff, "token-mean"), abs=1e-5)
    after = weights(worker, "actor")
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr = 0


@pytest.mark.unit
def test_ppo_actor_clipped_surrogate_on_sampling_logprobs_matches_plain_loop() -> None:
    """recompute_logprobs=False: the ratio is exp(new - sampling logprob); with known offsets on
    the old logprobs the clip, clip-higher and dual-clip branches are all exercised."""
    worker = serial_worker()
    columns = rollout_columns()
    new, _ = direct_outputs(module(worker, "actor"), columns)
    offsets = [0.0, 0.5, -0.5, 0.1, -1.5, 1.5, -0.1, 0.5, -1.5, 0.3]  # old = new + offset: ratio = exp(-offset)
    flat_new = [x for row in new for x in row]
    columns["logprobs"] = _per_response([x + d for x, d in zip(flat_new, offsets)])
    params = {"op": "ppo_actor", "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95, "whiten": True, "clip_eps": 0.2,
              "clip_eps_high": 0.28, "dual_clip": 3.0, "recompute_logprobs": False, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    adv, _ = expected_gae(expected_token_rewards(columns, 0.05), rows_of(columns, "values"), 1.0, 0.95)
    losses, clipped, lower = surrogate(new, rows_of(columns, "logprobs"), whiten(adv), 0.2, 0.28, 3.0)
    assert aggregate(clipped, "token-mean") > 0 and aggregate(lower, "token-mean") > 0  # the fixture covers both
    assert meta["actor/pg_loss"] == pytest.approx(aggregate(losses, "token-mean"), abs=1e-5)
    assert meta["actor/pg_clipfrac"] == pytest.approx(aggregate(clipped, "token-mean"), abs=1e-6)
    assert meta["actor/pg_clipfrac_lower"] == pytest.approx(aggregate(lower, "token-mean"), abs=1e-6)
    assert meta["actor/ppo_kl"] == pytest.approx(sum(offsets) / len(offsets), abs=1e-5)  # mean(old - new)
    assert meta["actor/old_logprob_diff"] == 0.0  # the old logprobs ARE the sampling ones here


@pytest.mark.unit
def test_entropy_bonus_enters_with_a_minus_sign_and_is_the_response_tokens_entropy() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.0, "whiten": False, "entropy_coef": 0.01, "temperature": 0.8}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    _, entropy = direct_outputs(module(worker, "actor"), columns, temperature=0.8)
    assert meta["actor/entropy"] == pytest.approx(aggregate(entropy, "token-mean"), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"] - 0.01 * meta["actor/entropy"], abs=1e-6)


@pytest.mark.unit
def test_an_entropy_only_step_raises_the_entropy() -> None:
    """GRPO with equal scores in every group: zero advantages, so the only gradient is the entropy
    bonus's, and a step must increase the policy's entropy on those tokens (sign check)."""
    worker = serial_worker(lr=1e-2)
    columns = {**rollout_columns(), "rewards": [1.0, 1.0, 0.0, 0.0]}
    _, before = direct_outputs(module(worker, "actor"), columns)
    params = {"op": "grpo_actor", "group_size": 2, "entropy_coef": 1.0, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    _, after = direct_outputs(module(worker, "actor"), columns)
    assert meta["actor/pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert aggregate(after, "token-mean") > aggregate(before, "token-mean") + 1e-3


# ---- PPO critic -----------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("value_clip", [0.2, None])
def test_ppo_critic_value_loss_clips_around_the_old_values(value_clip: float | None) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    current = direct_values(module(worker, "critic"), columns)
    offsets = [0.0, 0.5, -0.5, 0.05, -0.3, 0.3, 0.1, -0.05, 0.6, -0.6]  # old = current + offset
    columns["values"] = _per_response([v + d for v, d in zip([x for row in current for x in row], offsets)])
    params = {"op": "ppo_critic", "kl_coef": 0.1, "gamma": 0.95, "lam": 0.9, "whiten": True,
              "value_clip": value_clip, "ppo_epochs": 1, "ppo_minibatches": 1}
    meta, data = run(worker, "critic", "train", params, *shards_of(columns))
    assert data is None
    old = rows_of(columns, "values")
    _, returns = expected_gae(expected_token_rewards(columns, 0.1), old, 0.95, 0.9)  # targets from OLD values
    losses, clip_active = [], []
    for v_row, o_row, r_row in zip(current, old, returns):
        loss_row, clip_row = [], []
        for v, o, ret in zip(v_row, o_row, r_row):
            unclipped = (v - ret) ** 2
            clipped = unclipped if value_clip is None else (o + min(max(v - o, -value_clip), value_clip) - ret) ** 2
            loss_row.append(0.5 * max(unclipped, clipped))
            clip_row.append(float(clipped > unclipped))
        losses.append(loss_row)
        clip_active.append(clip_row)
    if value_clip is not None:
        assert aggregate(clip_active, "token-mean") > 0  # the fixture exercises the clipped branch
    assert meta["critic/vf_loss"] == pytest.approx(aggregate(losses, "token-mean"), abs=1e-5)
    assert meta["critic/vf_clipfrac"] == pytest.approx(aggregate(clip_active, "token-mean"), abs=1e-6)
    assert meta["critic/vpred"] == pytest.approx(aggregate(current, "token-mean"), abs=1e-5)
    assert meta["critic/returns_mean"] == pytest.approx(aggregate(returns, "token-mean"), abs=1e-5)
    assert meta["critic/values_mean"] == pytest.approx(aggregate(old, "token-mean"), abs=1e-6)


@pytest.mark.unit
def test_values_op_gives_v_before_each_response_token() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    _, shard = run(worker, "critic", "inference", {"op": "values"}, *shards_of(columns))
    want = direct_values(module(worker, "critic"), columns)
    assert [t.tolist() for t in shard["values"]] == [pytest.approx(row, abs=1e-5) for row in want]


# ---- GRPO -----------------------------------------------------------------------------------------


def expected_grpo(scores: list[float], group: int, scale_by_std: bool) -> list[float]:
    out = []
    for start in range(0, len(scores), group):
        members = scores[start:start + group]
        mean = sum(members) / group
        std = math.sqrt(sum((s - mean) ** 2 for s in members) / (group - 1))
        out += [(s - mean) / (std + 1e-6) if scale_by_std else s - mean for s in members]
    return out


@pytest.mark.unit
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_actor_group_advantages_and_kl_loss_match_plain_loops(scale_by_std: bool) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "grpo_actor", "group_size": 2, "scale_by_std": scale_by_std, "kl_loss_coef": 0.1,
              "kl_loss_estimator": "low_var_kl", "loss_agg": "seq-mean-token-mean", "no_eos_penalty": 0.5,
              "ppo_epochs": 1, "ppo_minibatches": 2}
    new, _ = direct_outputs(module(worker, "actor"), columns)
    ref_offsets = [0.3, -0.2, 0.0, 0.7, -0.5, 0.1, -0.9, 0.2, 0.4, -0.1]  # ref = new + offset
    columns["ref_logprobs"] = _per_response([x + d for x, d in zip([x for row in new for x in row], ref_offsets)])
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    scores = [s - 0.5 * float(e) for s, e in zip(SCORES, NO_EOS)]  # the no-EOS penalty comes first
    per_seq = expected_grpo(scores, 2, scale_by_std)
    # k3 = r - log r - 1 with r = pi_ref / pi (Schulman), clamped to [-10, 10] as veRL does.
    k3 = [[min(10.0, math.exp(ref - n) - (ref - n) - 1) for n, ref in zip(n_row, ref_row)]
          for n_row, ref_row in zip(new, rows_of(columns, "ref_logprobs"))]
    # Two minibatches of 2 rows each, averaged: with seq-mean aggregation every row weighs 1/2 in
    # its minibatch, so the average over minibatches is the plain mean over rows whatever the split.
    assert meta["actor/optimizer_steps"] == 2.0
    assert meta["actor/pg_loss"] == pytest.approx(-sum(per_seq) / N, abs=1e-5)
    assert meta["actor/kl_loss"] == pytest.approx(aggregate(k3, "seq-mean-token-mean"), abs=1e-5)
    assert meta["actor/loss"] == pytest.approx(meta["actor/pg_loss"] + 0.1 * meta["actor/kl_loss"], abs=1e-6)
    token_adv = [[a] * r for a, r in zip(per_seq, RESPONSE_LENS)]
    assert meta["actor/advantages_mean"] == pytest.approx(aggregate(token_adv, "token-mean"), abs=1e-5)
    assert meta["actor/kl_coef"] == 0.0  # GRPO puts KL in the loss, not in the reward


@pytest.mark.unit
def test_generation_repeats_each_prompt_on_consecutive_rows_as_grpo_groups_expect() -> None:
    worker = serial_worker()
    prompts = {"row_start": 0, "n": 3, "prompt_ids": [torch.tensor([1, 5, 9]), torch.tensor([1, 7]),
                                                       torch.tensor([1, 4, 4, 8])]}
    params = {"op": "generate", "max_new_tokens": 3, "n_samples": 2, "seed": 4}
    _, gen = run(worker, "actor", "generate", params, prompts, n=6)
    assert gen["prompt_index"] == [0, 0, 1, 1, 2, 2]
    for row, prompt in enumerate(gen["prompt_ids"]):
        assert prompt.tolist() == prompts["prompt_ids"][row // 2].tolist()


# ---- ReMax ----------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("with_ref", [False, True])
def test_remax_actor_advantage_is_reward_to_go_minus_the_greedy_score(with_ref: bool) -> None:
    worker = serial_worker()
    columns = rollout_columns()
    greedy = [0.5, 0.0, 1.0, -1.0]
    if not with_ref:
        del columns["ref_logprobs"]
    shards = [*shards_of(columns), {"row_start": 0, "n": N, "greedy_rewards": greedy}]
    params = {"op": "remax_actor", "kl_coef": 0.2, "whiten": False, "loss_agg": "token-mean", "ppo_minibatches": 1}
    new, _ = direct_outputs(module(worker, "actor"), columns)
    meta, _ = run(worker, "actor", "train", params, *shards)
    advantages = []
    # The KL penalty is of the actor's recomputed logprobs (not the rollout's) against the ref.
    for i, lp in enumerate(new):
        kl = [a - b for a, b in zip(lp, rows_of(columns, "ref_logprobs")[i])] if with_ref else [0.0] * len(lp)
        rewards = [-0.2 * k for k in kl]
        rewards[-1] += SCORES[i]
        advantages.append([sum(rewards[t:]) - greedy[i] for t in range(len(rewards))])  # undiscounted
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(advantages, "token-mean"), abs=1e-5)
    assert meta["rollout/greedy_reward_mean"] == pytest.approx(sum(greedy) / N)
    assert ("actor/kl" in meta) == with_ref



@pytest.mark.unit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_count(agg: str) -> None:
    """Sums over micro-batches divided by the step's global count: 1 or 3 micro-batches give the
    same loss, statistics and gradient norm (lr = 0, so both calls see the same weights)."""
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.1, "whiten": True, "loss_agg": agg, "entropy_coef": 0.01,
              "ppo_minibatches": 1}
    one, _ = run(worker, "actor", "train", {**params, "micro_batches": 1}, *shards_of(columns))
    three, _ = run(worker, "actor", "train", {**params, "micro_batches": 3}, *shards_of(columns))
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert three[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key


@pytest.mark.unit
def test_reward_kl_penalty_uses_the_configured_estimator() -> None:
    columns = rollout_columns()
    ctx = context({"kl_coef": 0.2, "kl_estimator": "low_var_kl", "whiten": False, "gamma": 1.0, "lam": 1.0})
    _, returns, kl = ppo_returns(ctx, load_rollout(ctx, shards_of(columns), ["values"]))
    k3 = [[math.exp(ref - lp) - (ref - lp) - 1 for lp, ref in zip(lp_row, ref_row)]
          for lp_row, ref_row in zip(rows_of(columns, "logprobs"), rows_of(columns, "ref_logprobs"))]
    assert response_entries(kl) == [pytest.approx(row, abs=1e-5) for row in k3]
    # gamma = lam = 1: the return of token t is the undiscounted sum of the rewards from t on.
    for i, row in enumerate(response_entries(returns)):
        rewards = [-0.2 * k for k in k3[i]]
        rewards[-1] += SCORES[i]
        assert row == pytest.approx([sum(rewards[t:]) for t in range(len(rewards))], abs=1e-5)


# ---- whole-batch whitening under minibatches ------------------------------------------------------


@pytest.mark.unit
def test_advantages_are_whitened_over_the_whole_batch_before_minibatching() -> None:
    """Per-minibatch whitening would make each minibatch's mean advantage 0 (pg_loss 0 at ratio 1);
    whole-batch statistics give each minibatch the mean of its rows' whole-batch-whitened values."""
    worker = serial_worker()
    columns = rollout_columns()
    params = {"op": "ppo_actor", "kl_coef": 0.1, "gamma": 1.0, "lam": 0.95, "whiten": True, "seed": 3,
              "ppo_epochs": 1, "ppo_minibatches": 2}
    meta, _ = run(worker, "actor", "train", params, *shards_of(columns))
    adv, _ = expected_gae(expected_token_rewards(columns, 0.1), rows_of(columns, "values"), 1.0, 0.95)
    white = whiten(adv)
    parts = minibatch_rows(context(params), N, 0)
    want = sum(-aggregate([white[i] for i in rows], "token-mean") for rows in parts) / len(parts)
    assert abs(want) > 1e-2  # the split is informative: per-minibatch whitening would give 0
    assert meta["actor/pg_loss"] == pytest.approx(want, abs=1e-5)


# ---- the sampling distribution vs the train-side logprobs -----------------------------------------


def generated_rollout(worker: ModelWorker, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """Generate 4 responses, score them with fixed numbers, add the ref's logprobs and zero values."""
    prompts = {"row_start": 0, "n": N, "prompt_ids": [torch.tensor([1, 5 + i, 9, 3 + 2 * i]) for i in range(N)]}
    _, gen = run(worker, "actor", "generate", {"op": "generate", "max_new_tokens": 5, "seed": 11, **sampling}, prompts)
    temperature = {"temperature": sampling.get("temperature", 1.0)}
    _, ref = run(worker, "ref", "inference", {"op": "logprobs", **temperature}, gen)
    extra = {"row_start": 0, "n": N, "rewards": list(SCORES),
             "values": [torch.zeros(t.numel()) for t in gen["response_ids"]]}
    return [gen, ref, extra]


@pytest.mark.unit
def test_sampling_logprobs_equal_the_train_layouts_recomputation_at_the_temperature() -> None:
    """No truncation: the generation logprobs, the actor's recomputed old logprobs and the ref's
    (same initial weights) are the same distribution, so the rollout KL and the logprob gap are 0."""
    worker = serial_worker()
    inputs = generated_rollout(worker, {"temperature": 0.7})
    params = {"op": "ppo_actor", "kl_coef": 0.1, "temperature": 0.7, "ppo_minibatches": 1}
    meta, _ = run(worker, "actor", "train", params, *inputs)
    assert meta["actor/old_logprob_diff"] < 1e-5
    assert abs(meta["actor/kl"]) < 1e-5
    assert meta["actor/pg_clipfrac"] == 0.0 and abs(meta["actor/ppo_kl"]) < 1e-5


@pytest.mark.unit
@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "top_k": 4}, {"temperature": 0.8, "top_p": 0.5}])
def test_truncated_sampling_keeps_the_rollout_kl_to_an_identical_ref_at_zero(sampling: dict[str, Any]) -> None:
    """Top-k/top-p sample from a truncated distribution; the rollout's logprobs must still be of
    the full temperature-scaled one the ref and the train layout use (before the fix the rollout
    KL to an identical ref was -log(kept mass), about 2.6 nats per token with top_k=4 here)."""
    worker = serial_worker()
    inputs = generated_rollout(worker, sampling)
    gen = inputs[0]
    columns = {"prompt_ids": gen["prompt_ids"], "response_ids": gen["response_ids"]}
    full, _ = direct_outputs(module(worker, "actor"), columns, temperature=sampling["temperature"])
    assert [t.tolist() for t in gen["logprobs"]] == [pytest.approx(row, abs=1e-5) for row in full]
    params = {"op": "ppo_actor", "kl_coef": 0.1, "temperature": sampling["temperature"], "ppo_minibatches": 1}
    for recompute in (True, False):
        meta, _ = run(worker, "actor", "train", {**params, "recompute_logprobs": recompute}, *inputs)
        assert abs(meta["actor/kl"]) < 1e-5 and meta["actor/old_logprob_diff"] < 1e-5
        assert meta["actor/pg_clipfrac"] == 0.0 and abs(meta["actor/ppo_kl"]) < 1e-5


def _truncated_generation_ranks(rank: int, world_size: int) -> list[float] | None:
    """Generate with top-k under dp2, tp2 and pp2 on 2 gloo ranks; on rank 0, the largest gap
    between each layout's rollout logprobs and a serial full-distribution forward of those rows."""
    from actors.worker import placement_group_sets

    torch.set_num_threads(1)
    both = Mesh(0, 2, 2)
    layouts = {"dp": Layout(dp=2), "tp": Layout(tp=2), "pp": Layout(pp=2)}
    worker = ModelWorker(rank, world_size, "cpu")
    worker.ensure_groups([s for layout in layouts.values() for s in placement_group_sets(Placement(both, layout))])
    prompts = {"row_start": 0, "n": N, "prompt_ids": [torch.tensor([1, 5 + i, 9, 3 + 2 * i][: 2 + i % 3])
                                                      for i in range(N)]}
    params = {"op": "generate", "max_new_tokens": 4, "seed": 3, "temperature": 0.9, "top_k": 3}
    shards = {}
    for name, layout in layouts.items():
        placement = Placement(both, layout)
        worker.load_model(f"actor_{name}", SPEC, False, placement, None, 0, False, {})
        _, shard = worker.run_call(CallSpec("gen", f"actor_{name}", "generate", placement, 0, N, params), prompts)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, shard)
        shards[name] = [s for s in gathered if s is not None]
    if rank != 0:
        return None
    serial = ModelWorker(0, 1, "cpu")
    serial.load_model("actor", SPEC, False, ONE, None, 0, False, {})
    gaps = []
    for name, parts in shards.items():
        columns = {k: [row for part in sorted(parts, key=lambda s: s["row_start"]) for row in part[k]]
                   for k in ("prompt_ids", "response_ids", "logprobs")}
        assert len(columns["logprobs"]) == N, name
        full, _ = direct_outputs(module(serial, "actor"), columns, temperature=0.9)
        gaps.append(max(abs(a - b) for got, want in zip(columns["logprobs"], full) for a, b in zip(got.tolist(), want)))
    return gaps


@pytest.mark.dist
def test_truncated_sampling_logprobs_are_full_distribution_under_dp_tp_and_pp() -> None:
    from tests.dist_harness import run_distributed

    gaps, _ = run_distributed(_truncated_generation_ranks, 2, timeout_s=300.0)
    assert max(gaps) < 1e-5, gaps


@pytest.mark.unit
def test_remax_greedy_baseline_gets_the_same_no_eos_penalty() -> None:
    worker = serial_worker()
    columns = rollout_columns()
    columns["no_eos"] = [True, False, True, False]
    greedy = [0.5, 0.0, 1.0, -1.0]
    greedy_no_eos = [True, True, False, False]
    shards = [*shards_of(columns), {"row_start": 0, "n": N, "greedy_rewards": greedy, "greedy_no_eos": greedy_no_eos}]
    params = {"op": "remax_actor", "kl_coef": 0.0, "whiten": False, "loss_agg": "token-mean", "ppo_minibatches": 1,
              "no_eos_penalty": 0.7}
    meta, _ = run(worker, "actor", "train", params, *shards)
    advantages = []
    for i, lp in enumerate(rows_of(columns, "logprobs")):
        score = SCORES[i] - 0.7 * columns["no_eos"][i]
        baseline = greedy[i] - 0.7 * greedy_no_eos[i]
        advantages.append([score - baseline] * len(lp))  # kl_coef 0: reward only at the last token
    assert meta["actor/pg_loss"] == pytest.approx(-aggregate(advantages, "token-mean"), abs=1e-5)
    assert meta["rollout/greedy_reward_mean"] == pytest.approx(sum(greedy) / N)  # unpenalised, like reward_mean


# ---- the KL penalty of the reward is taken from the recomputed logprobs --------------------------


@pytest.mark.unit
@pytest.mark.parametrize("op", ["ppo", "remax_actor", "outcome_actor"])
def test_identical_actor_and_ref_give_a_kl_of_exactly_zero(op: str) -> None:
    """The reward's KL penalty compares the actor's logprobs under its current weights (PPO: the
    actor_inf call's old_logprobs; the critic-free ops: recomputed in the train call) with the
    ref's, computed by the same code on the same layout: bit for bit equal, so KL == 0.0. The
    generation's own logprobs come from another path (KV cache, decode kernels; bf16 on a GPU):
    here they are rounded to bf16 as such a path gives them, and must not enter the KL."""
    worker = serial_worker()
    gen, ref, extra = generated_rollout(worker, {"temperature": 1.0})
    _, old = run(worker, "actor", "inference", {"op": "logprobs", "out_key": "old_logprobs"}, gen)
    gen = {**gen, "logprobs": [t.to(torch.bfloat16).float() for t in gen["logprobs"]]}
    gap = max(float((a - b).abs().max()) for a, b in zip(gen["logprobs"], old["old_logprobs"]))
    assert gap > 1e-4  # the rollout's logprobs are not the recomputed ones
    common = {"kl_coef": 0.1, "ppo_minibatches": 1, "kl_estimator": "k1", "lam": 1.0}
    greedy = {"row_start": 0, "n": N, "greedy_rewards": [0.0] * N}
    group = {"row_start": 0, "n": N, "prompt_index": [0, 0, 1, 1]}
    if op == "ppo":
        meta, _ = run(worker, "actor", "train", {**common, "op": "ppo_actor"}, gen, ref, extra, old)
        critic, _ = run(worker, "critic", "train", {**common, "op": "ppo_critic"}, gen, ref, extra, old)
        assert critic["critic/returns_mean"] == pytest.approx(meta_returns(extra), abs=0.0)
    elif op == "remax_actor":
        meta, _ = run(worker, "actor", "train", {**common, "op": op}, gen, ref, extra, greedy)
    else:
        params = {**common, "op": op, "advantage": "rloo", "group_size": 2}
        meta, _ = run(worker, "actor", "train", params, gen, ref, extra, group)
    assert meta["actor/kl"] == 0.0


def meta_returns(extra: dict[str, Any]) -> float:
    """Mean GAE return of the zero-valued rollout with KL 0: each token's return is its row's
    score (gamma = lam = 1, rewards only at the end, V = 0)."""
    tokens = [s for s, v in zip(extra["rewards"], extra["values"]) for _ in range(v.numel())]
    return sum(tokens) / len(tokens)
