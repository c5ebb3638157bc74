"""The driver end to end on the shared local Ray (2 CPUs, 4 virtual GPUs), with the real workers.

* the embedded default (examples/ppo-tiny.yaml) runs 3 iterations stepped one at a time: plan.json,
  metrics.jsonl with the issue's metric names, timeline, Gantt chart, timings and a complete HF
  checkpoint of actor and critic that transformers loads;
* calls on disjoint meshes overlapped in time (critic training is slowed by a sleep to make
  the overlap certain on a loaded machine) (ref_inf on GPUs 0-1 with critic_inf on 2-3,
  actor_train with critic_train) and iteration i+1's generation started before iteration i's
  critic training ended (cross-iteration overlap);
* a worker that dies and a worker that stalls end the run (run.max_restarts=0: no recovery, see
  test_recovery_ray.py) with a DriverError naming the call and the worker (for the stall, the
  rank that stopped, not its peer waiting in a collective), and leave metrics.jsonl valid;
* a run started from a checkpoint's exported actor and critic (the README's recipe) has the
  trained weights: its first KL to the untouched reference is non-zero, a fresh run's is 0;
* the learning check: 30 iterations of the default config; the mean reward of the last 5 must
  exceed the first 5 by LEARNING_MARGIN. Measured on the 2-core dev machine (2026-12-02): first 5
  0.007, last 5 0.296 (after all 40: 0.450), so it runs in CI (well under a minute).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from actors.worker import CallSpec, ModelWorker
from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.reporting.timeline import TimelineRecord, read_records, span
from app.reporting.tracking import read_metrics
from app.run.checkpoint import latest_checkpoint
from app.run.driver import Driver, DriverError
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

ISSUE_METRICS = ("rollout/reward_mean", "rollout/response_length_mean", "actor/pg_loss", "actor/kl",
                 "critic/vf_loss", "timing_s/actor_gen", "timing_s/iteration", "perf/throughput")
CRITIC_DELAY_S = 1.5
# The learning run's budget on this 2-core machine (the issue's target is 5 minutes).
LEARNING_BUDGET_S = 300.0
LEARNING_MARGIN = 0.15


def tiny_config(run_dir: Path, *overrides: str):
    return load_config(DEFAULT_CONFIG, [f"run.dir={run_dir}", "tracking.console=false", *overrides])


def overlap(a: list[TimelineRecord], b: list[TimelineRecord]) -> float:
    """Seconds during which both sets of records ran."""
    (a0, a1), (b0, b1) = span(a), span(b)
    return min(a1, b1) - max(a0, b0)


class SlowCriticWorker(ModelWorker):
    """The real worker, with critic training made slower than the actor's (both critic ranks),
    so that overlapping the next iteration's generation with it is visible in the timeline."""

    def run_call(self, call: CallSpec, *inputs: dict | None) -> tuple[dict, dict | None]:
        if call.name != "critic_train":
            return super().run_call(call, *inputs)
        start = time.time()
        time.sleep(CRITIC_DELAY_S)
        meta, data = super().run_call(call, *inputs)
        return {**meta, "start": start}, data  # the delay is part of the call's measured time


def test_default_config_runs_three_iterations_with_overlap(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = tiny_config(tmp_path, "run.iterations=3", "checkpoint.every=2")
    driver = Driver(cfg, tmp_path, worker_cls=SlowCriticWorker)
    try:
        rows = [driver.step() for _ in range(3)]
    finally:
        driver.close()
    assert [int(r["iteration"]) for r in rows] == [0, 1, 2]
    metrics = read_metrics(tmp_path)
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    for name in ISSUE_METRICS:
        assert all(m.get(name) is not None for m in metrics), name
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 for m in metrics)
    # The actor's tp2 -> dp2 move each iteration: each GPU keeps its half and receives the other
    # (over gloo here: nothing is pulled, which needs CUDA).
    assert all(m["realloc/received_gb"] > 0 and m["realloc/local_gb"] > 0 for m in metrics)
    assert all(m["realloc/pulled_gb"] == 0 for m in metrics)
    plan = json.loads((tmp_path / "plan.json").read_text())
    layouts = {call["layout"] for call in plan["calls"]}
    assert {"dp2tp1pp1", "dp1tp2pp1"} <= layouts  # different layouts for different calls
    assert (tmp_path / "gantt.png").stat().st_size > 0
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert all(row["measured_s"] > 0 and row["estimated_s"] > 0 for row in timings)
    check_overlap(read_records(tmp_path / "timeline.jsonl"))
    for done in (2, 3):  # checkpoint.every=2, and at the end
        check_checkpoint(tmp_path / "checkpoints" / f"iter_{done}")


