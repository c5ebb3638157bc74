"""Which tokenizer a model reads, whether two tokenizers are the same, and text from one to the other.

Tokenizers are named as in the config: 'toy' (the toy task's `CharTokenizer`), an HF directory
(or a hub id in the local cache) for `transformers.AutoTokenizer`, or 'module:Class' (what the
workers are given, e.g. 'app.data.toy_task:CharTokenizer'). `load_tokenizer_object` loads one once
per process.

Two tokenizers are *the same* when every id means the same token: equal token -> id maps
(`get_vocab()`, added tokens included) and equal special-token ids (bos, eos, pad, unk).
`tokenizer_info` reduces that to a fingerprint, a SHA-256 of the sorted map and the special ids.
Merges are left out on purpose: they decide how a text is split, not what an id means, and a model
reading another model's ids only needs the ids to mean the same.

`RewardText` is the bridge a reward model with another tokenizer reads through (veRL's
`reward_model.input_tokenizer`, TRL's `reward_processing_classes`): the response ids are decoded
with the actor's tokenizer (cut at its eos, special tokens dropped), the prompt is the dataset's
text, both are rendered with the reward model's chat template (a user turn and an assistant turn)
or joined as plain text, re-tokenized with the reward tokenizer (the template brings its own
special tokens; plain text gets the tokenizer's usual ones, e.g. bos), and cut to the last
`max_length` tokens, the ones the score is read at. The worker's model_reward op loads it by name
(actors/ never imports app/); preflight uses the same class to measure how many reward tokens an
actor token becomes, which the planner prices the reward call with.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.data.toy_task import TOY_VOCAB_SIZE, CharTokenizer

SPECIAL_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
REWARD_TEXT = "app.data.tokenizers:RewardText"  # what the workers build the bridge from (by name)


def rule_reward_s_per_token(tokenizer: Any) -> float | None:
    """Host seconds per response token of a rule reward's call on the actor's `tokenizer` (an
    HFTokenizer, or the HF object), for `MFC.host_s_per_token`: where its rows decode through a
    byte table (a byte-level BPE: actors.worker.byte_level) BYTE_TABLE_S_PER_TOKEN; None keeps
    the planner's default rate. Preflight and `python -m app plan` both price the call with it."""
    from actors.worker import decodes_through_byte_table  # torch: only once a tokenizer is loaded
    from planning.cost_terms import BYTE_TABLE_S_PER_TOKEN

    return BYTE_TABLE_S_PER_TOKEN if decodes_through_byte_table(getattr(tokenizer, "hf", tokenizer)) else None


@functools.lru_cache(maxsize=16)
def load_tokenizer_object(source: str) -> Any:
    """The tokenizer `source` names (module docstring); ValueError naming it when it cannot load."""
    if source == "toy":
        return CharTokenizer()
    path = Path(source).expanduser()
    if not path.is_dir() and ":" in source:
        module, _, attr = source.rpartition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"tokenizer {source!r}: cannot import it ({exc})") from None
        return factory() if callable(factory) else factory
    from transformers import AutoTokenizer  # heavy: only when an HF tokenizer is named

    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else source)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"tokenizer {source!r}: cannot be loaded ({' '.join(str(exc).split())[:300]})") from None


def vocabulary(tokenizer: Any) -> dict[str, int]:
    """Token -> id of every token the tokenizer knows (the toy one: its 256 characters and specials)."""
    if hasattr(tokenizer, "get_vocab"):
        return dict(tokenizer.get_vocab())
    if isinstance(tokenizer, CharTokenizer):
        specials = {"<pad>": tokenizer.pad_token_id, "<bos>": tokenizer.bos_token_id, "<eos>": tokenizer.eos_token_id}
        return {**specials, **{chr(i): i for i in range(len(specials), TOY_VOCAB_SIZE)}}
    raise ValueError(f"tokenizer {type(tokenizer).__name__}: has no get_vocab(); cannot tell which ids it uses")


