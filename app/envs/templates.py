"""Observation ids, token in / token out: what is appended after the ids the actor sampled.

The actor's sampled ids are never re-derived from text. After a turn, the observation's ids are
appended to the trajectory as they are:
- without a chat template (the toy character tokenizer, plain text models): the observation's
  own tokens (`tokenizer.encode(text)`, no special tokens);
- with a chat template: the template's DELTA. A fixed placeholder conversation `base` ending
  with an assistant turn is rendered, then `base + [{role, content: observation}]` with the
  generation prompt; the observation's ids are the second's ids after the first's. They hold the
  new turn's header, its content, its end and the next assistant header. Before them come the
  tokens the template puts after an assistant message's content (Qwen: "<|im_end|>", "\\n";
  Llama 3: "<|eot_id|>") minus those the action already ends with, so an action that ended
  with eos gets only the newline, and one cut at the length limit gets its turn closed.
  This needs a prefix-preserving template: rendering with the new turn must start with the
  rendering without it. `check_prefix_preserving` checks that (on by default) and names where
  the renderings diverge (templates that rewrite earlier turns, e.g. strip the <think> blocks of
  earlier assistant turns as Qwen3's does, cannot be used this way).

Truncation keeps the first `max_tokens` ids of a plain observation. A templated one keeps its
template tokens (the closing tokens, the role header, the end of turn and the next assistant
header) intact and cuts the content: its first tokens, decoded and rendered again, as many as fit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from app.data import load_tokenizer
from app.envs.interface import import_attribute

ACTION_MARKER = "ACTION-7f3a"
PLACEHOLDER_BASE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Question?"},
    {"role": "assistant", "content": f"<think>Let me see.</think>{ACTION_MARKER}"},
)


def resolve_tokenizer(tokenizer: Any) -> tuple[Any, str]:
    """(tokenizer object, name for messages) from "toy", an HF model directory (or hub id in the
    local cache), a 'module:Class' spec (instantiated without arguments) or a tokenizer object
    (app.data's HFTokenizer wrapper is unwrapped to its transformers tokenizer)."""
    if not isinstance(tokenizer, str):
        inner = getattr(tokenizer, "hf", None)
        obj = inner if inner is not None and hasattr(inner, "apply_chat_template") else tokenizer
        return obj, str(getattr(tokenizer, "source", None) or getattr(obj, "name_or_path", "") or type(obj).__name__)
    if ":" in tokenizer and not Path(tokenizer).is_dir():
        factory, spec = import_attribute(tokenizer, f"tokenizer={tokenizer!r}")
        return (factory() if callable(factory) else factory), spec
    loaded = load_tokenizer(tokenizer)  # "toy": the character tokenizer; else transformers' AutoTokenizer
    return getattr(loaded, "hf", loaded), tokenizer


def _is_hf(tokenizer: Any) -> bool:
    return hasattr(tokenizer, "apply_chat_template")


def render_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The chat template's token ids of `messages` (a plain list, whatever the transformers version)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _divergence(before: str, after: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    return (f"they diverge at character {at}: without the new turn ...{before[max(0, at - 40):at + 40]!r}, "
            f"with it ...{after[max(0, at - 40):at + 40]!r}")


def check_prefix_preserving(tokenizer: Any, role: str, name: str | None = None) -> None:
    """ValueError unless rendering `PLACEHOLDER_BASE + [a `role` turn]` (with the generation
    prompt) starts, token for token, with rendering `PLACEHOLDER_BASE`: the condition for
    appending observation ids as a delta. The message names the tokenizer and where they diverge.
    tokenizer: a spec or an object, as `resolve_tokenizer` takes (app.data's wrapper included)."""
    tokenizer, label = resolve_tokenizer(tokenizer)
    what = f"tokenizer {name or label!r}: its chat template"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{what} is missing (data.chat_template=true needs one); set data.chat_template=false")
    base = list(PLACEHOLDER_BASE)
    extended = [*base, {"role": role, "content": "Observation."}]
    try:
        base_ids = render_ids(tokenizer, base, add_generation_prompt=False)
        full_ids = render_ids(tokenizer, extended, add_generation_prompt=True)
    except Exception as exc:
        raise ValueError(f"{what} cannot render a conversation user, assistant, {role} "
                         f"(rollout.observation_role={role!r}): {type(exc).__name__}: {exc}") from exc
    if full_ids[: len(base_ids)] == base_ids:
        return
    before = tokenizer.apply_chat_template(base, add_generation_prompt=False, tokenize=False)
    after = tokenizer.apply_chat_template(extended, add_generation_prompt=True, tokenize=False)
    raise ValueError(f"{what} is not prefix-preserving for rollout.observation_role={role!r}: rendering the "
                     f"conversation with a new {role} turn does not start with the rendering without it, so the "
                     f"turn cannot be appended as token ids; {_divergence(before, after)}. Use a template that "
                     "renders earlier turns unchanged (no rewriting or stripping of <think> blocks), or set "
                     "data.chat_template=false")


