"""DPO end to end: pair-preserving splits, the DPO loss through the parallel engine, the
`dpo_actor` op, the toy preference data, preflight errors and a Ray run of examples/dpo-tiny.yaml.

The dist case uses 8 sequences (4 pairs) whose token-balanced dp=2 split without groups would cut
between pair 1's chosen and rejected sequence (asserted), so the engine's result matching the
serial computation shows that the group_size=2 split keeps pairs whole.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from actors.engine.model_engine import ModelEngine, SequenceBatch
from actors.engine.optimizer import AdamWConfig
from actors.engine.pipeline import split_by_tokens
from actors.engine.process_groups import ParallelGroups, build_parallel_groups, destroy_parallel_groups
from actors.rl.losses import dpo_loss, sequence_logprob_sums
from actors.worker.calls import CallContext, CallSpec
from actors.worker.train import dpo_loss_fn, run_dpo_actor
from app.algorithms import AlgorithmSettings, call_params, settings_from_config
from app.algorithms.dpo import DPOHyperparams, preference_shard, toy_preference_records, toy_rejected
from app.config.experiment import ConfigError, load_config
from app.config.problem import build_graph
from app.data.datasets import tokenize_preferences
from app.data.toy_task import CharTokenizer, toy_target
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement
from tests.dist_harness import run_distributed
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

DPO_TINY = Path(__file__).resolve().parents[3] / "examples" / "dpo-tiny.yaml"
SPEC = ModelSpec("dpo-test", "llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=64)
OPTIM = AdamWConfig(lr=1e-2, max_grad_norm=1.0)
# 4 pairs; prefix sums 0,4,14,18,22,..: the ungrouped dp=2 cut lands at sequence 3 (odd, mid-pair).
LENGTHS = (4, 10, 4, 4, 4, 4, 4, 4)
PROMPT_LEN = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}


# ---- splits and values (unit) ----------------------------------------------------------------------


@pytest.mark.unit
def test_grouped_split_keeps_pairs_whole_and_balances_tokens() -> None:
    plain = split_by_tokens(list(LENGTHS), 2)
    assert plain[0].stop % 2 == 1  # the plain split would separate a pair: the case is meaningful
    for n_parts in (1, 2, 3, 4):
        parts = split_by_tokens(list(LENGTHS), n_parts, group_size=2)
        assert len(parts) == n_parts and parts[0].start == 0 and parts[-1].stop == len(LENGTHS)
        assert all(p.start % 2 == 0 and p.stop % 2 == 0 and len(p) > 0 for p in parts)
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert split_by_tokens([1, 1, 9, 9, 1, 1, 1, 1], 2, group_size=2) == [range(0, 4), range(4, 8)]
    assert split_by_tokens([3, 5], 1, group_size=1) == [range(0, 2)]


@pytest.mark.unit
@pytest.mark.parametrize(("lengths", "n_parts", "group", "message"), [
    ([1, 2, 3], 1, 2, "must divide the number of sequences"),
    ([1, 2, 3, 4], 3, 2, "number of groups of 2"),
    ([1, 2], 1, 0, "group_size=0"),
])
def test_grouped_split_rejects_bad_input(lengths: list[int], n_parts: int, group: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_by_tokens(lengths, n_parts, group)


@pytest.mark.unit
def test_sequence_batch_group_size_is_checked_and_kept_by_select() -> None:
    tokens = torch.arange(sum(LENGTHS))
    batch = SequenceBatch(tokens, LENGTHS, group_size=2)
    assert batch.select(range(2, 6)).group_size == 2
    with pytest.raises(ValueError, match="group_size=3"):
        SequenceBatch(tokens, LENGTHS, group_size=3)


@pytest.mark.unit
def test_toy_pairs_are_deterministic_and_tokenise_into_rows_2i_2i_plus_1() -> None:
    records = toy_preference_records(16, seed=5)
    assert records == toy_preference_records(16, seed=5) and records != toy_preference_records(16, seed=6)
    for i, r in enumerate(records):
        assert r.chosen == toy_target(r.prompt) and r.rejected != r.chosen and len(r.rejected) == len(r.chosen)
        assert r.source == f"toy:{i}"
    assert records[0].rejected == toy_rejected(records[0].prompt)
    examples = tokenize_preferences(records[:3], CharTokenizer())
    shard = preference_shard(examples)
    assert shard["n"] == 6 and shard["pair_index"] == [0, 0, 1, 1, 2, 2]
    for i, e in enumerate(examples):
        assert shard["prompt_ids"][2 * i].tolist() == list(e.prompt_ids) == shard["prompt_ids"][2 * i + 1].tolist()
        assert shard["response_ids"][2 * i].tolist() == list(e.chosen_ids)
        assert shard["response_ids"][2 * i + 1].tolist() == list(e.rejected_ids)


@pytest.mark.unit
def test_dpo_settings_and_call_params_from_the_example_config() -> None:
    cfg = load_config(DPO_TINY, ["dpo.beta=0.2", "dpo.label_smoothing=0.1"])
    settings = settings_from_config(cfg, None, None, eos_token_id=2)
    assert settings.dpo == DPOHyperparams(beta=0.2, label_smoothing=0.1, epochs=1, minibatches=2, seed=0)
    graph = build_graph(cfg)
    ref = call_params(settings, graph.mfc("ref_inf"), kl_coef=0.0)
    train = call_params(settings, graph.mfc("actor_train"), kl_coef=0.0)
    assert ref == {"op": "logprobs", "temperature": 1.0, "out_key": "ref_logprobs"}
    assert train["op"] == "dpo_actor" and train["beta"] == 0.2 and train["label_smoothing"] == 0.1
    assert train["ppo_minibatches"] == 2
    with pytest.raises(ValueError, match="settings.dpo"):
        AlgorithmSettings("dpo", settings.rollout, settings.ppo)
    with pytest.raises(ValueError, match=r"dpo.beta=0"):
        DPOHyperparams(beta=0)
    with pytest.raises(ConfigError, match="dpo.label_smoothing"):
        load_config(DPO_TINY, ["dpo.label_smoothing=0.5"])


# ---- preflight (unit) -------------------------------------------------------------------------------


@pytest.mark.unit
def test_bad_preference_data_exits_2_naming_file_and_line(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    import ray

    from app.cli import main

    ray_was_up = ray.is_initialized()  # another test's shared instance may already run
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "12", "chosen": "3", "rejected": "4"}) + "\n"
                    + json.dumps({"prompt": "12", "chosen": "3"}) + "\n")
    status = main(["train", str(DPO_TINY), f"data.path={data}", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0
    assert f"{data} line 2" in err and "'rejected'" in err and "dpo.rejected_key" in err
    assert ray.is_initialized() == ray_was_up and not (tmp_path / "run").exists()  # failed before Ray
    data.write_text(json.dumps({"q": "12", "good": "3", "bad": "4"}) + "\n")
    status = main(["train", str(DPO_TINY), f"data.path={data}", "data.prompt_key=q", "dpo.chosen_key=good",
                   "dpo.rejected_key=bad", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "batch.prompts=32" in err and "1 usable preference pairs" in err


# ---- engine and op over 2 gloo ranks (dist) -----------------------------------------------------------


def pair_batch() -> SequenceBatch:
    """4 pairs of random tokens: the first PROMPT_LEN tokens of each sequence are the prompt."""
    gen = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    mask = torch.cat([torch.cat([torch.zeros(PROMPT_LEN), torch.ones(n - PROMPT_LEN)]) for n in LENGTHS])
    ref_logps = -torch.rand(len(LENGTHS), generator=gen) * 20.0
    return SequenceBatch(torch.randint(0, SPEC.vocab_size, (total,), generator=gen), LENGTHS, {"mask": mask},
                         {"ref_logps": ref_logps}, group_size=2)


def direct_dpo(batch: SequenceBatch, beta: float, smoothing: float) -> dict[str, float]:
    """DPO statistics from the serial model's logprobs, computed over all pairs at once."""
    engine = ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", seed=0)
    logprobs = engine.forward_logprobs(batch)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    sums = sequence_logprob_sums(logprobs, batch.token_data["mask"], cu)
    ref = batch.seq_data["ref_logps"]
    out = dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta, smoothing)
    return {k: float(v) / float(out.count) for k, v in {"loss": out.loss, **out.stats}.items()}