@dataclass(frozen=True)
class TokenizerInfo:
    """What decides whether two models may exchange token ids.

    n_ids: one more than the largest id the tokenizer produces (the vocabulary a model reading its
    ids needs at least). specials: bos, eos, pad and unk ids. chat_template: it has one.
    """

    source: str
    fingerprint: str
    n_ids: int
    specials: tuple[tuple[str, int | None], ...]
    chat_template: bool

    def same_as(self, other: TokenizerInfo) -> bool:
        return self.fingerprint == other.fingerprint

    def describe(self) -> str:
        return f"{self.source} ({self.n_ids} ids, {self.fingerprint[:12]})"


@functools.lru_cache(maxsize=16)
def tokenizer_info(source: str) -> TokenizerInfo:
    """The fingerprint and size of the tokenizer `source` names (loaded once per process)."""
    tokenizer = load_tokenizer_object(source)
    vocab = vocabulary(tokenizer)
    specials = tuple((name, _int_or_none(getattr(tokenizer, name, None))) for name in SPECIAL_NAMES)
    digest = hashlib.sha256(json.dumps([sorted(vocab.items()), specials], ensure_ascii=False).encode("utf-8"))
    return TokenizerInfo(source, digest.hexdigest(), max(vocab.values(), default=-1) + 1, specials,
                         bool(getattr(tokenizer, "chat_template", None)))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def has_chat_template(source: str) -> bool:
    return tokenizer_info(source).chat_template


