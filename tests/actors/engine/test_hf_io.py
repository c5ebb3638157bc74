"""HF checkpoint I/O (actors.engine.hf_io): save_pretrained -> load -> export -> from_pretrained round
trips, tp-sharded and pipeline-stage loading, gathering shards, critic heads, error messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from actors.engine.hf_io import export_hf_checkpoint, gather_tp_shards, load_hf_checkpoint, merge_stage_states
from actors.engine.model import Transformer
from actors.engine.packing import pack_sequences
from planning.models import ModelSpec, tp_split_dim

torch.set_num_threads(1)

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
LLAMA3 = dict(tie_word_embeddings=True, rope_theta=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16})


def save_hf(tmp: Path, prefix: str = "Llama", head: str = "ForCausalLM", max_shard_size: str = "5GB",
            **overrides: Any) -> Path:
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **overrides})
    if head == "ForSequenceClassification":
        config.num_labels = 1
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}{head}")(config).float()
    out = tmp / f"{prefix}{head}"
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def load_ours(path: Path, critic: bool = False, **kwargs: Any) -> tuple[Transformer, list[str]]:
    spec = ModelSpec.from_hf_config(path)
    model = Transformer(spec, critic=critic, device="meta")
    model.to_empty(device="cpu")
    initialised = load_hf_checkpoint(path, spec, critic, model, **kwargs)
    return model.eval(), initialised


def sample_batch(vocab: int) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (6, 3, 9)]
    tokens, batch = pack_sequences(seqs)
    return tokens, batch, seqs


def hf_logits(model: transformers.PreTrainedModel, seqs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in seqs])


@pytest.mark.unit
@pytest.mark.parametrize("prefix,overrides", [("Llama", {}), ("Llama", LLAMA3), ("Qwen2", {}),
                                              ("Mistral", dict(sliding_window=4))])
def test_round_trip_through_transformers(tmp_path: Path, prefix: str, overrides: dict[str, Any]) -> None:
    src = save_hf(tmp_path, prefix, **overrides)
    ours, initialised = load_ours(src)
    assert initialised == []
    tokens, batch, seqs = sample_batch(BASE["vocab_size"])
    with torch.no_grad():
        logits = ours(tokens, batch)
    original = transformers.AutoModelForCausalLM.from_pretrained(src).float().eval()
    torch.testing.assert_close(logits, hf_logits(original, seqs), rtol=1e-5, atol=1e-5)
    out = export_hf_checkpoint(ours.state_dict(), ours.spec, False, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(reloaded) is type(original)
    assert reloaded.config.tie_word_embeddings == original.config.tie_word_embeddings
    torch.testing.assert_close(hf_logits(reloaded, seqs), logits, rtol=1e-5, atol=1e-5)
    assert ModelSpec.from_hf_config(out, name=ours.spec.name) == ours.spec


@pytest.mark.unit
def test_sharded_checkpoint_in_and_out(tmp_path: Path) -> None:
    src = save_hf(tmp_path, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    ours, _ = load_ours(src)
    out = export_hf_checkpoint(ours.state_dict(), ours.spec, False, tmp_path / "export", max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens, batch, seqs = sample_batch(BASE["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, seqs), ours(tokens, batch), rtol=1e-5, atol=1e-5)


def shard_module(model: Transformer, tp_size: int) -> Transformer:
    """Give `model` the local parameter shapes a tp rank holds (what tensor parallelism makes)."""
    for name, param in list(model.named_parameters()):
        dim = tp_split_dim(name, model.spec, tp_size)
        if dim is None:
            continue
        shape = list(param.shape)
        shape[dim] //= tp_size
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(owner, name.rsplit(".", 1)[1], torch.nn.Parameter(torch.empty(shape)))
    return model


@pytest.mark.unit
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp_shards_are_slices_of_full_tensors(tmp_path: Path, kv_heads: int) -> None:
    src = save_hf(tmp_path, "Qwen2", num_key_value_heads=kv_heads)
    full = load_file(src / "model.safetensors")
    spec = ModelSpec.from_hf_config(src)
    shards = []
    for rank in range(2):
        module = shard_module(Transformer(spec), 2)
        load_hf_checkpoint(src, spec, False, module, tp_rank=rank, tp_size=2)
        shards.append({k: v.detach() for k, v in module.state_dict().items()})
    for name, tensor in shards[1].items():
        dim = tp_split_dim(name, spec, 2)
        if dim is None:
            torch.testing.assert_close(tensor, full[name], rtol=0, atol=0)
        else:
            expected = full[name].chunk(2, dim=dim)[1]
            assert tensor.shape[dim] * 2 == full[name].shape[dim]
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
    k_name = "model.layers.0.self_attn.k_proj.weight"
    assert (tp_split_dim(k_name, spec, 2) is None) == (kv_heads == 1)
    gathered = gather_tp_shards(shards, spec, 2)
    assert set(gathered) == set(shards[0])
    for name, tensor in gathered.items():
        torch.testing.assert_close(tensor, full[name], rtol=0, atol=0)


@pytest.mark.unit
def test_pipeline_stage_reads_only_its_layers(tmp_path: Path) -> None:
    src = save_hf(tmp_path, num_hidden_layers=3)
    full = load_file(src / "model.safetensors")
    stage_only = {k: v for k, v in full.items() if not k.startswith(("model.layers.0.", "model.embed_tokens"))}
    save_file(stage_only, src / "model.safetensors", metadata={"format": "pt"})
    spec = ModelSpec.from_hf_config(src)
    stage = Transformer(spec)
    stage.keep_layers(1, 3, first=False, last=True)
    load_hf_checkpoint(src, spec, False, stage)
    assert set(stage.state_dict()) == set(stage_only)
    first = Transformer(spec)
    first.keep_layers(0, 1, first=True, last=False)
    merged = merge_stage_states([{k: v for k, v in full.items() if k in first.state_dict()}, stage.state_dict()])
    assert set(merged) == set(full)


@pytest.mark.unit
def test_critic_from_sequence_classification_and_export(tmp_path: Path) -> None:
    src = save_hf(tmp_path, head="ForSequenceClassification")
    critic, initialised = load_ours(src, critic=True)
    assert initialised == []
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(src).float().eval()
    tokens, batch, seqs = sample_batch(BASE["vocab_size"])
    with torch.no_grad():
        values = critic(tokens, batch)
        pooled = torch.stack([hf(s[None]).logits[0, 0] for s in seqs])
    torch.testing.assert_close(values[batch.last_token_indices()], pooled, rtol=1e-5, atol=1e-5)
    out = export_hf_checkpoint(critic.state_dict(), critic.spec, True, tmp_path / "export")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).float().eval()
    with torch.no_grad():
        repooled = torch.stack([reloaded(s[None]).logits[0, 0] for s in seqs])
    torch.testing.assert_close(repooled, pooled, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_critic_from_causal_lm_initialises_or_reads_value_head(tmp_path: Path) -> None:
    src = save_hf(tmp_path)
    critic, initialised = load_ours(src, critic=True)
    assert initialised == ["score.weight"] and critic.score.weight.eq(0).all()
    normal, _ = load_ours(src, critic=True, score_init="normal")
    assert 0.05 < normal.score.weight.std().item() < 0.3
    head = torch.arange(32, dtype=torch.float32)[None] / 100
    save_file({"score.weight": head}, src / "value_head.safetensors")
    with_head, initialised = load_ours(src, critic=True)
    assert initialised == []
    torch.testing.assert_close(with_head.score.weight.detach(), head, rtol=0, atol=0)


@pytest.mark.unit
def test_errors_name_the_tensor_or_field(tmp_path: Path) -> None:
    src = save_hf(tmp_path)
    spec = ModelSpec.from_hf_config(src)
    tensors = load_file(src / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' missing"):
        load_hf_checkpoint(src, spec, False, Transformer(spec))
    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(31)
    save_file(wrong, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[31\], expected \[32\]"):
        load_hf_checkpoint(src, spec, False, Transformer(spec))
    with pytest.raises(ValueError, match="does not divide vocab_size=95"):
        odd_vocab = ModelSpec("odd", "llama", 95, 32, 64, 2, 4, 2, 8)
        load_hf_checkpoint(src, odd_vocab, False, Transformer(odd_vocab), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="local shape"):
        load_hf_checkpoint(src, spec, False, Transformer(spec), tp_rank=1, tp_size=2)
    config = json.loads((src / "config.json").read_text())
    for field_name, value in (("mlp_bias", True), ("hidden_act", "gelu")):
        (src / "config.json").write_text(json.dumps({**config, field_name: value}))
        with pytest.raises(ValueError, match=f"{field_name}=.* unsupported"):
            load_hf_checkpoint(src, spec, False, Transformer(spec))
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2' unsupported"):
        load_hf_checkpoint(src, spec, False, Transformer(spec))
    with pytest.raises(ValueError, match="model_type 'gpt2': unsupported"):
        ModelSpec.from_hf_config(src)
    with pytest.raises(ValueError, match=r"'lm_head\.weight' missing"):
        state = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        export_hf_checkpoint(state, spec, False, tmp_path / "bad_export")
