"""Generation under tensor and pipeline parallelism (2 gloo processes): greedy output equal to
transformers' generate token for token, sampled output equal to the single-process engine
(sampling is layout-invariant), on tiny random Llama (tied embeddings) and Qwen2 (one KV head:
K/V replicated under tp=2) checkpoints loaded with actors/hf_io."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from actors.engine.model import Transformer
from actors.generation.decoding import GenerationConfig, GenerationOutput
from actors.generation.loop import generate
from actors.generation.sampling import SamplingParams
from planning.layout import Layout
from planning.models import ModelSpec
from tests.dist_harness import run_distributed

torch.set_num_threads(1)

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
FAMILIES: dict[str, dict[str, Any]] = {
    "Llama": {"tie_word_embeddings": True},
    "Qwen2": {"rope_theta": 1e6, "num_key_value_heads": 1},
}
PROMPT_LENGTHS = [5, 9, 1, 6, 3]
MAX_NEW = 7
COMPACTED_NEW = 40
SAMPLED = SamplingParams(temperature=1.0, top_k=12, top_p=0.9)
# (layout, pipeline micro-batches): pp with as many micro-batches as stages, and with more.
LAYOUTS = [("tp2", None), ("pp2", None), ("pp2", 3)]


def save_hf(root: Path, family: str) -> tuple[Path, transformers.PreTrainedModel]:
    config = getattr(transformers, f"{family}Config")(**{**BASE, **FAMILIES[family]})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    path = root / family
    model.save_pretrained(path)
    return path, model


def prompts_for(vocab: int) -> list[torch.Tensor]:
    """The prompts, the second one twice as one tensor (two samples of it: a shared prefill)."""
    gen = torch.Generator().manual_seed(4)
    distinct = [torch.randint(3, vocab, (n,), generator=gen) for n in PROMPT_LENGTHS]
    return distinct[:2] + distinct[1:]


def configs(eos: int) -> dict[str, GenerationConfig]:
    return {
        "greedy": GenerationConfig(MAX_NEW, SamplingParams(temperature=0.0), eos_token_id=eos),
        "sampled": GenerationConfig(MAX_NEW, SAMPLED, seed=5, eos_token_id=eos),
        # Long enough for every loop to drop finished rows (actors.generation.compaction; the
        # pipelined one per micro-batch), which must sample the same as keeping them.
        "compacted": GenerationConfig(COMPACTED_NEW, SamplingParams(temperature=1.0), seed=3, eos_token_id=eos,
                                      compact_fraction=0.9),
    }


def fp8_configs(eos: int) -> dict[str, GenerationConfig]:
    """FP8 decode weights; an e4m3 KV cache."""
    greedy = SamplingParams(temperature=0.0)
    return {"fp8": GenerationConfig(MAX_NEW, greedy, eos_token_id=eos, fp8_weights=True),
            "fp8kv": GenerationConfig(MAX_NEW, greedy, eos_token_id=eos, kv_cache_dtype="fp8")}


def summary(out: GenerationOutput) -> dict[str, Any]:
    # Plain lists: tensors sent back through a multiprocessing queue need the worker alive.
    return {"responses": [r.tolist() for r in out.responses()], "logprobs": out.logprobs.tolist(),
            "no_eos": out.no_eos.tolist(), "kept": None if out.kept_counts is None else out.kept_counts.tolist(),
            "compactions": out.stats.get("compactions", 0.0)}


def load_rank_shard(path: str, spec: ModelSpec, layout: Layout) -> tuple[Any, Any]:
    """(process groups, this rank's float32 shard of the checkpoint at `path` in eval mode)."""
    from actors.engine.hf_io import load_hf_checkpoint
    from actors.engine.parallelize import build_model_shard
    from actors.engine.process_groups import build_parallel_groups

    groups = build_parallel_groups(layout)
    coords = (groups.dp_rank, groups.tp_rank, groups.pp_rank)
    model = build_model_shard(spec, False, layout, coords, groups, "cpu", torch.float32, seed=None)
    load_hf_checkpoint(path, spec, False, model, groups.tp_rank, layout.tp)
    return groups, model.eval()


def generate_under_layouts(rank: int, world_size: int, cases: list[tuple[str, str, int]]) -> dict[str, Any]:
    """Worker: every (family, layout, micro-batches, config) result, keyed by a readable name."""
    from actors.engine.process_groups import destroy_parallel_groups

    results: dict[str, Any] = {}
    for family, path, eos in cases:
        spec = ModelSpec.from_hf_config(path)
        prompts = prompts_for(spec.vocab_size)
        for layout_text, micro_batches in LAYOUTS:
            layout = Layout.parse(layout_text)
            groups, model = load_rank_shard(path, spec, layout)
            for name, config in configs(eos).items():
                config = GenerationConfig(**{**config.__dict__, "pp_micro_batches": micro_batches})
                out = generate(model, prompts, config, groups)
                results[f"{family}/{layout_text}/{micro_batches}/{name}"] = summary(out)
                if layout.tp > 1 and name == "sampled":
                    results[f"{family}/train-side"] = train_side_logprobs(model, out, groups.tp_group)
            # FP8 decode weights (actors.generation.fp8_weights): under tp each shard quantizes its
            # own rows; under pp each stage its own layers, the last one the head.
            for name, config in fp8_configs(eos).items():
                config = GenerationConfig(**{**config.__dict__, "pp_micro_batches": micro_batches})
                results[f"{family}/{name}/{layout_text}/{micro_batches}"] = summary(generate(model, prompts, config,
                                                                                              groups))
            destroy_parallel_groups(groups)
    return results


def train_side_logprobs(model: Transformer, out: GenerationOutput, tp_group: Any) -> list[float]:
    """Response logprobs as training computes them under tp: vocab-parallel logits, the sampling
    mask from kept counts (actors.generation.sampling.allowed_tokens), actors.engine.logprobs."""
    from actors.engine.logprobs import vocab_parallel_logprobs
    from actors.generation.sampling import allowed_tokens
    from tests.actors.generation.test_generate import response_rows

    rows = response_rows(out)
    with torch.no_grad():
        logits = model(out.tokens, out.packed_batch())[rows]  # [R, V/tp]
    allowed = allowed_tokens(logits, out.sampling, out.kept_counts, tp_group)
    logprobs = vocab_parallel_logprobs(logits, out.tokens[rows + 1], tp_group, out.sampling.temperature, allowed)
    return logprobs.tolist()


def assert_close_decode(got: dict[str, Any], ref: dict[str, Any], max_gap: float = 0.4,
                        mean_gap: float = 0.1) -> None:
    """Two greedy summaries with the same prefill (same first token and logprob) whose responses
    mostly agree and whose decode logprobs, over each response's tokens up to where the two first
    part, are a little apart (FP8's few percent of these tiny models' large logits)."""
    got_lp, ref_lp = torch.tensor(got["logprobs"]), torch.tensor(ref["logprobs"])
    got_at = ref_at = 0
    gaps = []
    for got_ids, ref_ids in zip(got["responses"], ref["responses"]):
        assert got_ids[0] == ref_ids[0]
        assert abs(got_lp[got_at] - ref_lp[ref_at]) < 1e-5
        same = next((i for i, (a, b) in enumerate(zip(got_ids, ref_ids)) if a != b), min(len(got_ids), len(ref_ids)))
        gaps += (got_lp[got_at: got_at + same] - ref_lp[ref_at: ref_at + same]).abs().tolist()
        got_at, ref_at = got_at + len(got_ids), ref_at + len(ref_ids)
    # Most tokens agree (a shard's MLP left unreduced parts at the second token), and where they
    # do, their logprobs are close.
    assert len(gaps) >= 0.6 * min(len(got_lp), len(ref_lp)), (len(gaps), len(got_lp))
    assert max(gaps) < max_gap and sum(gaps) / len(gaps) < mean_gap, gaps


def hf_greedy(hf: transformers.PreTrainedModel, prompt: torch.Tensor, eos: int | None) -> list[int]:
    out = hf.generate(prompt[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long))
    return out[0, prompt.numel():].tolist()


def serial_model(path: Path) -> Transformer:
    from actors.engine.hf_io import load_hf_checkpoint

    spec = ModelSpec.from_hf_config(path)
    model = Transformer(spec, device="meta")
    model.to_empty(device="cpu")
    load_hf_checkpoint(path, spec, False, model)
    return model.eval()


@pytest.mark.dist
def test_generation_under_tp2_and_pp2_matches_transformers_and_serial(tmp_path: Path) -> None:
    cases, references = [], {}
    for family in FAMILIES:
        path, hf = save_hf(tmp_path, family)
        prompts = prompts_for(BASE["vocab_size"])
        # An EOS that sequence 0 emits at its 3rd greedy step, so stopping mid-way is covered.
        eos = hf_greedy(hf, prompts[0], None)[2]
        cases.append((family, str(path), eos))
        serial = serial_model(path)
        references[family] = {
            "hf_greedy": [hf_greedy(hf, p, eos) for p in prompts],
            "serial": {name: summary(generate(serial, prompts, cfg)) for name, cfg in configs(eos).items()},
            **{name: summary(generate(serial, prompts, cfg)) for name, cfg in fp8_configs(eos).items()},
        }
    per_rank = run_distributed(generate_under_layouts, 2, cases)
    assert per_rank[0].keys() == per_rank[1].keys()
    for family in FAMILIES:
        for rank_result in per_rank:
            train_side = torch.tensor(rank_result.pop(f"{family}/train-side"))
            sampled = torch.tensor(references[family]["serial"]["sampled"]["logprobs"])
            assert torch.allclose(train_side, sampled, atol=1e-4), family
            # FP8 weights under tp2: each shard quantizes its own rows and activations, so it is
            # close to, not equal to, the serial FP8 run (and to tp2's bf16 run). Under pp the
            # stages quantize what the serial run does, micro-batched or not. An e4m3 cache has
            # no scale: every layout rounds the same K/V as the serial run.
            for layout_text, micro_batches in LAYOUTS:
                fp8 = rank_result.pop(f"{family}/fp8/{layout_text}/{micro_batches}")
                assert_close_decode(fp8, references[family]["fp8"])
                assert_close_decode(fp8, rank_result[f"{family}/{layout_text}/{micro_batches}/greedy"])
                fp8kv = rank_result.pop(f"{family}/fp8kv/{layout_text}/{micro_batches}")
                assert fp8kv["responses"] == references[family]["fp8kv"]["responses"], layout_text
                assert_close_decode(fp8kv, references[family]["fp8kv"], 1e-3, 1e-4)
    for key, result in per_rank[0].items():
        family, _, _, name = key.split("/")
        ref = references[family]
        for rank_result in per_rank:  # every rank returns the same output
            assert rank_result[key]["responses"] == result["responses"], key
        if name == "greedy":
            assert result["responses"] == ref["hf_greedy"], key
            assert result["responses"][0][-1] == cases[list(FAMILIES).index(family)][2]
        serial = ref["serial"][name]
        assert result["responses"] == serial["responses"], key
        assert result["no_eos"] == serial["no_eos"], key
        assert torch.allclose(torch.tensor(result["logprobs"]), torch.tensor(serial["logprobs"]), atol=1e-4), key
        assert result["kept"] == serial["kept"], key
        if name == "compacted":  # the equalities above held with rows dropped mid-call (pp too)
            assert result["compactions"] >= 2 and serial["compactions"] >= 2, (key, result["compactions"])


@pytest.mark.dist
def test_cli_generate_with_tp2_pp2_dp2_layouts(tmp_path: Path) -> None:
    from app.cli import main
    from tests.actors.generation.test_generate import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "w{i} w{i + 7} w{i + 30}"}}\n' for i in range(3, 8)))
    outputs = {}
    for layout in ("tp1", "tp2", "pp2", "dp2"):
        out = tmp_path / f"{layout}.jsonl"
        argv = ["generate", "--model", str(path), "--data", str(data), "--out", str(out), "--max-new-tokens", "6",
                "--temperature", "0.9", "--top-k", "20", "--seed", "1", "--layout", layout, "--device", "cpu", "--local"]
        assert main(argv) == 0
        outputs[layout] = [json.loads(line) for line in out.read_text().splitlines()]
    single = outputs["tp1"]
    assert len(single) == 5
    for layout in ("tp2", "pp2"):
        assert [r["response_tokens"] for r in outputs[layout]] == [r["response_tokens"] for r in single], layout
        assert all(torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4)
                   for a, b in zip(outputs[layout], single)), layout
    # dp2 splits the prompts over two replicas (other batches, other per-step uniforms): same
    # prompts and order, responses of the requested length or ending in EOS.
    assert [r["prompt"] for r in outputs["dp2"]] == [r["prompt"] for r in single]
    assert all(len(r["response_tokens"]) == 6 or r["response_tokens"][-1] == 2 for r in outputs["dp2"])


