"""benchmarks/peer_bench.py in its CPU mode (--tiny): both systems get the same prompt ids, and
one call measures our GRPO (and TRL's GRPOTrainer where `trl` imports) and prints the table; a
second call with the same --out trains again in a run directory of its own."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.peer_bench import main, parse_also
from benchmarks.peer_setup import TINY, build_inputs, normal_through_float32_, random_llama
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)


@pytest.mark.unit
def test_both_systems_read_the_same_prompt_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from app.data import build_prompt_dataset, load_tokenizer

    inputs = build_inputs(tmp_path, tiny=True, n_prompts=6, prompt_len=12)
    hf = AutoTokenizer.from_pretrained(inputs.model_dir)
    assert len(hf) == inputs.spec.vocab_size and hf.eos_token_id == inputs.spec.eos_token_id
    ours = build_prompt_dataset(inputs.prompts, load_tokenizer(str(inputs.model_dir)), max_prompt_len=12)
    texts = [json.loads(line)["prompt"] for line in inputs.prompts.read_text().splitlines()]
    trl_ids = [hf(text, add_special_tokens=False)["input_ids"] for text in texts]  # how TRL encodes prompts
    assert [list(e.prompt_ids) for e in ours] == trl_ids
    assert all(len(ids) == 12 for ids in trl_ids)
    assert list(inputs.build_s) == ["imports", "tokenizer", "weights", "save", "prompts"]
    assert all(seconds >= 0.0 for seconds in inputs.build_s.values())


@pytest.mark.unit
def test_the_random_checkpoint_is_initialised_as_transformers_does_and_reloads_exactly(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in TINY.to_hf_config().items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, pad_token_id=2)
    model = random_llama(config, seed=0)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the 1B's head
    matrices = torch.cat([p.float().flatten() for p in params.values() if p.ndim == 2])
    assert abs(matrices.std().item() - config.initializer_range) < 0.05 * config.initializer_range
    assert all(torch.all(p == 1) for name, p in params.items() if p.ndim == 1)  # the norms' weights
    assert torch.all(model.model.embed_tokens.weight[2] == 0)  # the padding row, as nn.Embedding's init
    again, other = random_llama(config, seed=0), random_llama(config, seed=1)
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(params[up], dict(again.named_parameters())[up])
    assert not torch.equal(params[up], dict(other.named_parameters())[up])
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    ids = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()


@pytest.mark.unit
def test_the_float32_draw_fills_every_element_in_chunks_and_repeats_with_the_seed() -> None:
    import torch

    def draw(seed: int) -> torch.Tensor:
        param = torch.full((300, 7), float("nan"), dtype=torch.bfloat16)
        scratch = torch.empty(64)  # 2,100 elements: 32 full chunks and one of 52
        normal_through_float32_(param, 0.5, torch.Generator().manual_seed(seed), scratch)
        return param

    first = draw(3)
    assert first.dtype == torch.bfloat16 and not first.isnan().any()
    assert abs(first.float().std().item() - 0.5) < 0.05 and abs(first.float().mean().item()) < 0.05
    assert torch.equal(first, draw(3)) and not torch.equal(first, draw(4))
    rows = first.float().view(-1)[:2048].view(32, 64)  # the chunks differ: each drew its own numbers
    assert len({tuple(row.tolist()) for row in rows}) == 32


@pytest.mark.unit
def test_a_planted_eos_ends_responses_at_the_mean_length_asked(tmp_path: Path) -> None:
    """--mean-len 8: the saved checkpoint gives EOS probability ~1/8 at every position of any
    input (so both systems' responses end at geometric lengths), against ~1/V without it."""
    import torch
    from transformers import AutoModelForCausalLM

    probabilities = {}
    for mean_len in (None, 8.0):
        inputs = build_inputs(tmp_path / str(mean_len), tiny=True, n_prompts=2, prompt_len=8, mean_len=mean_len)
        model = AutoModelForCausalLM.from_pretrained(inputs.model_dir, dtype=torch.float32)
        ids = torch.randint(0, inputs.spec.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            eos = torch.softmax(model(ids).logits, dim=-1)[..., inputs.spec.eos_token_id]  # [4, 24]
        probabilities[mean_len] = eos
    assert probabilities[None].mean() < 3.0 / 384  # random weights: about 1 / vocabulary
    assert torch.allclose(probabilities[8.0], torch.full_like(probabilities[8.0], 1 / 8), rtol=0.05)


@pytest.mark.unit
@pytest.mark.parametrize("value", ["1", "0.5"])
def test_mean_len_of_one_or_less_exits(value: str) -> None:
    from benchmarks.peer_bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--mean-len", value])


@pytest.mark.ray
def test_tiny_mode_measures_ours_and_trl_where_installed(ray_session: None, tmp_path: Path,  # noqa: F811
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "run-001" / "peer_bench.json").read_text())
    by_name = {r["name"].split()[0]: r for r in summary["results"]}
    ours = by_name["realray"]
    assert ours["error"] is None and len(ours["step_s"]) == 1 and ours["step_s"][0] > 0
    assert ours["tokens"][0] > 0 and ours["tokens_per_s"] > 0
    # No KL term: the reference model is not run; the reward is scored from decoded text.
    assert list(ours["calls"]) == ["actor_gen", "rew_inf", "actor_train"]
    trl = by_name["TRL"]
    table = capsys.readouterr().out
    assert "realray GRPO" in table and "actor_train" in table
    # The step's time outside its calls, per timed step, and the collections before each call.
    assert len(ours["other_s"]) == 1 and ours["other_s"][0] == pytest.approx(
        ours["step_s"][0] - sum(ours["calls"].values()), abs=1e-6)
    assert set(ours["gc_before_s"]) == set(ours["calls"]) and all(v >= 0.0 for v in ours["gc_before_s"].values())
    assert "other (step minus its calls) per timed step" in table
    if importlib.util.find_spec("trl") is None:
        assert "not importable" in trl["error"]
        return
    assert trl["error"] is None and len(trl["step_s"]) == 1 and trl["tokens"][0] > 0
    ratio = ours["tokens_per_s"] / trl["tokens_per_s"]
    assert f"{ratio:,.2f}x" in table


@pytest.mark.ray
def test_tiny_mode_runs_twice_with_the_same_out(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    # Once `run.dir ... already holds a run`: the second call met the first one's training directory.
    for _ in range(2):
        assert main(["--tiny", "--out", str(tmp_path), "--skip-trl"]) == 0
    first, second = (json.loads((tmp_path / run / "peer_bench.json").read_text()) for run in ("run-001", "run-002"))
    for summary in (first, second):
        (ours,) = summary["results"]
        assert ours["error"] is None and len(ours["step_s"]) == 1
    assert (tmp_path / "run-001" / "realray-run" / "metrics.jsonl").is_file()
    assert (tmp_path / "run-002" / "realray-run" / "metrics.jsonl").is_file()
    assert (tmp_path / "latest").resolve() == (tmp_path / "run-002").resolve()


@pytest.mark.unit
def test_also_rows_parse_and_bad_ones_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_also("fp8:sampling.fp8=true, sampling.kv_cache_dtype=fp8") == (
        "fp8", ["sampling.fp8=true", "sampling.kv_cache_dtype=fp8"])
    for bad in ("sampling.fp8=true", "fp8:", "fp8:sampling.fp8", "a b:x=1"):
        with pytest.raises(SystemExit):
            main(["--tiny", "--also", bad])
        assert "--also" in capsys.readouterr().err


@pytest.mark.ray
def test_an_also_row_runs_ours_again_with_its_overrides(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    assert main(["--tiny", "--out", str(tmp_path), "--skip-trl", "--also", "fp8:sampling.fp8=true"]) == 0
    summary = json.loads((tmp_path / "run-001" / "peer_bench.json").read_text())
    bf16, fp8 = summary["results"]
    assert (bf16["name"], fp8["name"]) == ("realray GRPO", "realray GRPO (fp8)")
    assert bf16["error"] is None and fp8["error"] is None and len(fp8["step_s"]) == 1
    assert "fp8=False" in bf16["settings"] and "fp8=True" in fp8["settings"]
    assert "actor/rollout_is_mean" in fp8["settings"]  # the importance weights FP8 turned on
    assert (tmp_path / "run-001" / "realray-fp8-run" / "metrics.jsonl").is_file()
    assert "realray GRPO (fp8)" in (tmp_path / "run-001" / "peer_bench.txt").read_text()
