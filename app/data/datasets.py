"""Datasets for training: prompt files (RL) and preference pairs (DPO), tokenisation, and a
deterministic, resumable batch iterator.

Files are JSONL (one JSON object a line; `.jsonl`, or `.json` holding either JSONL or one array
of objects) or Parquet (needs the optional `pyarrow`). Prompt records have a prompt field and an
optional answer field (passed to the reward function); preference records have prompt, chosen and
rejected fields. Field names are configurable. Errors name the file and the line (or row).

Tokenisers: `load_tokenizer("toy")` gives the built-in character tokenizer of the toy task;
any other value is a model directory (or hub id already in the local cache) for
`transformers.AutoTokenizer`. Both expose `encode_prompt(text, chat_template)`,
`encode_completion(text)` (ends with eos), `decode(ids)` and `bos/eos/pad_token_id`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from app.config import read_utf8
from app.data.toy_task import CharTokenizer, generate_toy_prompts

PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
T = TypeVar("T")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as read from a file; `source` is "file:line" for error messages."""

    prompt: str
    answer: str | None
    source: str


@dataclass(frozen=True)
class PreferenceRecord:
    """One DPO pair as read from a file: the prompt and two completions (without the prompt)."""

    prompt: str
    chosen: str
    rejected: str
    source: str


@dataclass(frozen=True)
class PromptExample:
    """A tokenised prompt; `index` is its row in the dataset (stable id for logging)."""

    index: int
    prompt: str
    answer: str | None
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class PreferenceExample:
    """A tokenised DPO pair; chosen/rejected ids are completions only and end with eos."""

    index: int
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


class PromptTokenizer(Protocol):
    """What datasets and the driver need from a tokenizer."""

    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int

    def encode_prompt(self, text: str, chat_template: bool = False) -> list[int]: ...

    def encode_completion(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class HFTokenizer:
    """A `transformers` tokenizer behind the `PromptTokenizer` interface."""

    def __init__(self, hf_tokenizer: Any, source: str) -> None:
        if hf_tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {source!r}: has no eos token; generation needs one to stop")
        self.hf = hf_tokenizer
        self.source = source
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_id: int = hf_tokenizer.eos_token_id
        # Padding is never attended to (batches are packed); eos is a safe filler when unset.
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else self.eos_token_id

    def encode_prompt(self, text: str, chat_template: bool = False) -> list[int]:
        """Prompt ids: either the chat template with a generation prompt (its own specials
        included), or the plain text with the tokenizer's usual specials (e.g. bos)."""
        if not chat_template:
            return list(self.hf(text, add_special_tokens=True)["input_ids"])
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"chat_template=True: tokenizer {self.source!r} has no chat template; "
                             "set data.chat_template=false")
        formatted = self.hf.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)
        return list(self.hf(formatted, add_special_tokens=False)["input_ids"])

    def encode_completion(self, text: str) -> list[int]:
        """Completion ids without specials, followed by eos."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"]) + [self.eos_token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(name_or_dir: str) -> PromptTokenizer:
    """"toy" -> the toy task's CharTokenizer; otherwise AutoTokenizer.from_pretrained(name_or_dir)."""
    if name_or_dir == "toy":
        return CharTokenizer()
    from transformers import AutoTokenizer  # heavy import, only when a real tokenizer is asked for

    try:
        hf = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {name_or_dir!r}: cannot be loaded ({exc}); give a model directory "
                         "holding tokenizer files, or 'toy'") from exc
    return HFTokenizer(hf, name_or_dir)


# ---- reading files -------------------------------------------------------------------------------


def _read_json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    text = read_utf8(path)  # a byte that is not UTF-8 names the file and the line
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        yield from enumerate(rows, start=1)  # "line" = element number of the array
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _read_parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow, which is not installed; "
                          "run `pip install pyarrow` or convert the file to JSONL") from None
    for row_no, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield row_no, row


def read_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number from 1, record) for every record of a JSONL/JSON/Parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file does not exist")
    if path.suffix not in PROMPT_FILE_SUFFIXES:
        raise ValueError(f"{path}: unknown dataset format {path.suffix!r}; allowed: {', '.join(PROMPT_FILE_SUFFIXES)}")
    rows = _read_parquet_rows(path) if path.suffix == ".parquet" else _read_json_rows(path)
    seen = 0
    for line_no, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}")
        seen += 1
        yield line_no, row
    if seen == 0:
        raise ValueError(f"{path}: empty dataset (no records)")


