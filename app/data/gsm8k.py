"""GSM8K-format math problems turned into the prompt files `train` reads.

GSM8K rows (the public `openai/gsm8k` Parquet files, or `examples/data/gsm8k_tiny.jsonl`) hold a
`question` and an `answer`: worked steps, then `#### N` with the final number. `prepare_gsm8k`
writes one JSONL line per problem:

    {"prompt": "<question> <instruction>", "answer": "<the full answer>", "ground_truth": "N"}

The instruction (veRL's GSM8K recipe) asks the model to end with `#### N`; the reward
`app.data.rewards:math_exact_match` compares the last number of a response with the text after
`####` of `answer`. `ground_truth` is that number alone, for people reading the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.data.datasets import read_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FINAL_MARK = "####"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(answer: str, source: str) -> str:
    """The number after the last `####` of a GSM8K answer ("1,000" -> "1000"); ValueError
    naming `source` ("file line N") when there is none."""
    if FINAL_MARK not in answer:
        raise ValueError(f"{source}: field 'answer' has no {FINAL_MARK!r} before the final number "
                         f"(GSM8K format: worked steps, then '#### N')")
    text = answer.rsplit(FINAL_MARK, 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"{source}: field 'answer' ends with {FINAL_MARK} {text[:40]!r}; expected a number")
    return text


def gsm8k_prompt_rows(rows: Iterable[tuple[int, dict[str, Any]]], path: Path, instruction: str = GSM8K_INSTRUCTION,
                      limit: int | None = None) -> list[dict[str, str]]:
    """Prompt rows (prompt, answer, ground_truth) of GSM8K rows given as (line, record) pairs."""
    out = []
    for line_no, row in rows:
        if limit is not None and len(out) >= limit:
            break
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path} line {line_no}: field {key!r} is missing or not a string "
                                 f"(fields: {', '.join(sorted(row)) or 'none'}); GSM8K rows hold question and answer")
        question, answer = row["question"].strip(), row["answer"].strip()
        truth = final_answer(answer, f"{path} line {line_no}")
        prompt = f"{question} {instruction}".strip()
        out.append({"prompt": prompt, "answer": answer, "ground_truth": truth})
    return out


def prepare_gsm8k(source: str | Path, target: str | Path, instruction: str = GSM8K_INSTRUCTION,
                  limit: int | None = None) -> int:
    """Convert a GSM8K Parquet / JSONL file into a prompt JSONL file; returns the rows written.

    Bad input (a missing file, a row without question or answer, an answer without `#### N`)
    raises FileNotFoundError / ValueError naming the file and the line, before anything is written.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit={limit}: must be >= 1")
    source, target = Path(source), Path(target)
    rows = gsm8k_prompt_rows(read_rows(source), source, instruction, limit)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as sink:
        for row in rows:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


__all__ = ["GSM8K_INSTRUCTION", "final_answer", "gsm8k_prompt_rows", "prepare_gsm8k"]
