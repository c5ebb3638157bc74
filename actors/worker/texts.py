"""Token ids back to text on the worker's host, for rule rewards that score decoded text.

A rule-reward call decodes every row's prompt and response (the peer bench: 512 rows of 128 + 512
tokens per step). Two things make that cheap:

* Rows that hold one tensor object (the samples of one prompt, as generation hands them over)
  are decoded once: GRPO's 512 prompts are 64 distinct ones.
* An HF fast tokenizer's `batch_decode` decodes row after row in Python, holding the GIL; its
  Rust backend's `decode_batch` decodes the rows in parallel threads with the GIL released. The
  two agree unless the Python wrapper post-processes a decoded text (a subclass with decoding of
  its own, or `clean_up_tokenization_spaces`, applied by some tokenizers and versions and not
  others), so `decodes_like_backend` checks both, the second on a probe text once per
  tokenizer, and the backend is used only where it gives the same strings.
* Where that backend's decoder is byte-level, a table of every id's bytes decodes the whole
  batch in one numpy gather (actors.worker.byte_level; built and probed once per tokenizer).

On a 2-core development machine, the peer bench's 512 responses: 0.133 s with `batch_decode`,
0.063 s with `decode_batch` (docs/benchmarks.md, issue 27, eleventh step), 0.014 s through the
byte table (thirtieth step).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from actors.worker.byte_level import ByteTable, is_byte_level

# Spaces before punctuation and contractions: the patterns transformers' clean-up rewrites.
CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're"

# Per tokenizer (HF fast tokenizers, weakly referenced): whether it decodes as its backend does.
_BACKEND_AGREES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# Per tokenizer: its byte table, or None where it has none (actors.worker.byte_level).
_BYTE_TABLES: weakref.WeakKeyDictionary[Any, ByteTable | None] = weakref.WeakKeyDictionary()


def decodes_like_backend(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` returns what its Rust backend's `decode` does: an HF fast
    tokenizer whose class keeps the base class's decoding (Whisper's or Wav2Vec2's, say, do not)
    and adds no clean-up (checked on CLEANUP_PROBE once per tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return False
    from transformers import PreTrainedTokenizerFast  # loaded already: the tokenizer is one of its

    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(
            getattr(type(tokenizer), name) is not getattr(PreTrainedTokenizerFast, name)
            for name in ("decode", "_decode", "batch_decode")):
        return False
    if tokenizer not in _BACKEND_AGREES:
        ids = backend.encode(CLEANUP_PROBE, add_special_tokens=False).ids
        _BACKEND_AGREES[tokenizer] = (tokenizer.decode(ids, skip_special_tokens=True)
                                      == backend.decode(ids, skip_special_tokens=True))
    return _BACKEND_AGREES[tokenizer]


def decodes_through_byte_table(tokenizer: Any) -> bool:
    """Whether `decode_rows` takes the byte table's path for this tokenizer (its decoding is its
    backend's, and byte-level), short of the probe, which it is all but sure to pass: what the
    planner prices a rule reward's call by, without building the table on the driver."""
    return decodes_like_backend(tokenizer) and is_byte_level(tokenizer.backend_tokenizer)


def byte_table(tokenizer: Any) -> ByteTable | None:
    """The tokenizer's byte table where its decoding is its backend's and byte-level, else None
    (built and probed on first use, then kept as long as the tokenizer)."""
    if not decodes_like_backend(tokenizer):
        return None
    if tokenizer not in _BYTE_TABLES:
        _BYTE_TABLES[tokenizer] = ByteTable.build(tokenizer.backend_tokenizer)
    return _BYTE_TABLES[tokenizer]


def decode_many(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    """Each id list's text, special tokens skipped: the byte table or the backend's parallel
    `decode_batch` where they agree with the tokenizer (module docstring), else `batch_decode`,
    else `decode` per row."""
    if not ids:
        return []
    table = byte_table(tokenizer)
    texts = table.decode_lists(ids) if table is not None else None
    if texts is not None:
        return texts
    if decodes_like_backend(tokenizer):
        return list(tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True))
    if hasattr(tokenizer, "batch_decode"):
        return list(tokenizer.batch_decode(ids, skip_special_tokens=True))
    return [tokenizer.decode(row, skip_special_tokens=True) for row in ids]


def decode_rows(tokenizer: Any, rows: Sequence[Tensor]) -> list[str]:
    """Each row's text (special tokens skipped); rows that are one tensor object are decoded once."""
    distinct = {id(row): row for row in rows}  # rows keep their objects alive: ids stay unique
    table = byte_table(tokenizer) if rows else None
    decoded = table.decode_tensors(list(distinct.values())) if table is not None else None
    if decoded is None:
        decoded = decode_many(tokenizer, [t.tolist() for t in distinct.values()])
    texts = dict(zip(distinct, decoded))
    return [texts[id(row)] for row in rows]


__all__ = ["CLEANUP_PROBE", "byte_table", "decode_many", "decode_rows", "decodes_like_backend",
           "decodes_through_byte_table"]