def _text_field(path: Path, line_no: int, row: dict[str, Any], key: str, setting: str) -> str:
    if key not in row:
        raise ValueError(f"{path} line {line_no}: no field {key!r} (fields: {', '.join(sorted(row)) or 'none'}); "
                         f"set {setting} to the field holding it")
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{path} line {line_no}: field {key!r} is a {type(value).__name__}; it must be a string")
    return value


def read_text_column(path: str | Path, key: str, option: str = "--data") -> list[str]:
    """The string field `key` of every record of a JSONL/JSON/Parquet file, for the command-line
    tools; errors name the file and the line (`option` names the flag in a missing-file error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{option} {path}: no such file")
    return [_text_field(path, line_no, row, key, f"the file's `{key}` field") for line_no, row in read_rows(path)]


def load_prompt_records(path: str | Path, prompt_key: str = "prompt", answer_key: str | None = "answer",
                        require_answer: bool = False) -> list[PromptRecord]:
    """Read prompts (and answers, when the field is present) from a file.

    answer_key=None ignores answers. A non-string answer (e.g. a number) is converted with str().
    require_answer=True makes a missing answer an error (for rewards that need one).
    """
    path = Path(path)
    records = []
    for line_no, row in read_rows(path):
        prompt = _text_field(path, line_no, row, prompt_key, "data.prompt_key")
        answer = None
        if answer_key is not None and row.get(answer_key) is not None:
            answer = str(row[answer_key])
        elif require_answer:
            raise ValueError(f"{path} line {line_no}: no field {answer_key!r}; the reward needs an answer "
                             "per prompt (set data.answer_key)")
        records.append(PromptRecord(prompt, answer, f"{path}:{line_no}"))
    return records


def load_preference_records(path: str | Path, prompt_key: str = "prompt", chosen_key: str = "chosen",
                            rejected_key: str = "rejected") -> list[PreferenceRecord]:
    """Read DPO pairs (prompt, chosen completion, rejected completion) from a file."""
    path = Path(path)
    return [
        PreferenceRecord(
            _text_field(path, line_no, row, prompt_key, "data.prompt_key"),
            _text_field(path, line_no, row, chosen_key, "data.chosen_key"),
            _text_field(path, line_no, row, rejected_key, "data.rejected_key"),
            f"{path}:{line_no}",
        )
        for line_no, row in read_rows(path)
    ]


def toy_prompt_records(n: int, seed: int) -> list[PromptRecord]:
    """The toy task's generated prompts (see app.data.toy_task) as records; source "toy:<i>"."""
    return [PromptRecord(r["prompt"], r["answer"], f"toy:{i}") for i, r in enumerate(generate_toy_prompts(n, seed))]


# ---- tokenising ----------------------------------------------------------------------------------

TOO_LONG_POLICIES = ("error", "drop", "truncate_left")


def _fit_prompt(ids: list[int], max_len: int | None, too_long: str, source: str) -> list[int] | None:
    if max_len is None or len(ids) <= max_len:
        return ids
    if too_long == "error":
        raise ValueError(f"{source}: prompt has {len(ids)} tokens > max_prompt_len={max_len}; raise the limit "
                         f"or set too_long to one of {', '.join(TOO_LONG_POLICIES)}")
    if too_long == "drop":
        return None
    if too_long == "truncate_left":
        return ids[-max_len:]  # keep the end: the question usually sits there
    raise ValueError(f"too_long={too_long!r}: unknown; allowed: {', '.join(TOO_LONG_POLICIES)}")


def tokenize_prompts(records: Sequence[PromptRecord], tokenizer: PromptTokenizer, chat_template: bool = False,
                     max_prompt_len: int | None = None, too_long: str = "error") -> list[PromptExample]:
    """Tokenise prompts; `index` is the record's position in `records` (kept when others drop)."""
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"too_long={too_long!r}: unknown; allowed: {', '.join(TOO_LONG_POLICIES)}")
    examples = []
    for index, record in enumerate(records):
        ids = tokenizer.encode_prompt(record.prompt, chat_template)
        ids = _fit_prompt(ids, max_prompt_len, too_long, record.source)
        if ids is not None:
            examples.append(PromptExample(index, record.prompt, record.answer, tuple(ids)))
    if not examples:
        raise ValueError(f"no prompt fits max_prompt_len={max_prompt_len} (all {len(records)} were dropped)")
    return examples