def serial_grads(batch: SequenceBatch, beta: float, smoothing: float) -> dict[str, torch.Tensor]:
    engine = ModelEngine(SPEC, False, ParallelGroups.serial(), "cpu", seed=0, optim_config=OPTIM)
    _, count = engine.backward_step(batch, dpo_loss_fn(beta, smoothing), 1)
    return {name: p.grad.detach() / count for name, p in engine.model.named_parameters()}


def op_shard(batch: SequenceBatch) -> dict:
    """The batch as the dpo_actor op's input rows (prompt_ids, response_ids, ref_logprobs)."""
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    seqs = [batch.tokens[cu[i]:cu[i + 1]] for i in range(len(LENGTHS))]
    ref = batch.seq_data["ref_logps"]
    # Spread each sequence's reference sum over its response tokens (the op sums them back).
    ref_tokens = [torch.full((len(s) - PROMPT_LEN,), float(ref[i]) / (len(s) - PROMPT_LEN)) for i, s in enumerate(seqs)]
    return {"row_start": 0, "n": len(seqs), "prompt_ids": [s[:PROMPT_LEN] for s in seqs],
            "response_ids": [s[PROMPT_LEN:] for s in seqs], "ref_logprobs": ref_tokens}


def run_op(groups: ParallelGroups, layout: Layout, micro: int) -> dict[str, float]:
    """Two iterations of the dpo_actor op (2 minibatches, 2 epochs) under `layout`."""
    engine = ModelEngine(SPEC, False, groups, "cpu", seed=0, optim_config=OPTIM)
    placement = Placement(Mesh(0, layout.world_size, 2), layout)
    params = {"op": "dpo_actor", "beta": 0.5, "label_smoothing": 0.1, "ppo_minibatches": 2, "ppo_epochs": 2,
              "seed": 4, "micro_batches": micro}
    shard = op_shard(pair_batch())
    metrics: dict[str, float] = {}
    for iteration in range(2):
        call = CallSpec("actor_train", "actor", "train", placement, iteration, len(LENGTHS), params)
        ctx = CallContext(call, engine, groups, dist.get_rank() if groups.dp_group is not None else 0,
                          torch.device("cpu"))
        metrics = run_dpo_actor(ctx, [shard])[0]
    return metrics


