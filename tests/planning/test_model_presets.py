"""Model presets against the published configs they stand for: the spec read from the HF
config.json equals the preset, and its parameter count equals transformers' model (built on the
meta device: no memory, no download)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planning.models import ModelSpec, model_preset

pytestmark = pytest.mark.unit

# config.json of meta-llama/Llama-3.2-3B (the fields the spec reads).
LLAMA_3_2_3B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_llama_3_2_3b_preset_is_the_published_config() -> None:
    preset = model_preset("llama3.2-3b")
    assert ModelSpec.from_hf_config(LLAMA_3_2_3B, name="llama3.2-3b") == preset
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_3_2_3B.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    hf_params = sum(p.numel() for p in model.parameters())  # the tied head is counted once
    assert preset.n_params() == hf_params == 3_212_749_824
    # The 1B preset differs only in its sizes: same family, rope and token ids.
    small = model_preset("llama3.2-1b")
    assert replace(preset, name=small.name, hidden_size=2048, n_layers=16, n_heads=32, head_dim=64) == small