def check_overlap(records: list[TimelineRecord]) -> None:
    def of(name: str, iteration: int) -> list[TimelineRecord]:
        return [r for r in records if r.name == name and r.iteration == iteration and r.kind == "call"]

    assert {r.rank for r in of("ref_inf", 1)} == {0, 1} and {r.rank for r in of("critic_inf", 1)} == {2, 3}
    concurrent = [overlap(of("ref_inf", i), of("critic_inf", i)) for i in range(3)]
    concurrent += [overlap(of("actor_train", i), of("critic_train", i)) for i in range(3)]
    assert max(concurrent) > 0, f"no call on disjoint meshes overlapped: {concurrent}"
    # Iteration i+1's generation (GPUs 0-1) does not wait for iteration i's (slowed) critic
    # training on GPUs 2-3: the driver submitted it before waiting on iteration i.
    ahead = [span(of("critic_train", i))[1] - span(of("actor_gen", i + 1))[0] for i in range(2)]
    assert max(ahead) > 0, f"generation never started before the previous critic training ended: {ahead}"
    realloc = [r for r in records if r.kind == "realloc"]
    assert {r.rank for r in realloc} == {0, 1} and len({r.iteration for r in realloc}) == 3


def check_checkpoint(directory: Path) -> None:
    from transformers import AutoConfig

    marker = json.loads((directory / "checkpoint.json").read_text())
    assert marker["roles"] == ["actor", "critic"]
    for role in ("actor", "critic"):
        config = AutoConfig.from_pretrained(directory / role)
        assert config.model_type == "llama"
        assert any(p.suffix == ".safetensors" for p in (directory / role).iterdir())


class DyingWorker(ModelWorker):
    """Rank 3 exits in iteration 1's critic inference, as a crashed process would."""

    def run_call(self, call: CallSpec, *inputs: dict | None) -> tuple[dict, dict | None]:
        if call.name == "critic_inf" and call.iteration == 1 and self.rank == 3:
            os._exit(1)
        return super().run_call(call, *inputs)


class StallingWorker(ModelWorker):
    """Rank 2 hangs in iteration 0's critic training (its peers wait in the collective)."""

    def run_call(self, call: CallSpec, *inputs: dict | None) -> tuple[dict, dict | None]:
        if call.name == "critic_train" and call.iteration == 0 and self.rank == 2:
            time.sleep(3600)
        return super().run_call(call, *inputs)


