"""Unit tier for the model worker: data shards, minibatches, a serial ModelWorker running GRPO and
ReMax calls (one process, no process group: every group of a 1-GPU layout is None), its error
messages, and the PlannerService."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actors.engine.model_engine import SequenceBatch
from actors.worker import CallSpec, ModelWorker
from actors.worker.calls import default_op
from actors.worker.data import (
    dp_rows,
    gather_responses,
    import_object,
    merge_shards,
    pack_rows,
    reward_score,
    scatter_responses,
)
from actors.worker.generate import generation_seed
from planning.algorithm_graphs import ppo_graph
from planning.cost import rlhf_problem
from planning.dataflow import BatchShape
from planning.hardware import hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement
from planning.planner_service import PlannerService
from planning.search import search_plan

SPEC = ModelSpec("unit", "llama", vocab_size=256, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
ONE = Placement(Mesh(0, 1, 1), Layout())
TOKENIZER = "app.data.toy_task:CharTokenizer"


# ---- data shards ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_dp_rows_split_contiguously_and_cover_everything() -> None:
    parts = [dp_rows(10, 3, d) for d in range(3)]
    assert parts == [range(0, 3), range(3, 6), range(6, 10)]
    with pytest.raises(ValueError, match="dp_rank=3"):
        dp_rows(10, 3, 3)


@pytest.mark.unit
def test_merge_shards_picks_rows_and_names_missing_keys() -> None:
    a = {"row_start": 0, "n": 2, "x": [1.0, 2.0]}
    b = {"row_start": 2, "n": 2, "x": [3.0, 4.0], "y": ["c", "d"]}
    out = merge_shards([b, None, a], range(1, 4), ["x"], optional=["y"])
    assert out == {"x": [2.0, 3.0, 4.0]}  # y does not cover row 1, so it is left out
    assert merge_shards([b], range(2, 4), ["x", "y"]) == {"x": [3.0, 4.0], "y": ["c", "d"]}
    with pytest.raises(ValueError, match=r"input key 'y': rows \[1\]"):
        merge_shards([a, b], range(1, 4), ["y"])


@pytest.mark.unit
def test_packing_round_trips_response_values() -> None:
    prompts = [torch.tensor([1, 5, 6]), torch.tensor([1, 7])]
    responses = [torch.tensor([8, 2]), torch.tensor([9, 9, 2])]
    tokens, lengths, mask = pack_rows(prompts, responses)
    assert tokens.tolist() == [1, 5, 6, 8, 2, 1, 7, 9, 9, 2] and lengths == [5, 5]
    assert mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    values = [torch.tensor([0.5, -1.0]), torch.tensor([1.0, 2.0, 3.0])]
    per_token = scatter_responses(values, [3, 2])
    back = gather_responses(per_token, [3, 2], [2, 3])
    assert [v.tolist() for v in back] == [[0.5, -1.0], [1.0, 2.0, 3.0]]


@pytest.mark.unit
def test_import_object_and_reward_score_errors_name_the_setting() -> None:
    assert import_object("app.data.toy_task:toy_reward", "params['reward_fn']")("12", "34", None) > 0
    with pytest.raises(ValueError, match="params\\['reward_fn'\\].*no attribute 'nope'"):
        import_object("app.data.toy_task:nope", "params['reward_fn']")
    with pytest.raises(ValueError, match="cannot import module"):
        import_object("no_such_module_xyz:f", "params['reward_fn']")
    assert reward_score({"score": 1, "extra": 2}, "f") == 1.0 and reward_score(True, "f") == 1.0
    with pytest.raises(ValueError, match="without 'score'"):
        reward_score({"value": 1}, "f")


@pytest.mark.unit
def test_default_ops_and_seeds() -> None:
    assert default_op("actor", "generate", {}) == "generate"
    assert default_op("reward", "inference", {"reward_fn": "m:f"}) == "rule_reward"
    assert default_op("reward", "inference", {}) == "model_reward"
    assert default_op("critic", "train", {}) == "ppo_critic"
    assert generation_seed(0, 1, 0) != generation_seed(0, 1, 4) != generation_seed(0, 2, 4)


# ---- a serial worker ---------------------------------------------------------------------------------


def _prompts(n: int) -> dict[str, Any]:
    from app.data.toy_task import CharTokenizer, generate_toy_prompts

    records = generate_toy_prompts(n, seed=1)
    return {"row_start": 0, "n": n, "prompt": [r["prompt"] for r in records], "answer": [r["answer"] for r in records],
            "prompt_ids": [torch.tensor(CharTokenizer().encode_prompt(r["prompt"])) for r in records]}


def _serial_worker() -> ModelWorker:
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("actor", SPEC, False, ONE, None, 0, True, {"lr": 1e-2})
    worker.load_model("ref", SPEC, False, ONE, None, 0, False, {})
    return worker


def _call(worker: ModelWorker, name: str, role: str, kind: str, n: int, params: dict, *inputs: dict) -> tuple[dict, dict]:
    return worker.run_call(CallSpec(name, role, kind, ONE, 0, n, params), *inputs)


def _actor_weights(worker: ModelWorker) -> dict[str, torch.Tensor]:
    engine = worker._roles["actor"].engines[ONE]
    return {k: v.detach().clone() for k, v in engine.model.named_parameters()}


@pytest.mark.unit
def test_serial_grpo_iteration_trains_the_actor() -> None:
    worker = _serial_worker()
    n_prompts, group = 3, 4
    n = n_prompts * group
    gen_params = {"op": "generate", "max_new_tokens": 4, "seed": 2, "n_samples": group, "tokenizer": TOKENIZER}
    gen_meta, gen = _call(worker, "actor_gen", "actor", "generate", n, gen_params, _prompts(n_prompts))
    assert gen["n"] == n and gen["prompt_index"] == [r // group for r in range(n)]
    assert gen_meta["gen_tokens"] == sum(t.numel() for t in gen["response_ids"])
    # Generation decodes only the console's samples; the reward call decodes every response.
    assert "response" not in gen and all(isinstance(s["response"], str) for s in gen_meta["samples"])
    reward = {"reward_fn": "app.data.toy_task:toy_reward", "tokenizer": TOKENIZER}
    _, rew = _call(worker, "rew_inf", "reward", "inference", n, reward, gen)
    _, ref = _call(worker, "ref_inf", "ref", "inference", n, {"op": "logprobs"}, gen)
    assert [t.shape for t in ref["ref_logprobs"]] == [t.shape for t in gen["response_ids"]]
    before = _actor_weights(worker)
    train = {"op": "grpo_actor", "group_size": group, "kl_loss_coef": 0.01, "ppo_minibatches": 2, "ppo_epochs": 1}
    meta, data = _call(worker, "actor_train", "actor", "train", n, train, gen, rew, ref)
    assert data is None
    assert meta["actor/optimizer_steps"] == 2.0 and meta["actor/kl"] == pytest.approx(0.0, abs=1e-5)
    assert meta["actor/kl_loss"] > 0 and "actor/pg_loss" in meta and meta["actor/grad_norm"] > 0
    after = _actor_weights(worker)
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4


@pytest.mark.unit
def test_serial_remax_iteration_uses_the_greedy_baseline() -> None:
    worker = _serial_worker()
    n = 4
    prompts = _prompts(n)
    base = {"op": "generate", "max_new_tokens": 4, "seed": 2, "tokenizer": TOKENIZER}
    _, sample = _call(worker, "sample_gen", "actor", "generate", n, base, prompts)
    _, greedy = _call(worker, "greedy_gen", "actor", "generate", n, {**base, "greedy": True, "out_prefix": "greedy_"},
                      prompts)
    assert "greedy_response_ids" in greedy
    reward = {"op": "rule_reward", "reward_fn": "app.data.toy_task:toy_reward", "tokenizer": TOKENIZER}
    _, rew = _call(worker, "rew_inf", "reward", "inference", n, reward, sample)
    _, grew = _call(worker, "greedy_rew_inf", "reward", "inference", n,
                    {**reward, "in_prefix": "greedy_", "out_key": "greedy_rewards"}, greedy)
    meta, _ = _call(worker, "actor_train", "actor", "train", n, {"op": "remax_actor"}, sample, rew, grew)
    assert meta["rollout/greedy_reward_mean"] == pytest.approx(sum(grew["greedy_rewards"]) / n)
    assert meta["rollout/reward_mean"] == pytest.approx(sum(rew["rewards"]) / n)


@pytest.mark.unit
def test_worker_errors_name_the_problem() -> None:
    worker = _serial_worker()
    other = Placement(Mesh(0, 1, 1), Layout())  # equal to ONE: fine
    assert other == ONE
    with pytest.raises(ValueError, match="never loaded"):
        _call(worker, "critic_inf", "critic", "inference", 2, {}, _prompts(2))
    with pytest.raises(ValueError, match="params\\['op'\\]='bogus'"):
        _call(worker, "x", "actor", "inference", 2, {"op": "bogus"})
    with pytest.raises(ValueError, match="max_new_tokens"):
        _call(worker, "actor_gen", "actor", "generate", 2, {}, _prompts(2))
    with pytest.raises(ValueError, match="optimizer lives on its home"):
        _call(worker, "ref_train", "ref", "train", 2, {})
    with pytest.raises(ValueError, match="home copy of a trained model"):
        worker.release("actor", ONE)
    with pytest.raises(ValueError, match="offload\\(actor\\)"):
        worker.offload("actor")
    with pytest.raises(ValueError, match="optim for actor: unknown keys \\['learning_rate'\\]"):
        worker.load_model("actor", SPEC, False, ONE, None, 0, True, {"learning_rate": 1.0})


@pytest.mark.unit
def test_offload_and_reload_keep_a_frozen_model() -> None:
    worker = _serial_worker()
    gen_params = {"op": "generate", "max_new_tokens": 3, "seed": 0}
    _, gen = _call(worker, "actor_gen", "actor", "generate", 2, gen_params, _prompts(2))
    _, first = _call(worker, "ref_inf", "ref", "inference", 2, {"op": "logprobs"}, gen)
    worker.offload("ref")
    assert worker._roles["ref"].copies.offloaded
    _, again = _call(worker, "ref_inf", "ref", "inference", 2, {"op": "logprobs"}, gen)  # reloads by itself
    for a, b in zip(first["ref_logprobs"], again["ref_logprobs"]):
        torch.testing.assert_close(a, b)


# ---- planner --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_planner_service_matches_search_plan() -> None:
    graph = ppo_graph(BatchShape(8, 16, 16), 2)
    tiny = ModelSpec("tiny", "llama", 256, 64, 128, 4, 4, 2, 16)
    problem = rlhf_problem(graph, ClusterSpec(1, 4, hardware_preset("h100-80g")), tiny)
    planner = PlannerService()
    got = planner.search(problem, "heuristic", 5.0, 0)
    want = search_plan(problem, "heuristic", 5.0, 0)
    assert got.plan == want.plan and got.est_iteration_s == pytest.approx(want.est_iteration_s)
    assert planner.stats()["searches"] == 1.0
    with pytest.raises(ValueError, match="mode='fast'"):
        planner.search(problem, "fast")
    with pytest.raises(TypeError, match="PlanningProblem"):
        planner.search("problem")  # type: ignore[arg-type]


@pytest.mark.unit
def test_select_rows_keeps_token_data_aligned() -> None:
    from actors.worker.train import select_rows

    batch = SequenceBatch(torch.arange(7), (3, 4), {"m": torch.arange(7).float()}, {"s": torch.tensor([10.0, 20.0])})
    sub = select_rows(batch, [1, 0])
    assert sub.tokens.tolist() == [3, 4, 5, 6, 0, 1, 2] and sub.lengths == (4, 3)
    assert sub.token_data["m"].tolist() == [3, 4, 5, 6, 0, 1, 2] and sub.seq_data["s"].tolist() == [20.0, 10.0]
