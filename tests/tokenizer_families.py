"""A second tokenizer family, built offline, for models that do not share the actor's tokenizer.

`build_other_tokenizer`: a byte-level BPE tokenizer trained on another corpus than
tests/tiny_chat_model.py's (generated English sentences instead of GSM8K problems), with other
special tokens (`<s>`, `</s>`, `<pad>`, Llama-style) and a Llama-3-like chat template, so its ids
mean other strings than the Qwen-style one's; every byte is in its alphabet, so any text encodes.
`build_reward_model`: a tiny random `LlamaForSequenceClassification` (one label: a reward model)
saved with such a tokenizer (or none) like any HF checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.tiny_chat_model import train_byte_level_bpe

OTHER_VOCAB_SIZE = 320
OTHER_SPECIALS = ("<s>", "</s>", "<pad>")
WORDS = ("the", "a", "reward", "model", "reads", "text", "answer", "is", "good", "bad", "number", "question",
         "assistant", "user", "says", "because", "and", "then", "we", "count", "apples", "pears", "total")
# Llama-3-like, cut to what a reward model reads: a header per turn, an end-of-turn token.
OTHER_CHAT_TEMPLATE = (
    "{{- '<s>' }}"
    "{%- for message in messages %}"
    "{{- '[' + message['role'] + ']\\n' + message['content'] + '</s>' }}"
    "{%- endfor %}"
)


def other_corpus(n: int = 400, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + f" {rng.randint(0, 999)}."
            for _ in range(n)]


def build_other_tokenizer(directory: Path, chat_template: bool = True) -> object:
    """Train the second family's BPE tokenizer, wrap it for transformers, save it in `directory`."""
    from transformers import PreTrainedTokenizerFast

    backend = train_byte_level_bpe(other_corpus(), OTHER_VOCAB_SIZE, OTHER_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    if chat_template:
        tokenizer.chat_template = OTHER_CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_reward_model(directory: Path, vocab_size: int | None = None, tokenizer: bool = True,
                       chat_template: bool = True, seed: int = 0, max_positions: int = 512) -> Path:
    """A random 2-layer Llama reward model (score head of one label) in `directory`, with the
    second family's tokenizer (its vocabulary) or, tokenizer=False, weights only of `vocab_size`."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        tok = build_other_tokenizer(directory, chat_template)
        vocab_size = len(tok)  # type: ignore[arg-type]
    assert vocab_size is not None
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                                      pad_token_id=2, tie_word_embeddings=False, num_labels=1,
                                      initializer_range=0.2)
    torch.manual_seed(seed)
    transformers.LlamaForSequenceClassification(config).float().save_pretrained(directory)
    return directory


__all__ = ["OTHER_CHAT_TEMPLATE", "OTHER_SPECIALS", "OTHER_VOCAB_SIZE", "build_other_tokenizer",
           "build_reward_model", "other_corpus"]
