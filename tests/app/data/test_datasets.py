"""Tests of app.data.datasets: file readers and their errors, tokenisers (toy and a tiny offline HF
tokenizer), tokenised datasets, and the seeded, resumable batch iterator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from app.data.datasets import (
    BatchIterator,
    IteratorState,
    PromptRecord,
    build_prompt_dataset,
    load_preference_records,
    load_prompt_records,
    load_tokenizer,
    tokenize_preferences,
    tokenize_prompts,
)
from app.data.toy_task import BOS_ID, EOS_ID, SHIPPED_TOY_PATH

pytestmark = pytest.mark.unit


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_jsonl_with_custom_keys(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"question": "1+1?", "solution": 2}), "", json.dumps({"question": "hi"}),
    ])
    records = load_prompt_records(path, prompt_key="question", answer_key="solution")
    assert records == [PromptRecord("1+1?", "2", f"{path}:1"), PromptRecord("hi", None, f"{path}:3")]
    with pytest.raises(ValueError, match=r"p\.jsonl line 3: no field 'solution'"):
        load_prompt_records(path, prompt_key="question", answer_key="solution", require_answer=True)


def test_load_prompts_json_array(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b", "answer": "x"}]))
    assert [(r.prompt, r.answer) for r in load_prompt_records(path)] == [("a", None), ("b", "x")]


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "ok"}', '{"prompt": oops}'], r"bad\.jsonl line 2: invalid JSON"),
    (['{"prompt": "ok"}', '{"text": "no prompt"}'], r"bad\.jsonl line 2: no field 'prompt' \(fields: text\)"),
    (['{"prompt": 5}'], r"bad\.jsonl line 1: field 'prompt' is a int"),
    (['[1, 2]'], r"bad\.jsonl line 1: expected a JSON object"),
    (['', '   '], r"bad\.jsonl: empty dataset"),
])
def test_prompt_file_errors_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        load_prompt_records(path)


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_records(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="unknown dataset format '.csv'; allowed: .jsonl, .json, .parquet"):
        load_prompt_records(tmp_path / "data.csv")


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            load_prompt_records(path)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), path)
    assert [(r.prompt, r.answer) for r in load_prompt_records(path)] == [("a", "1"), ("b", None)]


def test_preference_records_and_tokenisation(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "pairs.jsonl", [
        json.dumps({"q": "12", "good": "34", "bad": "x"}),
        json.dumps({"q": "5", "good": "6", "bad": "a very long rejected answer"}),
    ])
    records = load_preference_records(path, prompt_key="q", chosen_key="good", rejected_key="bad")
    examples = tokenize_preferences(records, load_tokenizer("toy"), max_len=10)
    assert len(examples) == 1 and examples[0].index == 0  # the second pair is too long
    assert examples[0].prompt_ids == (BOS_ID, ord("1"), ord("2"))
    assert examples[0].chosen_ids == (ord("3"), ord("4"), EOS_ID) and examples[0].rejected_ids == (ord("x"), EOS_ID)
    with pytest.raises(ValueError, match=r"pairs\.jsonl line 1: no field 'rejected'"):
        load_preference_records(path, prompt_key="q", chosen_key="good")


def test_tokenize_prompts_with_toy_tokenizer_and_length_policies() -> None:
    records = load_prompt_records(SHIPPED_TOY_PATH)
    tok = load_tokenizer("toy")
    examples = tokenize_prompts(records, tok, max_prompt_len=6, too_long="drop")
    assert all(len(e.prompt_ids) <= 6 and e.prompt_ids[0] == BOS_ID for e in examples)
    assert 0 < len(examples) < len(records)
    assert all(records[e.index].prompt == e.prompt for e in examples)
    truncated = tokenize_prompts(records, tok, max_prompt_len=4, too_long="truncate_left")
    assert len(truncated) == len(records) and all(len(e.prompt_ids) <= 4 for e in truncated)
    with pytest.raises(ValueError, match="prompt has 9 tokens > max_prompt_len=6"):
        tokenize_prompts([PromptRecord("12345678", None, "f:1")], tok, max_prompt_len=6)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize_prompts(records, tok, chat_template=True)


def test_build_prompt_dataset_from_toy_and_file() -> None:
    tok = load_tokenizer("toy")
    toy = build_prompt_dataset("toy", tok, toy_size=50, toy_seed=0)
    shipped = build_prompt_dataset(SHIPPED_TOY_PATH, tok)
    assert len(toy) == 50 and [e.prompt_ids for e in toy] == [e.prompt_ids for e in shipped[:50]]
    assert all(e.answer is not None and tok.decode(list(e.prompt_ids)) == e.prompt for e in toy)


def test_hf_tokenizer_with_chat_template(tmp_path: Path) -> None:
    """A tiny word-level HF tokenizer saved to disk and loaded back through AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5, "user": 6, "assistant": 7, ":": 8}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>")
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                        "{% if add_generation_prompt %}assistant : {% endif %}")
    hf.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    record = PromptRecord("hello world", None, "f:1")
    assert tokenize_prompts([record], tok)[0].prompt_ids == (4, 5)
    assert tokenize_prompts([record], tok, chat_template=True)[0].prompt_ids == (6, 8, 4, 5, 7, 8)
    assert tok.encode_completion("world") == [5, 2]
    assert tok.decode([4, 5, 2]) == "hello world"
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_tokenizer(str(tmp_path / "missing"))


def test_batch_iterator_epochs_are_permutations_and_deterministic() -> None:
    items = list(range(10))
    it = BatchIterator(items, batch_size=3, seed=7)
    assert it.batches_per_epoch == 3
    epoch0 = [it.next_batch() for _ in range(3)]
    seen0 = sorted(x for b in epoch0 for x in b)
    assert len(set(seen0)) == 9 and all(len(b) == 3 for b in epoch0)  # one item dropped (drop_last)
    first_of_epoch1 = it.next_batch()
    assert it.state == IteratorState(epoch=1, position=3)
    again = BatchIterator(items, batch_size=3, seed=7)
    assert [again.next_batch() for _ in range(4)] == epoch0 + [first_of_epoch1]
    other_seed = BatchIterator(items, batch_size=3, seed=8)
    assert [other_seed.next_batch() for _ in range(3)] != epoch0
    assert list(it.epoch_order(1)) != list(it.epoch_order(2))


def test_batch_iterator_resumes_exactly() -> None:
    items = [f"item{i}" for i in range(11)]
    straight = BatchIterator(items, batch_size=4, seed=1)
    reference = [straight.next_batch() for _ in range(7)]
    first = BatchIterator(items, batch_size=4, seed=1)
    head = [next(first) for _ in range(3)]
    resumed = BatchIterator(items, batch_size=4, seed=1, state=first.state)
    assert head + [resumed.next_batch() for _ in range(4)] == reference


def test_batch_iterator_without_shuffle_or_drop_last() -> None:
    it = BatchIterator(list(range(5)), batch_size=2, shuffle=False, drop_last=False)
    assert [it.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert it.batches_per_epoch == 3
    with pytest.raises(ValueError, match="batch_size=6 > dataset size 5"):
        BatchIterator(list(range(5)), batch_size=6)
    with pytest.raises(ValueError, match="position <= 5"):
        BatchIterator(list(range(5)), batch_size=2, state=IteratorState(epoch=1, position=9))
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchIterator(list(range(5)), batch_size=0)
