"""The first real run on CPU: GSM8K-format data, a real byte-level BPE tokenizer with a chat
template, and HF model directories (tiny Qwen2 and Llama, random weights, built offline by
tests/tiny_chat_model.py), through the shared local Ray (virtual GPUs).

* GRPO with the tiny Qwen2 runs examples/grpo-qwen2.5-0.5b-gsm8k.yaml itself (only the model path,
  the cluster and the sizes overridden): prompts from scripts/prepare_gsm8k.py's conversion of the
  shipped examples/data/gsm8k_tiny.jsonl, chat-templated; every sample of samples.jsonl holds a
  decoded response whose reward is `math_exact_match` of that text; the offline W&B run holds every
  value of metrics.jsonl (read back with wandb's own reader, `wandb leet inspect --json`); the
  exported actor (checkpoints/iter_2/actor) loads in transformers with its tokenizer and chats.
* PPO with the tiny Llama (actor, critic and reference from the same directory) does the same
  through a critic.
Two iterations each, tiny sizes: about a minute each on the 2-core CI machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.config.experiment import load_config
from app.data.rewards import math_exact_match
from app.reporting.samples import read_samples
from app.reporting.tracking import read_metrics
from app.run.driver import Driver
from tests.ray_fixtures import REPO_ROOT, ray_session  # noqa: F401  (the shared Ray instance fixture)
from tests.tiny_chat_model import GSM8K_TINY, build_tiny_chat_model

pytestmark = pytest.mark.ray

EXAMPLE = REPO_ROOT / "examples" / "grpo-qwen2.5-0.5b-gsm8k.yaml"
ITERATIONS = 2


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped GSM8K-format problems as a prompt file, by the script users run."""
    target = tmp_path_factory.mktemp("gsm8k") / "train.jsonl"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "prepare_gsm8k.py"), str(GSM8K_TINY),
                           str(target)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return target


def answers_by_prompt(path: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["prompt"]: row["answer"] for row in rows}


def real_config(run_dir: Path, model: Path, prompts: Path, *overrides: str) -> Any:
    """The GSM8K example on 2 virtual GPUs with the tiny model and tiny sizes."""
    return load_config(EXAMPLE, [
        f"models.actor.path={model}", f"data.tokenizer={model}", f"data.path={prompts}",
        "cluster.gpu=cpu", "cluster.virtual_gpus=true", "cluster.gpus_per_node=2", "plan.seconds=1",
        "batch.prompts=4", "batch.group_size=4", "batch.prompt_len=192", "batch.gen_len=12",
        "batch.ppo_minibatches=2", f"run.iterations={ITERATIONS}", f"run.dir={run_dir}", "tracking.console=false",
        "checkpoint.every=0", "ppo.actor_lr=1e-3", *overrides,
    ])


def check_samples(run_dir: Path, prompts: Path) -> None:
    """Decoded responses, scored by math_exact_match of exactly that text."""
    answers = answers_by_prompt(prompts)
    samples = read_samples(run_dir / "samples.jsonl")
    assert {s["iteration"] for s in samples} == set(range(ITERATIONS))
    for sample in samples:
        assert sample["prompt"] in answers, sample["prompt"]  # the dataset's text, not the templated one
        assert isinstance(sample["response"], str) and "<|im_start|>" not in sample["response"]
        expected = math_exact_match(sample["prompt"], sample["response"], answers[sample["prompt"]])
        assert sample["reward"] == expected, sample
    assert any(s["response"].strip() for s in samples), "every decoded response is empty"


def check_checkpoint_chats(actor_dir: Path, family: str) -> None:
    """The exported actor loads in transformers with the copied tokenizer and generates."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(actor_dir).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(actor_dir)
    assert model.config.model_type == family
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 14 + 9?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """History records of the run's offline W&B transaction log, read by wandb itself."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                          capture_output=True, text=True, timeout=180, cwd=run_dir, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [r["history"] for r in records if r.get("type") == "history"]


def check_wandb_holds_metrics(run_dir: Path) -> None:
    history = {int(h["step"]["num"]): h["item"] for h in wandb_history(run_dir)}
    rows = read_metrics(run_dir)
    assert sorted(history) == [row["iteration"] for row in rows]
    for row in rows:
        item = history[row["iteration"]]
        for key, value in row.items():
            if key == "iteration":
                continue
            assert key in item, f"W&B step {row['iteration']} lacks {key}"
            if value is None:  # metrics.jsonl writes non-finite values as null; W&B keeps "NaN"
                assert item[key] in ("NaN", "Infinity", "-Infinity") or not math.isfinite(float(item[key]))
            else:
                assert float(item[key]) == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_grpo_on_gsm8k_with_a_real_tokenizer(ray_session: None, tmp_path: Path, prompts: Path,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    model = build_tiny_chat_model(tmp_path / "qwen2", "qwen2")
    run_dir = tmp_path / "run"
    cfg = real_config(run_dir, model, prompts)
    assert cfg.algorithm == "grpo" and cfg.data.chat_template and cfg.tracking.wandb
    rows = Driver(cfg, run_dir).run()
    assert [int(r["iteration"]) for r in rows] == list(range(ITERATIONS))
    for row in rows:
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0 and math.isfinite(row["actor/pg_loss"])
        assert row["actor/kl_loss"] >= 0.0 and row["perf/throughput"] > 0
    check_samples(run_dir, prompts)
    check_wandb_holds_metrics(run_dir)
    check_checkpoint_chats(run_dir / "checkpoints" / f"iter_{ITERATIONS}" / "actor", "qwen2")


def test_ppo_on_gsm8k_with_a_llama_and_a_critic(ray_session: None, tmp_path: Path, prompts: Path) -> None:  # noqa: F811
    model = build_tiny_chat_model(tmp_path / "llama", "llama")
    run_dir = tmp_path / "run"
    cfg = real_config(run_dir, model, prompts, "algorithm=ppo", f"models.critic.path={model}",
                      "tracking.wandb=false", "batch.prompts=8", "ppo.critic_lr=1e-3")
    rows = Driver(cfg, run_dir).run()
    assert [int(r["iteration"]) for r in rows] == list(range(ITERATIONS))
    assert all(math.isfinite(r["critic/vf_loss"]) and 0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)
    check_samples(run_dir, prompts)
    final = run_dir / "checkpoints" / f"iter_{ITERATIONS}"
    check_checkpoint_chats(final / "actor", "llama")
    assert (final / "critic" / "tokenizer.json").is_file()
