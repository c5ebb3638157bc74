"""The shared inputs of benchmarks/peer_bench.py, built offline: one HF model directory (random
Llama weights, config, a byte-level BPE tokenizer) and one prompt file, read by both systems.

The tokenizer is a real `tokenizers` byte-level BPE whose vocabulary is exactly the model's
(128,256 for the Llama-3.2-1B shape, so the model keeps its true embedding and head sizes):
the 256 byte symbols, then merges of symbol pairs and of a pair and a symbol in a fixed order
(no corpus is needed: with random weights every token is as likely as any other), then the
special tokens (bos, eos, pad, reserved) on the highest ids. It has no post-processor, so
encoding adds no specials whether a caller asks for them (our datasets) or not (TRL): both
systems get the same prompt ids. Prompts are words of random letters, cut to exactly
`prompt_len` tokens.

    python3 benchmarks/peer_setup.py OUT_DIR [--tiny]     # writes OUT_DIR/model and OUT_DIR/prompts.jsonl

--mean-len N plants the tokenizer's EOS in the weights (benchmarks/planted_eos.py): every sampled
token is EOS with probability about 1/N, so responses end at geometric lengths of mean about N
(cut at the budget), as on a task whose answers end; both systems stop at it.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planning.models import MODEL_PRESETS, ModelSpec

LLAMA_1B = MODEL_PRESETS["llama3.2-1b"]
# The 1B's features (tied embedding, Llama 3 rope scaling) at a size that runs in seconds on CPU.
TINY = ModelSpec("peer-tiny", "llama", vocab_size=384, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=16, tie_embeddings=True, rope_theta=LLAMA_1B.rope_theta,
                 rope_scaling=LLAMA_1B.rope_scaling, max_position_embeddings=8192)
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
# Symbols whose merges come first, so that prompt words (space + lowercase letters) are merged.
COMMON = "Ġ" + string.ascii_lowercase
# float32 elements drawn at a time by normal_through_float32_ (64 MiB).
NORMAL_CHUNK = 1 << 24


@dataclass(frozen=True)
class PeerInputs:
    """What both systems read: the model directory (weights, config, tokenizer) and the prompts."""

    model_dir: Path
    prompts: Path
    spec: ModelSpec
    prompt_len: int
    build_s: dict[str, float] = field(default_factory=dict)  # seconds per part of the build, in order


def lap(times: dict[str, float], part: str, since: float) -> float:
    """Record the seconds since `since` under `part`; returns now."""
    now = time.perf_counter()
    times[part] = now - since
    return now


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompts, --group, --prompt-len, --gen-len: one step's rows, the peer bench's by default."""
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=512)


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Exit through `parser.error`, naming the option and its value, where one of `names` is < 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")


def n_specials(vocab_size: int) -> int:
    """Special tokens on top of the vocabulary: Llama 3's 256 when it is that large, else 8."""
    return 256 if vocab_size >= 128_256 else 8


def merge_list(n_merges: int) -> list[tuple[str, str]]:
    """`n_merges` BPE merges in priority order: symbol pairs (common symbols first), then a pair
    and a symbol. Every merge joins two tokens that exist before it."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = list(COMMON) + [c for c in alphabet if c not in COMMON]
    merges = [(a, b) for a in symbols for b in symbols][:n_merges]
    if len(merges) < n_merges:
        pairs = [a + b for a, b in merges]
        merges += [(ab, c) for ab in pairs for c in symbols][:n_merges - len(merges)]
    if len(merges) < n_merges:
        raise ValueError(f"n_merges={n_merges}: at most {len(symbols) ** 2 * (1 + len(symbols))} merges are defined")
    return merges


def byte_level_bpe(vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens, the specials on top."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = list(SPECIALS) + [f"<|reserved_special_token_{i}|>" for i in range(n_specials(vocab_size) - 3)]
    regular = vocab_size - len(specials)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = merge_list(regular - len(alphabet))
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(f"built {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


def save_model_dir(out: Path, spec: ModelSpec, seed: int, mean_len: float | None,
                   times: dict[str, float]) -> ModelSpec:
    """A random-weight HF checkpoint of `spec` (bf16 safetensors) with its tokenizer; returns the
    spec with the tokenizer's bos/eos ids. mean_len: plant the EOS (module docstring). times:
    filled with the seconds of each part (imports, tokenizer, weights, save)."""
    start = time.perf_counter()
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from benchmarks.planted_eos import plant_eos

    start = lap(times, "imports", start)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(spec.vocab_size), bos_token=SPECIALS[0],
                                        eos_token=SPECIALS[1], pad_token=SPECIALS[2])
    spec = replace(spec, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    fields = {k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, pad_token_id=tokenizer.pad_token_id)
    start = lap(times, "tokenizer", start)
    model = random_llama(config, seed)
    if mean_len is not None:
        plant_eos(model, tokenizer.eos_token_id, mean_len)
    start = lap(times, "weights", start)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    lap(times, "save", start)
    return spec


def random_llama(config: Any, seed: int) -> Any:  # LlamaConfig -> LlamaForCausalLM
    """A LlamaForCausalLM of `config` with random bf16 weights drawn as transformers initialises
    a Llama (every matrix N(0, initializer_range), the padding token's embedding row 0, norm
    weights 1, biases 0), each matrix drawn once from a generator seeded with `seed` (in float32
    chunks, cast to bf16: normal_through_float32_). Built on the meta device first:
    transformers' own construction draws every weight twice in float32 (the layers' default
    init, then its own). Non-persistent buffers (the rotary frequencies) are left unset: the
    model is for saving, and loading recomputes them."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty gave each its own tensor
    generator = torch.Generator().manual_seed(seed)
    scratch = torch.empty(NORMAL_CHUNK)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head once, as the embedding
            if param.ndim == 2:
                normal_through_float32_(param, config.initializer_range, generator, scratch)
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
        if config.pad_token_id is not None:
            model.model.embed_tokens.weight[config.pad_token_id] = 0.0
    return model


