"""Many rows of token ids back to text at once, for tokenizers with a byte-level decoder (GPT-2,
Llama 3, Qwen 2 to 3, DeepSeek): one numpy gather over a table of every id's bytes.

A rule reward decodes every response of its call on the worker's host while the GPU waits (the
peer bench: 512 rows of 512 ids a step). HF tokenizers' `decode_batch` builds a string per token
and maps it back to bytes char by char, about 170 ns a token on the 2-core
development machine (44 ms for those 262,144 ids), and gains little from more threads.

Under a `ByteLevel` decoder a row's text is a pure function of its ids:

* each id stands for fixed bytes: its token's characters mapped back through the byte alphabet
  (the 256 printable characters GPT-2 gave the 256 byte values), or the token's own UTF-8 where a
  character is outside that alphabet (an added token like "<tool_call>" is ASCII and maps to
  itself either way); a special token (skipped) or an id with no token (a model's padded rows
  past the tokenizer's vocabulary) stands for none;
* the row's bytes are the concatenation, decoded as UTF-8 with each maximal invalid subpart
  replaced by U+FFFD: Rust's `from_utf8_lossy` and Python's `errors="replace"` both follow
  Unicode's recommended practice (checked on every 2-byte sequence and 425,984 of 3 and 4 bytes,
  docs/benchmarks.md, issue 27, thirtieth step).

So `ByteTable.build` keeps every id's bytes in one array, and `decode` gathers a whole batch's
bytes in one indexing operation and decodes each row's slice. The table is used only where a
probe (every added token between two others, and random rows over the whole id range) decodes
exactly as the backend's `decode_batch` does; a tokenizer version that decodes differently
fails the probe and keeps the backend's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

# Ids decoded per gather (whole rows): bounds the gather's index array (8 bytes per output byte).
CHUNK_IDS = 1 << 22
PROBE_ROWS = 64
PROBE_LEN = 48


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, soft hyphen, ...) for chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    rest = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + k) for k, b in enumerate(rest)})
    return {c: b for b, c in chars.items()}


ALPHABET = byte_alphabet()
TO_LATIN1 = str.maketrans({c: chr(b) for c, b in ALPHABET.items()})
ALPHABET_CHARS = frozenset(ALPHABET)


def token_bytes(token: str) -> bytes:
    """The bytes a ByteLevel decoder turns one token into (module docstring)."""
    if set(token) <= ALPHABET_CHARS:
        return token.translate(TO_LATIN1).encode("latin-1")
    return token.encode("utf-8")


def is_byte_level(backend: object) -> bool:
    """Whether a `tokenizers.Tokenizer`'s decoder is exactly ByteLevel (not a sequence holding one)."""
    from tokenizers import decoders

    return type(getattr(backend, "decoder", None)) is decoders.ByteLevel


