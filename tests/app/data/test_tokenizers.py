"""Tokenizer identity (fingerprints) and the text bridge of a reward model with another tokenizer,
on two tiny BPE tokenizers trained offline on different corpora and the toy character tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.data import RewardText, load_tokenizer_object, tokenizer_info
from tests.tiny_chat_model import build_tokenizer
from tests.tokenizer_families import build_other_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    build_tokenizer(root / "qwen")
    build_other_tokenizer(root / "other")
    build_other_tokenizer(root / "plain", chat_template=False)
    shutil.copytree(root / "qwen", root / "qwen_copy")
    return {name: root / name for name in ("qwen", "other", "plain", "qwen_copy")}


def test_fingerprints_tell_tokenizers_apart(tokenizers: dict[str, Path]) -> None:
    qwen, copy, other = (tokenizer_info(str(tokenizers[n])) for n in ("qwen", "qwen_copy", "other"))
    assert qwen.same_as(copy) and not qwen.same_as(other)  # the same files elsewhere; another corpus
    assert qwen.n_ids == len(load_tokenizer_object(str(tokenizers["qwen"]))) and other.n_ids == 320
    assert qwen.chat_template and other.chat_template and not tokenizer_info(str(tokenizers["plain"])).chat_template
    toy = tokenizer_info("toy")
    assert toy.same_as(tokenizer_info("app.data.toy_task:CharTokenizer")) and toy.n_ids == 256
    assert not toy.same_as(qwen)
    # The same vocabulary with other special ids is another tokenizer (eos decides where responses end).
    assert dict(other.specials)["eos_token_id"] == 1 and dict(qwen.specials)["eos_token_id"] != 1
    with pytest.raises(ValueError, match="cannot"):
        tokenizer_info(str(tokenizers["qwen"] / "nope"))


def test_reward_text_decodes_renders_and_cuts(tokenizers: dict[str, Path]) -> None:
    qwen = load_tokenizer_object(str(tokenizers["qwen"]))
    other = load_tokenizer_object(str(tokenizers["other"]))
    eos = qwen.eos_token_id
    bridge = RewardText(str(tokenizers["qwen"]), str(tokenizers["other"]), chat_template=True, max_length=512)
    response = qwen("It is 14 apples.", add_special_tokens=False)["input_ids"] + [eos, qwen.pad_token_id]
    assert bridge.response_text(response) == "It is 14 apples."  # cut at eos, nothing after it
    prompt_ids = qwen("How many?")["input_ids"]
    assert bridge.prompt_text(None, prompt_ids) == "How many?" and bridge.prompt_text("Q", prompt_ids) == "Q"
    rendered = bridge.render("How many?", "It is 14 apples.")
    assert rendered == "<s>[user]\nHow many?</s>[assistant]\nIt is 14 apples.</s>"
    rows, cut = bridge.rows(["How many?"], [prompt_ids], [response])
    assert rows[0] == other(rendered, add_special_tokens=False)["input_ids"] and cut == [False]
    short = RewardText(str(tokenizers["qwen"]), str(tokenizers["other"]), chat_template=False, max_length=3)
    rows, cut = short.rows(["How many?"], [prompt_ids], [response])
    full = other("How many?It is 14 apples.")["input_ids"]
    assert rows[0] == full[-3:] and cut == [True]  # the last tokens stay: the score is read there
    ratio, extra = bridge.token_pricing(["How many?", "Count the apples."], [prompt_ids, qwen("Count the apples.")["input_ids"]])
    assert extra == len(other(bridge.render("", ""), add_special_tokens=False)["input_ids"]) and 0 < ratio < 5
    with pytest.raises(ValueError, match="no chat template"):
        RewardText(str(tokenizers["qwen"]), str(tokenizers["plain"]), chat_template=True, max_length=8)


def test_reward_text_from_the_toy_tokenizer(tokenizers: dict[str, Path]) -> None:
    bridge = RewardText("app.data.toy_task:CharTokenizer", str(tokenizers["plain"]), chat_template=False,
                        max_length=64, eos_token_id=2)
    assert bridge.response_text([ord("3"), ord("4"), 2, ord("9")]) == "34"
    rows, cut = bridge.rows(["12"], [[1, ord("1"), ord("2")]], [[ord("3"), ord("4"), 2]])
    other = load_tokenizer_object(str(tokenizers["plain"]))
    assert rows == [other("1234")["input_ids"]] and cut == [False]


def test_reward_text_rows_in_one_batch_are_each_row_alone(tokenizers: dict[str, Path]) -> None:
    """`rows` decodes and encodes the rows as lists (each distinct prompt once): every row gets
    what encoding it alone gives, with shared and given prompts, eos cuts and empty responses."""
    qwen = load_tokenizer_object(str(tokenizers["qwen"]))
    eos = qwen.eos_token_id
    prompt_ids = [qwen(t)["input_ids"] for t in ("How many?", "Count the apples.")]
    answers = ["It is 14.", "Seven", "", "14 apples, maybe 15."]
    responses = [qwen(a, add_special_tokens=False)["input_ids"] + [eos, 5] for a in answers] * 2
    prompts: list[str | None] = [None] * 6 + ["given", None]
    rows_prompt_ids = [prompt_ids[i % 2] for i in range(8)]  # rows of one prompt share its list
    for template, max_length in ((True, 512), (False, 6)):
        bridge = RewardText(str(tokenizers["qwen"]), str(tokenizers["other"]), chat_template=template,
                            max_length=max_length)
        rows, cut = bridge.rows(prompts, rows_prompt_ids, responses)
        alone = [bridge.encode(bridge.prompt_text(t, p), bridge.response_text(r))
                 for t, p, r in zip(prompts, rows_prompt_ids, responses)]
        assert rows == [ids[-max_length:] for ids in alone] and cut == [len(ids) > max_length for ids in alone]
        assert any(cut) == (not template)


def test_the_reward_tokenizers_backend_encodes_as_the_hf_call_does(tokenizers: dict[str, Path]) -> None:
    """`RewardText` encodes through the fast tokenizer's Rust backend (no per-row conversions)
    only where that gives the HF call's ids: the same ids with and without a chat template, an
    added special token in the text kept whole; with truncation set on the backend it takes the
    HF call, which gives the same rows (and clears that truncation, as it does for every call)."""
    for reward in ("qwen", "other", "plain"):
        template = reward == "other"
        bridge = RewardText(str(tokenizers["qwen"]), str(tokenizers[reward]), chat_template=template, max_length=512)
        special = bridge.reward.eos_token or ""
        texts = [bridge.render(p, r) for p, r in (("How many?", "It is 14."), ("Count" + special + " them", "7"),
                                                  ("", "x"), ("a" * 300, "b b b"))]
        assert bridge._plain_backend() is not None, reward
        through_backend = bridge._encode_texts(texts)
        bridge.reward.backend_tokenizer.enable_truncation(max_length=100_000)
        assert bridge._plain_backend() is None
        assert bridge._encode_texts(texts) == through_backend, reward
        assert bridge._plain_backend() is not None  # the HF call set the backend back to no truncation
        assert any(bridge.reward.convert_tokens_to_ids(special) in ids for ids in through_backend) == bool(special)