def normal_through_float32_(param: Any, std: float, generator: Any, scratch: Any) -> None:  # torch tensors
    """Fill `param` (contiguous, any float dtype) with N(0, std) drawn in float32 chunks of
    `scratch`'s size and cast on copy. torch's CPU normal_ has long had a vectorized float32
    path; drawn straight in bf16, the 1B's weights took 41.6 s under the GPU machine's torch 2.11
    (16 cores), against 10.8 s under torch 2.13 on the 2-core development machine."""
    flat = param.view(-1)
    for start in range(0, flat.numel(), scratch.numel()):
        part = flat[start:start + scratch.numel()]
        drawn = scratch[:part.numel()].normal_(0.0, std, generator=generator)
        part.copy_(drawn)


def prompt_texts(tokenizer, n: int, length: int, seed: int) -> list[str]:  # tokenizer: transformers fast tokenizer
    """`n` texts of random lowercase words, each exactly `length` tokens. A word's tokens do not
    depend on its neighbours (the pre-tokenizer splits before each space), so a prompt is
    built word by word and finished with one-token words."""
    rng = random.Random(seed)

    def count(word: str) -> int:
        return len(tokenizer(word, add_special_tokens=False)["input_ids"])

    texts = []
    for _ in range(n):
        words: list[str] = []
        used = 0
        while used < length:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
            word = word if not words else " " + word
            tokens = count(word)
            if used + tokens > length:
                word = rng.choice(string.ascii_lowercase) if not words else " " + rng.choice(string.ascii_lowercase)
                tokens = count(word)
            words.append(word)
            used += tokens
        text = "".join(words)
        if count(text) != length:
            raise AssertionError(f"prompt of {count(text)} tokens, wanted {length}: {text!r}")
        texts.append(text)
    return texts


def build_inputs(out: Path, tiny: bool, n_prompts: int, prompt_len: int, seed: int = 0,
                 mean_len: float | None = None) -> PeerInputs:
    """The model directory and `n_prompts` prompts of `prompt_len` tokens under `out` (mean_len:
    an EOS planted in the weights, module docstring)."""
    from transformers import AutoTokenizer

    times: dict[str, float] = {}
    spec = save_model_dir(out / "model", TINY if tiny else LLAMA_1B, seed, mean_len, times)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    path = out / "prompts.jsonl"
    with path.open("w", encoding="utf-8") as sink:
        for text in prompt_texts(tokenizer, n_prompts, prompt_len, seed):
            sink.write(json.dumps({"prompt": text}) + "\n")
    lap(times, "prompts", start)
    return PeerInputs(out / "model", path, spec, prompt_len, times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (vocab 384) instead of Llama-3.2-1B")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mean-len", type=float, default=None, help="plant an EOS: responses of about this mean")
    args = parser.parse_args(argv)
    if args.mean_len is not None and args.mean_len <= 1:
        parser.error(f"--mean-len={args.mean_len}: must be > 1")
    inputs = build_inputs(args.out, args.tiny, args.prompts, args.prompt_len, mean_len=args.mean_len)
    print(f"model: {inputs.model_dir} ({inputs.spec.vocab_size} tokens); prompts: {inputs.prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