@dataclass(frozen=True)
class ByteTable:
    """Every id's bytes: id i's are data[offsets[i]:offsets[i] + lengths[i]]; ids >= `size`
    (none of the tokenizer's) map to the empty entry at index `size`."""

    data: np.ndarray  # [total bytes] uint8
    offsets: np.ndarray  # [size + 1] int64
    lengths: np.ndarray  # [size + 1] int64, 0 for skipped specials, missing ids and the last entry
    size: int

    @classmethod
    def build(cls, backend: object, probe: bool = True) -> ByteTable | None:
        """The table of a `tokenizers.Tokenizer` whose decoder is exactly ByteLevel, special
        tokens skipped; None for any other decoder, or where the probe disagrees with the
        backend's own decoding."""
        if not is_byte_level(backend):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(max(vocab.values(), default=-1) + 1, backend.get_vocab_size(with_added_tokens=True))
        added = backend.get_added_tokens_decoder()
        specials = {token.content for token in added.values() if token.special}
        pieces = []
        for i in range(size):
            token = backend.id_to_token(i)
            pieces.append(b"" if token is None or token in specials else token_bytes(token))
        lengths = np.array([len(p) for p in pieces] + [0], dtype=np.int64)
        offsets = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        table = cls(np.frombuffer(b"".join(pieces), dtype=np.uint8), offsets, lengths, size)
        if probe and not table.agrees_with(backend, sorted(added)):
            return None
        return table

    def agrees_with(self, backend: object, added_ids: Sequence[int]) -> bool:
        """Whether this table decodes as `backend.decode_batch(..., skip_special_tokens=True)` on
        every added id between two ordinary ones, and on random rows over every id (plus a few
        past the vocabulary)."""
        rng = np.random.default_rng(0)
        neighbours = rng.integers(0, self.size, (len(added_ids), 2))
        rows = [[int(a), int(i), int(b)] for i, (a, b) in zip(added_ids, neighbours)]
        rows += rng.integers(0, self.size + 4, (PROBE_ROWS, PROBE_LEN)).tolist()
        rows.append([])
        ids = np.array([i for row in rows for i in row], dtype=np.int64)
        bounds = np.cumsum([0] + [len(row) for row in rows])
        try:
            expected = list(backend.decode_batch(rows, skip_special_tokens=True))
        except Exception:  # noqa: BLE001  (a backend that cannot decode these ids keeps its own path)
            return False
        return self.decode(ids, bounds) == expected

    def decode(self, ids: np.ndarray, bounds: np.ndarray) -> list[str] | None:
        """Texts of rows laid back to back: ids [N] (any integer dtype), bounds [R + 1] (row r is
        ids[bounds[r]:bounds[r + 1]]). None when an id is negative (the caller's own path then
        decodes, and fails, as before)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and int(ids.min()) < 0:
            return None
        bounds = np.asarray(bounds, dtype=np.int64)
        texts: list[str] = []
        first = 0
        n_rows = len(bounds) - 1
        while first < n_rows:  # rows in chunks of about CHUNK_IDS ids (a row is never split)
            last = max(int(np.searchsorted(bounds, bounds[first] + CHUNK_IDS, side="right")) - 1, first + 1)
            texts += self._decode_chunk(ids[bounds[first]:bounds[last]], bounds[first:last + 1] - bounds[first])
            first = last
        return texts

    def _decode_chunk(self, ids: np.ndarray, bounds: np.ndarray) -> list[str]:
        ids = np.minimum(ids, self.size)  # ids past the vocabulary: the empty entry
        lengths = self.lengths[ids]  # [N] bytes of each id
        ends = np.cumsum(lengths)  # [N] where each id's bytes end in the output
        byte_bounds = np.concatenate((np.zeros(1, dtype=np.int64), ends))[bounds].tolist()  # [R + 1]
        total = int(ends[-1]) if ids.size else 0
        # Output byte k comes from data[offsets[id] + k - (its id's first output byte)].
        source = np.repeat(self.offsets[ids] - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)
        joined = self.data[source].tobytes()
        return [joined[a:b].decode("utf-8", "replace") for a, b in zip(byte_bounds[:-1], byte_bounds[1:])]

    def decode_tensors(self, rows: Sequence[Tensor]) -> list[str] | None:
        """`decode` of 1-D id tensors, one a row (copied to the host where they are not on it)."""
        if not rows:
            return []
        ids = np.concatenate([row.detach().reshape(-1).cpu().numpy() for row in rows])
        return self.decode(ids, np.cumsum([0] + [row.numel() for row in rows]))

    def decode_lists(self, rows: Sequence[Sequence[int]]) -> list[str] | None:
        """`decode` of rows given as lists of ints."""
        if not rows:
            return []
        lengths = [len(row) for row in rows]
        ids = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=sum(lengths))
        return self.decode(ids, np.cumsum([0] + lengths))


__all__ = ["ALPHABET", "CHUNK_IDS", "ByteTable", "byte_alphabet", "is_byte_level", "token_bytes"]
