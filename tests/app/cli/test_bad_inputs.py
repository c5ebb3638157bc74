"""Bad inputs, fuzzed: every one exits with status 2 and ONE `error:` line naming the field (or
flag, file and line), no traceback, and never reaches Ray (checked by making every way to
Ray fail loudly). Run in-process through `app.cli.main`, so the whole table takes seconds.

Cases cover configs (YAML, encodings, duplicate keys, every section's bounds), overrides, the
run directory and `run.resume`, datasets, model directories (no weights, truncated or garbled
safetensors, missing tensors, wrong shapes), tokenizer directories, CLI flags of `generate`,
`score` and `profile`, and reward functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app.cli import main
from app.cli.train import DEFAULT_CONFIG
from planning.models import ModelSpec, param_specs

pytestmark = pytest.mark.unit

SPEC = ModelSpec("fuzz", "llama", vocab_size=256, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
HF_CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False}


def model_dir(root: Path, edit: Callable[[Path, dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A tiny HF-style llama directory (config.json + model.safetensors), optionally broken by `edit`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    tensors = {p.name: torch.zeros(p.shape) for p in param_specs(SPEC)}
    if edit is None:
        save_file(tensors, str(root / "model.safetensors"))
    else:
        edit(root, tensors)
    return root


def truncated(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(root / "model.safetensors"))
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) // 2])


def garbled(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    (root / "model.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"not json at all, no no no!!" + b"x" * 64)


def missing_tensor(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(root / "model.safetensors"))


def wrong_shape(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.norm.weight"] = torch.zeros(31)
    save_file(tensors, str(root / "model.safetensors"))


def bin_only(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    (root / "pytorch_model.bin").write_bytes(b"\0" * 16)


def index_to_nothing(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "part-1.safetensors"
                                                                                 for n in tensors}}))


def no_weights(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    pass


def bad_config_json(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text("{not json")


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def parquet_without_prompt(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1 2 3", "4 5 6"]}), path)
    return path


EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def train(*overrides: str, config: str = str(DEFAULT_CONFIG)) -> list[str]:
    return ["train", config, *overrides]


def gen(tmp: Path, *flags: str, model: Path | None = None) -> list[str]:
    data = write(tmp / "prompts.jsonl", '{"prompt": "w1 w2"}\n')
    defaults = {"--model": str(model or model_dir(tmp / "model")), "--data": str(data), "--out": str(tmp / "out.jsonl")}
    given = dict(zip(flags[::2], flags[1::2]))
    return ["generate", *[x for k, v in {**defaults, **given}.items() for x in (k, v)]]


def score(tmp: Path, *flags: str) -> list[str]:
    data = write(tmp / "texts.jsonl", '{"text": "w1 w2"}\n')
    defaults = {"--model": str(model_dir(tmp / "model")), "--data": str(data), "--out": str(tmp / "out.jsonl")}
    given = dict(zip(flags[::2], flags[1::2]))
    return ["score", *[x for k, v in {**defaults, **given}.items() for x in (k, v)]]


def run_dir_with_a_run(tmp: Path) -> list[str]:
    write(tmp / "run" / "metrics.jsonl", '{"iteration": 0}\n')
    return train(f"run.dir={tmp / 'run'}")


def incomplete_checkpoint(tmp: Path) -> list[str]:
    (tmp / "run" / "checkpoints" / "iter_3" / "actor").mkdir(parents=True)
    return train(f"run.dir={tmp / 'run'}", f"run.resume={tmp / 'run' / 'checkpoints' / 'iter_3'}")


def dataset(tmp: Path, name: str, content: str | bytes) -> list[str]:
    return train(f"data.path={write(tmp / name, content)}")


def reward_file(tmp: Path, source: str) -> list[str]:
    return train(f"reward.function={write(tmp / 'my_reward.py', source)}:score")


# id -> (argv built in a fresh tmp dir, what the one error line must contain)
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    # ---- config files and YAML
    "config_missing": (lambda t: ["train", str(t / "nope.yaml")], "config="),
    "yaml_syntax": (lambda t: ["train", str(write(t / "c.yaml", "algorithm: ppo\nmodels: [a, b\n"))], "line"),
    "yaml_duplicate_key": (lambda t: ["train", str(write(t / "c.yaml", "algorithm: ppo\nalgorithm: grpo\n"))],
                           "duplicate key 'algorithm'"),
    "yaml_nested_duplicate": (lambda t: ["train", str(write(t / "c.yaml", "models:\n  actor: {preset: tiny}\n"
                                                                           "  actor: {preset: tiny}\n"))],
                              "line 3"),
    "yaml_not_utf8": (lambda t: ["train", str(write(t / "c.yaml", b"algorithm: ppo\nrun:\n  name: caf\xe9\n"))],
                      "line 3: not UTF-8"),
    "yaml_is_a_list": (lambda t: ["train", str(write(t / "c.yaml", "- a\n- b\n"))], "YAML mapping"),
    "yaml_models_missing": (lambda t: ["train", str(write(t / "c.yaml", "algorithm: ppo\n"))], "models"),
    # ---- fields and bounds
    "unknown_section": (lambda t: train("foo.bar=1"), "foo"),
    "unknown_field": (lambda t: train("batch.promptz=3"), "batch.promptz"),
    "wrong_type": (lambda t: train("batch.prompts=abc"), "batch.prompts"),
    "zero_prompts": (lambda t: train("batch.prompts=0"), "batch.prompts"),
    "unknown_algorithm": (lambda t: train("algorithm=sft"), "algorithm"),
    "unknown_preset": (lambda t: train("models.actor.preset=nope"), "models.actor.preset"),
    "preset_and_path": (lambda t: train("models.actor.path=/x"), "models.actor"),
    "unknown_gpu": (lambda t: train("cluster.gpu=tpu"), "cluster.gpu"),
    "plan_seconds_huge": (lambda t: train("plan.seconds=1e9"), "plan.seconds"),
    "plan_seconds_zero": (lambda t: train("plan.seconds=0"), "plan.seconds"),
    "manual_without_plan": (lambda t: train("plan.manual=null"), "plan.manual"),
    "manual_bad_layout": (lambda t: train("plan.manual.actor_gen.layout=dp3"), "plan.manual.actor_gen.layout"),
    "manual_mesh_outside": (lambda t: train("plan.manual.actor_gen.mesh=n0:g0-7"), "plan.manual.actor_gen.mesh"),
    "manual_unknown_call": (lambda t: train("plan.manual.nope.mesh=n0", "plan.manual.nope.layout=dp1tp1pp1"),
                            "plan.manual.nope"),
    "lr_huge": (lambda t: train("ppo.actor_lr=1e308"), "ppo.actor_lr"),
    "lr_negative": (lambda t: train("ppo.critic_lr=-1"), "ppo.critic_lr"),
    "kl_controller": (lambda t: train("ppo.kl_controller=pid"), "ppo.kl_controller"),
    "top_p_zero": (lambda t: train("sampling.top_p=0"), "sampling.top_p"),
    "temperature_negative": (lambda t: train("sampling.temperature=-1"), "sampling.temperature"),
    "on_nonfinite": (lambda t: train("run.on_nonfinite=ignore"), "run.on_nonfinite"),
    "max_restarts": (lambda t: train("run.max_restarts=-1"), "run.max_restarts"),
    "call_timeout": (lambda t: train("run.call_timeout_s=0"), "run.call_timeout_s"),
    "collective_timeout": (lambda t: train("run.collective_timeout_s=1e9"), "run.collective_timeout_s"),
    "reward_timeout": (lambda t: train("reward.timeout_s=0"), "reward.timeout_s"),
    "checkpoint_keep": (lambda t: train("checkpoint.keep=-1"), "checkpoint.keep"),
    "checkpoint_every": (lambda t: train("checkpoint.every=-2"), "checkpoint.every"),
    "gen_len_too_long": (lambda t: train("batch.gen_len=4096"), "batch.gen_len"),
    "grpo_with_kl_coef": (lambda t: train("algorithm=grpo", "ppo.kl_coef=0.1"), "ppo.kl_coef"),
    "minibatches_divide": (lambda t: train("batch.ppo_minibatches=3"), "batch.ppo_minibatches"),
    "more_prompts_than_data": (lambda t: train("batch.prompts=5000", "plan.mode=heuristic"), "batch.prompts"),
    "cluster_too_small": (lambda t: train("models.actor={preset: llama-70b}", "plan.mode=search"), "cluster="),
    # A reward model no call would load: the rule reward (the default) scores, or DPO has no reward call.
    "reward_model_beside_a_rule": (lambda t: train("models.reward.preset=tiny-critic"), "reward.function: null"),
    "reward_model_in_dpo": (lambda t: train("models.reward.preset=tiny-critic", config=str(EXAMPLES / "dpo-tiny.yaml")),
                            "unset for dpo"),
    "reward_model_under_env": (lambda t: train("models.reward.preset=tiny-critic",
                                               config=str(EXAMPLES / "grpo-tool-tiny.yaml")), "environments of rollout.env"),
    # ---- overrides and flags of train
    "override_no_key": (lambda t: train("=5"), "override"),
    "override_empty_part": (lambda t: train("run..name=x"), "override"),
    "override_through_a_value": (lambda t: train("batch.prompts.x=1"), "batch.prompts"),
    "override_without_equals": (lambda t: train("run.iterations"), "override='run.iterations'"),
    "unknown_flag": (lambda t: train("--fast"), "unrecognized arguments: --fast"),
    "iterations_zero": (lambda t: train("--iterations", "0"), "run.iterations"),
    "iterations_not_a_number": (lambda t: train("--iterations", "many"), "--iterations"),
    # ---- the run directory and resume
    "run_dir_is_a_file": (lambda t: train(f"run.dir={write(t / 'f.txt', 'x')}"), "run.dir"),
    "run_dir_holds_a_run": (run_dir_with_a_run, "already holds a run"),
    "resume_missing": (lambda t: train(f"run.dir={t / 'run'}", f"run.resume={t / 'nope'}"), "run.resume"),
    "resume_incomplete": (incomplete_checkpoint, "not a complete checkpoint"),
    "resume_not_a_checkpoint": (lambda t: train(f"run.dir={t / 'run'}", f"run.resume={write(t / 'x' / 'y', 'z').parent}"),
                                "run.resume"),
    # ---- datasets
    "data_missing": (lambda t: train(f"data.path={t / 'none.jsonl'}"), "data.path"),
    "data_bad_json": (lambda t: dataset(t, 'd.jsonl', '{"prompt": "1"}\n{oops\n'), "line 2"),
    "data_not_utf8": (lambda t: dataset(t, 'd.jsonl', b'{"prompt": "1"}\n{"prompt": "\xff"}\n'), "line 2: not UTF-8"),
    "data_no_prompt": (lambda t: dataset(t, 'd.jsonl', '{"q": "1"}\n'), "line 1"),
    "data_prompt_not_str": (lambda t: dataset(t, 'd.jsonl', '{"prompt": 5}\n'), "must be a string"),
    "data_empty": (lambda t: dataset(t, 'd.jsonl', ''), "empty dataset"),
    "data_csv": (lambda t: dataset(t, 'd.csv', 'prompt\n1\n'), "unknown dataset format"),
    "data_array_of_numbers": (lambda t: dataset(t, 'd.json', '[1, 2]'), "expected a JSON object"),
    "data_parquet_no_prompt": (lambda t: train(f"data.path={parquet_without_prompt(t / 'd.parquet')}"), "'prompt'"),
    "data_too_few": (lambda t: dataset(t, 'd.jsonl', '{"prompt": "12"}\n'), "batch.prompts"),
    "tokenizer_missing": (lambda t: train(f"data.tokenizer={t / 'tok'}"), "data.tokenizer"),
    "tokenizer_empty_dir": (lambda t: train(f"data.tokenizer={(t / 'tok').mkdir() or t / 'tok'}"), "no tokenizer files"),
    "tokenizer_is_a_file": (lambda t: train(f"data.tokenizer={write(t / 'tok.json', '{}')}"), "names a file"),
    # ---- model directories
    "model_dir_missing": (lambda t: train("models.actor.preset=null", f"models.actor.path={t / 'm'}"),
                          "models.actor.path"),
    "model_no_config": (lambda t: train("models.actor.preset=null", f"models.actor.path={(t / 'm').mkdir() or t / 'm'}"),
                        "models.actor.path"),
    "model_bad_config_json": (lambda t: train("models.actor.preset=null",
                                              f"models.actor.path={model_dir(t / 'm', bad_config_json)}"),
                              "models.actor.path"),
    "model_no_weights": (lambda t: train("models.actor.preset=null", f"models.actor.path={model_dir(t / 'm', no_weights)}"),
                         "no weights"),
    "model_truncated": (lambda t: train("models.actor.preset=null", f"models.actor.path={model_dir(t / 'm', truncated)}"),
                        "truncated"),
    "model_garbled_header": (lambda t: train("models.actor.preset=null",
                                             f"models.actor.path={model_dir(t / 'm', garbled)}"), "safetensors"),
    "model_missing_tensor": (lambda t: train("models.actor.preset=null",
                                             f"models.actor.path={model_dir(t / 'm', missing_tensor)}"),
                             "model.layers.1.mlp.up_proj.weight"),
    "model_wrong_shape": (lambda t: train("models.actor.preset=null", f"models.actor.path={model_dir(t / 'm', wrong_shape)}"),
                          "model.norm.weight"),
    "model_bin_only": (lambda t: train("models.actor.preset=null", f"models.actor.path={model_dir(t / 'm', bin_only)}"),
                       "convert them to safetensors"),
    "model_index_to_nothing": (lambda t: train("models.actor.preset=null",
                                               f"models.actor.path={model_dir(t / 'm', index_to_nothing)}"),
                               "do not exist"),
    "critic_truncated": (lambda t: train("models.critic.preset=null", f"models.critic.path={model_dir(t / 'm', truncated)}"),
                         "models.critic.path"),
    # ---- generate, score, profile flags
    "gen_max_new_tokens_zero": (lambda t: gen(t, "--max-new-tokens", "0"), "--max-new-tokens"),
    "gen_max_new_tokens_negative": (lambda t: gen(t, "--max-new-tokens", "-5"), "--max-new-tokens"),
    "gen_max_new_tokens_text": (lambda t: gen(t, "--max-new-tokens", "many"), "--max-new-tokens"),
    "gen_temperature": (lambda t: gen(t, "--temperature", "-1"), "--temperature"),
    "gen_temperature_nan": (lambda t: gen(t, "--temperature", "nan"), "--temperature"),
    "gen_top_p_zero": (lambda t: gen(t, "--top-p", "0"), "--top-p"),
    "gen_top_p_big": (lambda t: gen(t, "--top-p", "1.5"), "--top-p"),
    "gen_top_k": (lambda t: gen(t, "--top-k", "-1"), "--top-k"),
    "gen_batch_size": (lambda t: gen(t, "--batch-size", "0"), "--batch-size"),
    "gen_seed": (lambda t: gen(t, "--seed", "-3"), "--seed"),
    "gen_out_dir_missing": (lambda t: gen(t, "--out", str(t / "no" / "out.jsonl")), "--out"),
    "gen_out_is_dir": (lambda t: gen(t, "--out", str(t)), "--out"),
    "gen_data_missing": (lambda t: gen(t, "--data", str(t / "none.jsonl")), "--data"),
    "gen_model_no_config": (lambda t: gen(t, model=(t / "empty").mkdir() or t / "empty"), "--model"),
    "gen_model_no_weights": (lambda t: gen(t, model=model_dir(t / "m", no_weights)), "--model"),
    "gen_model_truncated": (lambda t: gen(t, model=model_dir(t / "m", truncated)), "truncated"),
    "gen_layout_garbage": (lambda t: gen(t, "--layout", "xyz"), "--layout"),
    "gen_layout_tp3": (lambda t: gen(t, "--layout", "tp3,pp1"), "tp=3"),
    "gen_data_no_prompt": (lambda t: gen(t, "--data", str(write(t / "d.jsonl", '{"text": "a"}\n'))), "line 1"),
    "score_batch_size": (lambda t: score(t, "--batch-size", "0"), "--batch-size"),
    "score_out_dir_missing": (lambda t: score(t, "--out", str(t / "no" / "o.jsonl")), "--out"),
    "score_model_wrong_shape": (lambda t: score(t, "--model", str(model_dir(t / "m", wrong_shape))), "model.norm.weight"),
    "profile_out_dir_missing": (lambda t: ["profile", "--out", str(t / "no" / "p.json")], "--out"),
    "unknown_command": (lambda t: ["fly"], "invalid choice"),
    "generate_without_model": (lambda t: ["generate", "--data", "x", "--out", "y"], "--model"),
    # ---- reward functions
    "reward_no_module": (lambda t: train("reward.function=no_such_module:f"), "reward.function"),
    "reward_no_function": (lambda t: train("reward.function=app.data.rewards:nope"), "reward.function"),
    "reward_not_callable": (lambda t: train("reward.function=app.data.rewards:math"), "not callable"),
    "reward_no_colon": (lambda t: train("reward.function=app.data.rewards"), "reward.function"),
    "reward_file_missing": (lambda t: train(f"reward.function={t / 'r.py'}:score"), "reward.function"),
    "reward_file_syntax_error": (lambda t: reward_file(t, "def score(:\n"), "reward.function"),
    "reward_file_raises": (lambda t: reward_file(t, "raise RuntimeError(1)\n"), "reward.function"),
}


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to Ray (and to worker processes) fails the test: bad input must stop before."""
    import ray

    import app.cli.generate
    import app.run.driver
    import app.run.jobs

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached Ray or a worker: the check should have stopped this input before")

    monkeypatch.setattr(ray, "init", reached)
    monkeypatch.setattr(app.run.driver, "connect_cluster", reached)
    monkeypatch.setattr(app.run.jobs, "connect", reached)
    monkeypatch.setattr(app.cli.generate, "run_layout", reached)


def test_there_are_at_least_sixty_cases() -> None:
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], no_ray: None) -> None:
    monkeypatch.chdir(tmp_path)  # a default run directory (runs/...) lands here, never in the repo
    build, expected = CASES[case]
    argv = build(tmp_path)
    status = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, f"{case}: status {status}; stderr {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error:"), f"{case}: {err[-2000:]}"
    assert expected in lines[0], f"{case}: {expected!r} not in {lines[0]!r}"
    assert "Traceback" not in out + err