def test_dead_worker_ends_the_run_naming_call_and_worker(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = tiny_config(tmp_path, "run.iterations=3", "checkpoint.every=1", "run.max_restarts=0")
    driver = Driver(cfg, tmp_path, worker_cls=DyingWorker)
    with pytest.raises(DriverError) as caught:
        driver.run()
    message = str(caught.value)
    assert "critic_inf" in message and "iteration 1" in message and "worker-n0-g3" in message
    metrics = read_metrics(tmp_path)
    assert [m["iteration"] for m in metrics] == [0]  # the finished iteration stays recorded
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_1"  # and its checkpoint
    check_checkpoint(tmp_path / "checkpoints" / "iter_1")
    assert driver.workers is None  # closed: actors killed, placement groups removed


def test_stalled_worker_times_out_naming_call_and_worker(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    # 20 s: the bound covers loading the models too, which took over 10 s on a busy 2-core machine.
    cfg = tiny_config(tmp_path, "run.iterations=2", "run.call_timeout_s=20", "checkpoint.at_end=false",
                      "run.max_restarts=0")
    driver = Driver(cfg, tmp_path, worker_cls=StallingWorker)
    started = time.monotonic()
    with pytest.raises(DriverError) as caught:
        driver.run()
    assert time.monotonic() - started < 120
    message = str(caught.value)
    assert "critic_train" in message and "no progress" in message
    # The stall names the rank that stopped (rank 2 sleeps outside any collective), not its peer.
    assert "worker-n0-g2 stopped in run_call" in message and "worker-n0-g3 wait(s) in a collective" in message


def test_ppo_learns_the_toy_task(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = tiny_config(tmp_path, "checkpoint.at_end=false", "checkpoint.every=0", "run.iterations=30")
    started = time.monotonic()
    Driver(cfg, tmp_path).run()
    elapsed = time.monotonic() - started
    rewards = [m["rollout/reward_mean"] for m in read_metrics(tmp_path)]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"learning: first 5 {first:.3f}, last 5 {last:.3f}, {elapsed:.0f} s")
    assert last > first + LEARNING_MARGIN, f"reward did not climb: first 5 {first:.3f}, last 5 {last:.3f}"
    assert elapsed < LEARNING_BUDGET_S


def tiny_hf_model(directory: Path) -> Path:
    """A random 2-layer Llama with a word-level tokenizer (64 ids), saved like any HF checkpoint."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_score_on_ray_matches_transformers(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    import torch
    import transformers

    from app.cli import main

    model_dir = tiny_hf_model(tmp_path / "model")
    texts = ["w1 w2 w3 w4 w5", "w7", "w9 w8 w7 w6 w5 w4 w3 w2 w1", "w10 w11 w12"]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "scores.jsonl"
    assert main(["score", "--model", str(model_dir), "--data", str(data), "--layout", "tp2,pp2",
                 "--out", str(out), "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert [r["text"] for r in rows] == texts
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        assert row["tokens"] == ids and len(row["logprobs"]) == len(ids) - 1
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row["logprobs"]), expected, atol=1e-4, rtol=1e-4)


def test_generate_on_ray_matches_the_local_path_greedy(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    from app.cli import main

    model_dir = tiny_hf_model(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["w1 w2", "w3", "w4 w5 w6"]))
    common = ["generate", "--model", str(model_dir), "--data", str(data), "--max-new-tokens", "5",
              "--temperature", "0", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "local.jsonl"), "--local"]) == 0
    assert main([*common, "--out", str(tmp_path / "ray.jsonl"), "--layout", "dp1tp2pp1",
                 "--batch-size", "2"]) == 0
    local = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    remote = [json.loads(line) for line in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in remote] == ["w1 w2", "w3", "w4 w5 w6"]
    assert [r["response_tokens"] for r in remote] == [r["response_tokens"] for r in local]
    for a, b in zip(remote, local):
        assert len(a["response_tokens"]) >= 1
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_a_run_starts_from_a_checkpoints_weights(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    # The README's recipe: point actor and critic at a checkpoint, keep the reference original.
    first = tmp_path / "first"
    Driver(tiny_config(first, "run.iterations=2", "checkpoint.at_end=true"), first).run()
    done = latest_checkpoint(first)
    assert done is not None and done.name == "iter_2"
    second = tmp_path / "second"
    cfg = tiny_config(second, "run.iterations=1", "checkpoint.at_end=false",
                      "models.actor.preset=null", f"models.actor.path={done / 'actor'}",
                      "models.critic.preset=null", f"models.critic.path={done / 'critic'}", "models.ref.preset=tiny")
    rows = Driver(cfg, second).run()
    # Untrained, the actor starts as its reference (KL 0 in the first run's first iteration); from
    # the checkpoint it has moved away.
    assert read_metrics(first)[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["actor/kl"] > 1e-4


def test_train_command_in_process(ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from app.cli import main

    run_dir = tmp_path / "run"
    # A learned reward model (random here, the critic's shape) instead of the rule-based reward.
    assert main(["train", str(DEFAULT_CONFIG), "--iterations", "2", "--run-dir", str(run_dir),
                 "tracking.console=false", "checkpoint.at_end=false", "reward.function=null"]) == 0
    out = capsys.readouterr().out
    assert f"run directory: {run_dir}" in out and "2 iterations; reward mean" in out
    assert [m["iteration"] for m in read_metrics(run_dir)] == [0, 1]
    assert not (run_dir / "checkpoints").exists()


def test_config_larger_than_the_ray_cluster_fails_before_workers(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    import ray

    from app.config.experiment import ConfigError

    cfg = tiny_config(tmp_path, "cluster.gpus_per_node=8")  # the shared Ray has 4 GPUs
    actors_before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(ConfigError, match=r"cluster='1x8': larger than the Ray cluster: .*no node holds 8 GPUs "
                                          r"\(the most on one node: 4\)"):
        Driver(cfg, tmp_path)
    assert len(ray.util.list_named_actors(all_namespaces=True)) == actors_before