class ObservationEncoder:
    """Prompt and observation ids for one tokenizer, chat-template setting and observation role."""

    def __init__(self, tokenizer: Any, chat_template: bool, role: str = "user", check_prefix: bool = True) -> None:
        self.tokenizer, self.name = resolve_tokenizer(tokenizer)
        self.chat_template = bool(chat_template)
        self.role = role
        self.hf = _is_hf(self.tokenizer)
        self._tail: list[int] = []
        self._base_len = 0
        self._overhead = 0  # template ids of an observation with empty content
        if self.chat_template:
            if not self.hf:
                raise ValueError(f"data.chat_template=true: tokenizer {self.name!r} has no chat template; "
                                 "set data.chat_template=false")
            if check_prefix:
                check_prefix_preserving(self.tokenizer, role, self.name)
            self._init_delta()
            self._overhead = len(self._delta(""))
        # The fewest ids an observation can take (its template tokens); max_observation_tokens below it fails.
        self.min_observation_tokens = len(self._tail) + self._overhead if self.chat_template else 1

    def _init_delta(self) -> None:
        """The base rendering's length and the ids the template puts after an assistant content."""
        base = list(PLACEHOLDER_BASE)
        base_ids = render_ids(self.tokenizer, base, add_generation_prompt=False)
        self._base_len = len(base_ids)
        text = self.tokenizer.apply_chat_template(base, add_generation_prompt=False, tokenize=False)
        tail = text[text.rindex(ACTION_MARKER) + len(ACTION_MARKER):] if ACTION_MARKER in text else ""
        tail_ids = [int(i) for i in self.tokenizer.encode(tail, add_special_tokens=False)] if tail else []
        # A tail that does not tokenize as the rendering ends (an unusual template) is left out.
        self._tail = tail_ids if tail_ids and base_ids[-len(tail_ids):] == tail_ids else []

    def _delta(self, content: str) -> list[int]:
        messages = [*PLACEHOLDER_BASE, {"role": self.role, "content": content}]
        return render_ids(self.tokenizer, messages, add_generation_prompt=True)[self._base_len:]

    def _closing(self, action_ids: list[int] | None) -> list[int]:
        """The template's tokens after an assistant content, minus those the action ends with."""
        tail, action = self._tail, list(action_ids or [])
        for k in range(len(tail), 0, -1):
            if len(action) >= k and action[-k:] == tail[:k]:
                return tail[k:]
        return list(tail)

    def encode_text(self, text: str) -> list[int]:
        """The text's own ids, without special tokens."""
        if self.hf:
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of sampled ids, special tokens skipped (the action text an environment sees)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_prompt(self, first_observation: str | list[dict[str, str]]) -> list[int]:
        """Prompt ids of a first observation: the chat template with the generation prompt (a str
        is one user message), or the plain text with the tokenizer's usual specials (toy: bos)."""
        if self.chat_template:
            messages = ([{"role": "user", "content": first_observation}] if isinstance(first_observation, str)
                        else list(first_observation))
            return render_ids(self.tokenizer, messages, add_generation_prompt=True)
        if not isinstance(first_observation, str):
            raise ValueError("reset returned chat messages, but data.chat_template is false: return a str, "
                             "or turn data.chat_template on")
        if self.hf:
            return [int(i) for i in self.tokenizer(first_observation, add_special_tokens=True)["input_ids"]]
        encode_prompt = getattr(self.tokenizer, "encode_prompt", None)  # the toy tokenizer: bos + text
        return list(encode_prompt(first_observation) if encode_prompt else self.tokenizer.encode(first_observation))

    def encode_observation(self, text: str, max_tokens: int,
                           action_ids: list[int] | None = None) -> tuple[list[int], bool]:
        """(ids to append after the action, truncated?), at most max_tokens ids (see the module
        docstring). action_ids: this turn's sampled ids (the closing tokens depend on its end)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
        if not self.chat_template:
            ids = self.encode_text(text)
            return ids[:max_tokens], len(ids) > max_tokens
        closing = self._closing(action_ids)
        ids = closing + self._delta(text)
        if len(ids) <= max_tokens:
            return ids, False
        if len(closing) + self._overhead > max_tokens:
            raise ValueError(f"rollout.max_observation_tokens={max_tokens}: the chat template alone takes "
                             f"{len(closing) + self._overhead} tokens per observation; raise it")
        content = self.encode_text(text)
        keep = max(0, min(len(content), max_tokens - len(closing) - self._overhead))
        while True:
            ids = closing + self._delta(self.tokenizer.decode(content[:keep]) if keep else "")
            if len(ids) <= max_tokens or keep == 0:
                return ids, True
            keep = max(0, keep - (len(ids) - max_tokens))


@functools.lru_cache(maxsize=8)
def observation_encoder(tokenizer: str, chat_template: bool, role: str) -> ObservationEncoder:
    """An `ObservationEncoder` for a tokenizer spec, built (and its template checked) once per
    process: generation calls on a worker share it."""
    return ObservationEncoder(tokenizer, chat_template, role)


__all__ = ["ObservationEncoder", "check_prefix_preserving", "observation_encoder", "render_ids", "resolve_tokenizer"]