def dpo_engine_worker(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    batch, beta, smoothing = pair_batch(), 0.5, 0.1
    expected = direct_dpo(batch, beta, smoothing)
    grads = serial_grads(batch, beta, smoothing)
    serial_op = run_op(ParallelGroups.serial(), Layout(), 1)
    layout = Layout(dp=2)
    groups = build_parallel_groups(layout, list(range(world_size)))
    assert groups is not None
    engine = ModelEngine(SPEC, False, groups, "cpu", seed=0, optim_config=OPTIM)
    metrics, count = engine.backward_step(batch, dpo_loss_fn(beta, smoothing), n_micro=2)
    assert count == len(LENGTHS) // 2
    for key in ("loss", "dpo_loss", "reward_margin", "rewards_chosen", "rewards_rejected", "reward_accuracy"):
        assert math.isclose(metrics[key], expected[key], rel_tol=1e-5, abs_tol=1e-6), (key, metrics[key], expected[key])
    for name, param in engine.model.named_parameters():
        grad = param.grad.detach().clone() / count
        dist.all_reduce(grad, group=groups.dp_group)
        torch.testing.assert_close(grad, grads[name], **TOL, msg=lambda m: f"grad {name}: {m}")
    parallel_op = run_op(groups, layout, 2)
    for key in ("actor/dpo_loss", "actor/reward_margin", "actor/reward_accuracy", "actor/grad_norm"):
        assert math.isclose(parallel_op[key], serial_op[key], rel_tol=1e-4, abs_tol=1e-5), \
            (key, parallel_op[key], serial_op[key])
    assert parallel_op["actor/optimizer_steps"] == 4.0 and parallel_op["actor/pairs"] == 4.0
    destroy_parallel_groups(groups)
    return "ok"


@pytest.mark.dist
def test_dpo_loss_through_the_engine_matches_the_direct_computation() -> None:
    assert run_distributed(dpo_engine_worker, 2) == ["ok", "ok"]


# ---- the example on Ray (ray) -------------------------------------------------------------------------


@pytest.mark.ray
def test_dpo_tiny_trains_on_ray(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    from app.reporting.tracking import read_metrics
    from app.run.driver import Driver

    cfg = load_config(DPO_TINY, [f"run.dir={tmp_path}", "run.iterations=3", "tracking.console=false"])
    started = time.monotonic()
    Driver(cfg, tmp_path).run()
    elapsed = time.monotonic() - started
    metrics = read_metrics(tmp_path)
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    losses = [m["actor/dpo_loss"] for m in metrics]
    margins = [m["actor/reward_margin"] for m in metrics]
    assert all(m.get("timing_s/actor_train") is not None and m.get("timing_s/ref_inf") is not None for m in metrics)
    assert losses[-1] < losses[0] < math.log(2.0) + 1e-3, losses  # starts at log 2: ref == initial actor
    assert margins[-1] > margins[0], margins
    assert elapsed < 60.0, elapsed
