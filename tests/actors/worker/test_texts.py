"""actors/worker/texts.py: rows decoded for rule rewards give exactly what the tokenizer's own
decode gives, row by row; rows that are one tensor are decoded once; the Rust backend's parallel
decode, and the byte table of a byte-level decoder, are used only where the tokenizer's decode adds
nothing to them (tiny tokenizers built here, nothing downloaded)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from actors.worker import texts
from actors.worker.byte_level import ByteTable
from actors.worker.texts import byte_table, decode_many, decode_rows, decodes_like_backend
from benchmarks.peer_setup import SPECIALS, byte_level_bpe

pytestmark = pytest.mark.unit

WORDS = ["hello", "world", ".", ",", "!", "'s", "it", "n't", "a", "b", "?", "'m", "'ve", "'re", "c", "d"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (Llama 3 / Qwen style; the peer bench's, at 1,024 tokens): decoding adds
    no clean-up."""
    return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(1024), bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[1])


def word_piece_tokenizer() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer (BERT style) whose decode cleans up the spaces before punctuation."""
    vocab = {"[UNK]": 0, "[CLS]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to transformers
    backend.add_special_tokens(["[CLS]"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]",
                                   clean_up_tokenization_spaces=True)


class CountingBackend:
    """A Rust tokenizer that counts the rows its decode_batch is given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batched_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        self.batched_rows.append(len(ids))
        return self.inner.decode_batch(ids, skip_special_tokens=skip_special_tokens)


class OwnDecode(PreTrainedTokenizerFast):
    """A subclass with decoding of its own (as Whisper's tokenizer has)."""

    def _decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


def rows_of(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def test_byte_level_rows_decode_in_the_backend_as_the_tokenizer_would() -> None:
    tokenizer = byte_level_tokenizer()
    assert decodes_like_backend(tokenizer)
    texts = ["hello world", "it 's a b .", "héllo ✓ ,c", ""]
    rows = rows_of(tokenizer, texts)
    rows[1] = torch.cat([torch.tensor([tokenizer.bos_token_id]), rows[1], torch.tensor([tokenizer.eos_token_id])])
    assert decode_rows(tokenizer, rows) == [tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in rows]
    assert decode_rows(tokenizer, rows) == texts  # the specials skipped, every byte back


class CountingTable:
    """A byte table that counts the rows it is given."""

    def __init__(self, inner: ByteTable) -> None:
        self.inner = inner
        self.rows: list[int] = []

    def decode_tensors(self, rows: list[torch.Tensor]) -> list[str] | None:
        self.rows.append(len(rows))
        return self.inner.decode_tensors(rows)


@pytest.mark.parametrize("path", ["byte table", "backend"])
def test_rows_that_are_one_tensor_are_decoded_once(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = byte_level_tokenizer()
    table = byte_table(tokenizer)
    assert table is not None  # a byte-level decoder that passes the probe
    counting_table = CountingTable(table)
    monkeypatch.setattr(texts, "byte_table", lambda tok: counting_table if path == "byte table" else None)
    counting = tokenizer._tokenizer = CountingBackend(tokenizer.backend_tokenizer)
    prompts = rows_of(tokenizer, ["hello", "world ."])
    rows = [prompts[i // 4] for i in range(8)]  # 2 prompts x 4 samples, as generation hands them over
    rows.append(prompts[0].clone())  # equal ids in another tensor: decoded on its own
    assert decode_rows(tokenizer, rows) == ["hello"] * 4 + ["world ."] * 4 + ["hello"]
    assert (counting_table.rows, counting.batched_rows) == (([3], []) if path == "byte table" else ([], [3]))


def test_many_rows_decode_as_the_backend_through_the_byte_table() -> None:
    tokenizer = byte_level_tokenizer()
    assert byte_table(tokenizer) is not None
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, len(tokenizer), (int(n),), generator=generator)
            for n in torch.randint(0, 40, (64,), generator=generator)]
    expected = tokenizer.backend_tokenizer.decode_batch([r.tolist() for r in rows], skip_special_tokens=True)
    assert decode_rows(tokenizer, rows) == expected
    assert decode_many(tokenizer, [r.tolist() for r in rows]) == expected


def test_a_tokenizer_whose_decode_cleans_up_keeps_its_own_decode() -> None:
    tokenizer = word_piece_tokenizer()
    ids = tokenizer.encode("it n't hello .", add_special_tokens=False)
    assert tokenizer.decode(ids) != tokenizer.backend_tokenizer.decode(ids)  # the clean-up is on
    assert not decodes_like_backend(tokenizer)
    rows = rows_of(tokenizer, ["hello world .", "a , b ! c ?", "it 's d"])
    assert decode_rows(tokenizer, rows) == [tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in rows]


def test_a_subclass_that_decodes_its_own_way_keeps_its_decode() -> None:
    tokenizer = OwnDecode(tokenizer_object=byte_level_bpe(1024), bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    assert not decodes_like_backend(tokenizer)
    assert decode_rows(tokenizer, rows_of(tokenizer, ["hello world"])) == ["HELLO WORLD"]


def test_a_plain_tokenizer_decodes_row_by_row() -> None:
    from app.data.toy_task import CharTokenizer

    tokenizer = CharTokenizer()
    shared = torch.tensor(tokenizer.encode("12+3="))
    rows = [shared, shared, torch.tensor(tokenizer.encode("x"))]
    assert not decodes_like_backend(tokenizer)
    assert decode_rows(tokenizer, rows) == ["12+3=", "12+3=", "x"]
    assert decode_rows(tokenizer, []) == []
