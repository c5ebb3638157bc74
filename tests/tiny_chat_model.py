"""Tiny chat models built offline, shaped like the real ones a first run uses (Qwen2.5-Instruct,
Llama): an HF directory with random weights (`save_pretrained`) and a real byte-level BPE
tokenizer with a Qwen-style `<|im_start|>` chat template.

The tokenizer is trained with the `tokenizers` library on the shipped GSM8K-format problems
(examples/data/gsm8k_tiny.jsonl) plus the instruction and the template's role words: a small
vocabulary (`VOCAB_SIZE`) that still holds every byte, so any text round-trips, and merges that
make digits and common words single tokens, as a real tokenizer does. Special tokens as in Qwen2.5:
`<|endoftext|>` (padding), `<|im_start|>`, `<|im_end|>` (end of a turn: eos, generation stops there).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GSM8K_TINY = REPO_ROOT / "examples" / "data" / "gsm8k_tiny.jsonl"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5's chat template, cut to what a prompt needs: a default system turn, the turns, and the
# assistant header when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_texts() -> list[str]:
    """The shipped problems, the GSM8K instruction and the template's words."""
    from app.data import GSM8K_INSTRUCTION

    rows = [json.loads(line) for line in GSM8K_TINY.read_text().splitlines() if line.strip()]
    texts = [f"{r['question']}\n{r['answer']}" for r in rows]
    return [*texts, GSM8K_INSTRUCTION, "system\nYou are a helpful assistant.\nuser\nassistant\n"]


def train_byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: tuple[str, ...]) -> object:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (every byte in its alphabet, so
    any text round-trips), not yet wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    return backend


def build_tokenizer(directory: Path) -> object:
    """Train the byte-level BPE tokenizer, wrap it for transformers, save it in `directory`."""
    from transformers import PreTrainedTokenizerFast

    backend = train_byte_level_bpe(training_texts(), VOCAB_SIZE, SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_tiny_chat_model(directory: Path, family: str = "qwen2", seed: int = 0) -> Path:
    """A random 2-layer `family` ("qwen2": qkv bias, tied embeddings like Qwen2.5-0.5B; "llama")
    model and the BPE chat tokenizer, saved in `directory` like any HF checkpoint."""
    import torch
    import transformers

    tokenizer = build_tokenizer(directory)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    shape = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    if family == "qwen2":
        config = transformers.Qwen2Config(**shape, bos_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(**shape, bos_token_id=None, tie_word_embeddings=False)
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"family={family!r}: allowed: qwen2, llama")
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(directory)
    return directory


__all__ = [
    "CHAT_TEMPLATE", "GSM8K_TINY", "SPECIAL_TOKENS", "VOCAB_SIZE", "build_tiny_chat_model", "build_tokenizer",
    "train_byte_level_bpe",
]