def tokenize_preferences(records: Sequence[PreferenceRecord], tokenizer: PromptTokenizer,
                         chat_template: bool = False, max_len: int | None = None) -> list[PreferenceExample]:
    """Tokenise DPO pairs; pairs whose prompt + longer completion exceed max_len are dropped."""
    examples = []
    for index, record in enumerate(records):
        prompt = tokenizer.encode_prompt(record.prompt, chat_template)
        chosen, rejected = tokenizer.encode_completion(record.chosen), tokenizer.encode_completion(record.rejected)
        if max_len is not None and len(prompt) + max(len(chosen), len(rejected)) > max_len:
            continue
        examples.append(PreferenceExample(index, tuple(prompt), tuple(chosen), tuple(rejected)))
    if not examples:
        raise ValueError(f"no preference pair fits max_len={max_len} (all {len(records)} were dropped)")
    return examples


def build_prompt_dataset(path: str | Path, tokenizer: PromptTokenizer, prompt_key: str = "prompt",
                         answer_key: str | None = "answer", require_answer: bool = False,
                         chat_template: bool = False, max_prompt_len: int | None = None,
                         too_long: str = "error", toy_size: int = 1024, toy_seed: int = 0) -> list[PromptExample]:
    """Read and tokenise a prompt dataset in one call. path "toy" generates the toy task's
    prompts (toy_size of them from toy_seed) instead of reading a file."""
    if str(path) == "toy":
        records = toy_prompt_records(toy_size, toy_seed)
    else:
        records = load_prompt_records(path, prompt_key, answer_key, require_answer)
    return tokenize_prompts(records, tokenizer, chat_template, max_prompt_len, too_long)


# ---- batching ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IteratorState:
    """Where a BatchIterator stands: the epoch and the position of the next item in its order."""

    epoch: int = 0
    position: int = 0


class BatchIterator(Generic[T]):
    """Endless iterator over batches (lists) of items, reshuffled every epoch.

    The order of epoch e is a permutation drawn from numpy's generator seeded with (seed, e), so
    it depends only on (seed, epoch): resuming from an `IteratorState` reproduces the exact batches
    an uninterrupted run would have seen. With drop_last=True every batch is full and the tail
    of an epoch that cannot fill one is skipped; with False the last batch of an epoch is shorter.
    """

    def __init__(self, items: Sequence[T], batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, state: IteratorState | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if drop_last and batch_size > len(items):
            raise ValueError(f"batch_size={batch_size} > dataset size {len(items)} with drop_last=True: "
                             "no full batch exists; use a smaller batch or more data")
        if not items:
            raise ValueError("items: empty dataset")
        if state is not None and not (state.epoch >= 0 and 0 <= state.position <= len(items)):
            raise ValueError(f"state={state}: need epoch >= 0 and 0 <= position <= {len(items)} (dataset size); "
                             "was it saved for another dataset?")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.state = state if state is not None else IteratorState()
        self._order_epoch, self._order = -1, np.arange(0)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(len(self.items), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """int64 [len(items)]: the item order of this epoch."""
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def next_batch(self) -> list[T]:
        """The next batch; moves to the next epoch when the current one is used up."""
        epoch, position = self.state.epoch, self.state.position
        remaining = len(self.items) - position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            epoch, position = epoch + 1, 0
        if self._order_epoch != epoch:  # cache the permutation: one draw per epoch
            self._order_epoch, self._order = epoch, self.epoch_order(epoch)
        indices = self._order[position:position + self.batch_size]
        self.state = IteratorState(epoch, position + len(indices))
        return [self.items[int(i)] for i in indices]

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        return self.next_batch()


__all__ = [
    "BatchIterator", "HFTokenizer", "IteratorState", "PreferenceExample", "PreferenceRecord", "PromptExample",
    "PromptRecord", "PromptTokenizer", "build_prompt_dataset", "load_preference_records", "load_prompt_records",
    "load_tokenizer", "read_rows", "tokenize_preferences", "tokenize_prompts", "toy_prompt_records",
]