class RewardText:
    """Decode with the actor's tokenizer, render, re-tokenize with the reward model's (module docstring).

    actor_tokenizer / reward_tokenizer: tokenizer names; chat_template: render a user and an
    assistant turn with the reward tokenizer's template (else prompt + response as plain text);
    max_length: the most tokens a sequence keeps (its last ones); eos_token_id: where a response
    ends (the actor's eos; None: the actor tokenizer's).
    """

    def __init__(self, actor_tokenizer: str, reward_tokenizer: str, chat_template: bool, max_length: int,
                 eos_token_id: int | None = None) -> None:
        if max_length < 1:
            raise ValueError(f"RewardText max_length={max_length}: must be >= 1")
        self.actor = load_tokenizer_object(actor_tokenizer)
        self.reward = load_tokenizer_object(reward_tokenizer)
        self.reward_source = reward_tokenizer
        if chat_template and not getattr(self.reward, "chat_template", None):
            raise ValueError(f"reward tokenizer {reward_tokenizer!r}: has no chat template to render with")
        self.chat_template = chat_template
        self.max_length = max_length
        eos = eos_token_id if eos_token_id is not None else getattr(self.actor, "eos_token_id", None)
        self.eos_token_id = None if eos is None else int(eos)

    # ---- from the actor's ids to text ---------------------------------------------------------------
    def response_text(self, ids: Sequence[int]) -> str:
        """The response as text: up to (without) its first eos, special tokens dropped."""
        return self.actor.decode(self._before_eos(ids), skip_special_tokens=True)

    def _before_eos(self, ids: Sequence[int]) -> list[int]:
        # A list is taken as Python ints (what the worker's `.tolist()` gives); anything else is converted.
        ids = ids if isinstance(ids, list) else [int(i) for i in ids]
        if self.eos_token_id is not None and self.eos_token_id in ids:
            ids = ids[:ids.index(self.eos_token_id)]
        return ids

    def prompt_text(self, text: str | None, ids: Sequence[int]) -> str:
        """The dataset's prompt text; without it, the prompt ids decoded (special tokens dropped)."""
        if text is not None:
            return text
        return self.actor.decode([int(i) for i in ids], skip_special_tokens=True)

    # ---- from text to the reward model's ids --------------------------------------------------------
    def render(self, prompt: str, response: str) -> str:
        """The text the reward model reads: its chat template's two turns, or prompt + response."""
        if not self.chat_template:
            return prompt + response
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return str(self.reward.apply_chat_template(messages, tokenize=False))

    def encode(self, prompt: str, response: str) -> list[int]:
        """The reward tokenizer's ids of `render(prompt, response)`, before truncation (never empty)."""
        return self._encode_texts([self.render(prompt, response)])[0]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The reward tokenizer's ids of each text (never empty); an HF tokenizer encodes the list
        in one call (a fast one in parallel in its Rust backend, ids as one text at a time)."""
        if isinstance(self.reward, CharTokenizer):
            encoded = [self.reward.encode(text, add_bos=not self.chat_template) for text in texts]
        elif (backend := self._plain_backend()) is not None:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets (tokenizers >= 0.21)
            encoded = [enc.ids for enc in encode(texts, add_special_tokens=not self.chat_template)]
        else:
            encoded = [list(ids) for ids in self.reward(texts, add_special_tokens=not self.chat_template)["input_ids"]]
        # An empty text without specials: the score is read at a lone special token.
        fallback = next((getattr(self.reward, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")
                         if getattr(self.reward, n, None) is not None), 0)
        return [ids if ids else [int(fallback)] for ids in encoded]

    def _plain_backend(self) -> Any | None:
        """The fast reward tokenizer's Rust backend where encoding through it gives what the HF call
        gives (no truncation or padding set on it, special tokens kept whole as the HF call keeps
        them): the call's per-row Python conversions skipped, about 60 ms of 512 rows of 640
        tokens on two cores. None where that is not so: the HF call then encodes."""
        backend = getattr(self.reward, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        split = bool(getattr(self.reward, "split_special_tokens", False))
        return backend if getattr(backend, "encode_special_tokens", False) == split else None

    def rows(self, prompts: Sequence[str | None], prompt_ids: Sequence[Sequence[int]],
             response_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[bool]]:
        """Each row's reward-model ids (its last max_length) and whether it was cut. Batched: each
        distinct prompt decoded once (a group's rows share it), the responses decoded and the
        rendered texts encoded as lists (actors.worker.texts.decode_many)."""
        from actors.worker import decode_many  # the worker's package: rows run there, the driver needs none

        # Rows without prompt text: their ids as a key, each distinct one decoded once.
        keys = [tuple(int(i) for i in p_ids) if text is None else None for text, p_ids in zip(prompts, prompt_ids)]
        distinct = list(dict.fromkeys(k for k in keys if k is not None))
        decoded = dict(zip(distinct, decode_many(self.actor, [list(k) for k in distinct])))
        prompt_texts = [text if key is None else decoded[key] for text, key in zip(prompts, keys)]
        responses = decode_many(self.actor, [self._before_eos(r_ids) for r_ids in response_ids])
        encoded = self._encode_texts([self.render(p, r) for p, r in zip(prompt_texts, responses)])
        return [ids[-self.max_length:] for ids in encoded], [len(ids) > self.max_length for ids in encoded]

    def token_pricing(self, prompts: Sequence[str], prompt_ids: Sequence[Sequence[int]]) -> tuple[float, int]:
        """(reward tokens per actor token, reward tokens every sequence has besides its text), measured
        on `prompts`: the second is an empty prompt and response rendered (the chat template's own
        tokens, a bos), the first the rest of each prompt rendered with an empty response over the
        actor's tokens of it. The planner prices a reward call at extra + ratio * (prompt + response)."""
        extra = len(self.encode("", "")) if self.chat_template or self.reward_adds_specials() else 0
        reward = sum(max(len(self.encode(text, "")) - extra, 0) for text in prompts)
        actor = sum(len(ids) for ids in prompt_ids)
        if actor == 0:
            raise ValueError("token_pricing: no prompt tokens to measure")
        return max(reward / actor, 1.0 / actor), extra

    def reward_adds_specials(self) -> bool:
        """Whether plain text gets special tokens from the reward tokenizer (a bos, say)."""
        if isinstance(self.reward, CharTokenizer):
            return True
        return bool(self.reward("", add_special_tokens=True)["input_ids"])

__all__ = [
    "REWARD_TEXT", "RewardText", "TokenizerInfo", "has_chat_template", "load_tokenizer_object", "tokenizer_info",
    "vocabulary",
]
