"""actors/worker/byte_level.py: the byte table decodes every row exactly as the tokenizers
backend's `decode_batch(..., skip_special_tokens=True)` does (random ids over the whole range,
specials, added tokens in and out of the byte alphabet, ids past the vocabulary, every invalid
2-byte sequence, rows split over chunks), and is refused where it would not (other decoders, a
backend that decodes its own way). Tiny tokenizers built here, nothing downloaded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from actors.worker import byte_level
from actors.worker.byte_level import ALPHABET, ByteTable, byte_alphabet, token_bytes
from benchmarks.peer_setup import byte_level_bpe

pytestmark = pytest.mark.unit


def with_added_tokens() -> Tokenizer:
    """The peer bench's byte-level BPE at 2,048 tokens plus added tokens: two special, and
    ordinary ones inside the byte alphabet ("Ġhi" decodes to " hi"), outside it ("中文"), ASCII
    ("<tool_call>") and mixed ("é中": outside, so taken as its own UTF-8)."""
    backend = byte_level_bpe(2048)
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    backend.add_tokens([AddedToken(t, special=False) for t in ("Ġhi", "中文", "<tool_call>", "é中", "ÃĹ")])
    return backend


def test_the_alphabet_is_a_bijection_of_the_256_bytes() -> None:
    alphabet = byte_alphabet()
    assert sorted(alphabet.values()) == list(range(256)) and len(alphabet) == 256
    assert alphabet["Ġ"] == ord(" ") and alphabet["!"] == ord("!") and alphabet == ALPHABET
    assert token_bytes("Ġhello") == b" hello"
    assert token_bytes("<tool_call>") == b"<tool_call>"
    assert token_bytes("中") == "中".encode()  # outside the alphabet: the token's own UTF-8
    assert token_bytes("ÃĹ") == bytes([0xC3, 0x97])  # "×" in two alphabet characters


def test_random_rows_decode_as_the_backend() -> None:
    backend = with_added_tokens()
    table = ByteTable.build(backend)
    assert table is not None and table.size == backend.get_vocab_size()
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, table.size + 3, int(n)).tolist() for n in rng.integers(0, 60, 300)]
    rows += [[], [table.size - 1] * 5, [backend.token_to_id("<|im_end|>")] * 3]  # empty, added, specials only
    expected = backend.decode_batch(rows, skip_special_tokens=True)
    assert table.decode_lists(rows) == expected
    assert table.decode_tensors([torch.tensor(r, dtype=torch.int64) for r in rows]) == expected
    assert table.decode_tensors([torch.tensor(r, dtype=torch.int32) for r in rows]) == expected
    assert table.decode_lists([]) == [] and table.decode_tensors([]) == []


def test_every_invalid_two_byte_sequence_is_replaced_as_the_backend_does() -> None:
    backend = byte_level_bpe(1024)
    table = ByteTable.build(backend)
    assert table is not None
    by_byte = {b: backend.token_to_id(c) for c, b in ALPHABET.items()}  # every byte is a token
    rows = [[by_byte[a], by_byte[b]] for a in range(256) for b in range(256)]
    rows += [[by_byte[b] for b in seq] for seq in (b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80",
                                                   b"\xe2\x82\xac", b"\xf0\x9f\x98\x80\x80")]
    assert table.decode_lists(rows) == backend.decode_batch(rows, skip_special_tokens=True)


def test_rows_split_over_chunks_decode_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = with_added_tokens()
    table = ByteTable.build(backend)
    assert table is not None
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, table.size, int(n)).tolist() for n in (3, 0, 17, 1, 9, 0)]
    whole = table.decode_lists(rows)
    monkeypatch.setattr(byte_level, "CHUNK_IDS", 4)  # a 17-id row is longer than a chunk
    assert table.decode_lists(rows) == whole == backend.decode_batch(rows, skip_special_tokens=True)


def test_negative_ids_leave_the_decoding_to_the_backend() -> None:
    table = ByteTable.build(byte_level_bpe(1024))
    assert table is not None
    assert table.decode_lists([[5, -1]]) is None


def word_piece() -> Tokenizer:
    backend = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "hello": 1, "##s": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return backend


def test_other_decoders_have_no_table() -> None:
    assert ByteTable.build(word_piece()) is None
    backend = byte_level_bpe(1024)
    backend.decoder = decoders.Sequence([decoders.ByteLevel()])  # byte-level, but not exactly the one checked
    assert ByteTable.build(backend) is None


class ShoutingBackend:
    """A byte-level backend whose decode_batch upper-cases: the probe must catch it."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [text.upper() for text in self.inner.decode_batch(ids, skip_special_tokens=skip_special_tokens)]


def test_a_backend_that_decodes_otherwise_fails_the_probe() -> None:
    inner = with_added_tokens()
    assert ByteTable.build(inner) is not None
    assert ByteTable.build(ShoutingBackend(inner)) is None
    table = ByteTable.build(inner, probe=False)
    assert table is not None
    lengths = table.lengths.copy()
    lengths[:table.size] = 1  # every id one byte: wrong for any longer token
    wrong = ByteTable(table.data, table.offsets, lengths, table.size)
    assert not wrong.agrees_with(inner, sorted(inner.get_added_tokens_decoder()))