def generate_tp2pp2(rank: int, world_size: int, path: str, eos: int) -> dict[str, Any]:
    """Worker (4 ranks): the sampled and compacted configs under tp2pp2, 3 micro-batches."""
    from actors.engine.process_groups import destroy_parallel_groups

    spec = ModelSpec.from_hf_config(path)
    groups, model = load_rank_shard(path, spec, Layout.parse("tp2pp2"))
    results = {}
    for name in ("sampled", "compacted"):
        config = GenerationConfig(**{**configs(eos)[name].__dict__, "pp_micro_batches": 3})
        results[name] = summary(generate(model, prompts_for(spec.vocab_size), config, groups))
    destroy_parallel_groups(groups)
    return results


@pytest.mark.dist
def test_tp2pp2_generation_with_compaction_matches_serial(tmp_path: Path) -> None:
    """tp and pp together (4 gloo processes): each pipeline column samples on its last stage's tp
    rank 0 and drops the same rows per micro-batch, so every rank returns the serial run's output."""
    path, hf = save_hf(tmp_path, "Llama")
    prompts = prompts_for(BASE["vocab_size"])
    eos = hf_greedy(hf, prompts[0], None)[2]
    serial = serial_model(path)
    per_rank = run_distributed(generate_tp2pp2, 4, str(path), eos)
    for name in ("sampled", "compacted"):
        ref = summary(generate(serial, prompts, configs(eos)[name]))
        for result in (rank_result[name] for rank_result in per_rank):
            assert result["responses"] == ref["responses"] and result["no_eos"] == ref["no_eos"], name
            torch.testing.assert_close(torch.tensor(result["logprobs"]), torch.tensor(ref["logprobs"]), atol=1e-4,
                                       rtol=0)
    assert all(rank_result["compacted"]["compactions"] >= 2 for rank_result in per_rank)
