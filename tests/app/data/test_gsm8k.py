"""Tests of app.data.gsm8k: the shipped GSM8K-format problems, their conversion into prompt files
(from JSONL and from the Parquet layout of the public dataset), its errors, and the reward on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.data.datasets import load_prompt_records
from app.data.gsm8k import GSM8K_INSTRUCTION, final_answer, prepare_gsm8k
from app.data.rewards import math_exact_match

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "examples" / "data" / "gsm8k_tiny.jsonl"


def shipped_rows() -> list[dict[str, str]]:
    return [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]


def test_shipped_problems_are_gsm8k_format_and_their_solutions_score_one() -> None:
    rows = shipped_rows()
    assert len(rows) >= 32 and all(set(r) == {"question", "answer"} for r in rows)
    for row in rows:
        steps, final = row["answer"].rsplit("####", 1)
        assert final.strip() == final_answer(row["answer"], "shipped")
        # The worked steps end with the final number, so a model that writes them is rewarded...
        assert math_exact_match(row["question"], steps, row["answer"]) == 1.0, row
        # ...and one that stops before the last step is not.
        assert math_exact_match(row["question"], steps.rsplit("\n", 2)[0] + " 0", row["answer"]) == 0.0


def test_prepare_from_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = shipped_rows()
    assert prepare_gsm8k(SHIPPED, tmp_path / "from_jsonl.jsonl") == len(rows)
    # The public dataset's layout: main/train-00000-of-00001.parquet with columns question, answer.
    parquet = tmp_path / "main" / "train-00000-of-00001.parquet"
    parquet.parent.mkdir()
    pq.write_table(pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}),
                   parquet)
    assert prepare_gsm8k(parquet, tmp_path / "out" / "train.jsonl", limit=5) == 5
    converted = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    first = converted[0]
    assert first["prompt"] == f"{rows[0]['question']} {GSM8K_INSTRUCTION}"
    assert first["answer"] == rows[0]["answer"] and first["ground_truth"] == "17"
    # What `train` reads from it: prompt and answer (the reward's reference).
    records = load_prompt_records(tmp_path / "from_jsonl.jsonl")
    assert [r.answer for r in records] == [r["answer"] for r in rows]


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, "line 1: field 'answer' is missing or not a string"),
    ({"question": "q", "answer": "42"}, "line 1: field 'answer' has no '####'"),
    ({"question": "q", "answer": "so #### about 4"}, "ends with #### 'about 4'; expected a number"),
    ({"prompt": "q", "answer": "#### 4"}, "field 'question' is missing.*fields: answer, prompt"),
])
def test_bad_rows_name_the_file_line_and_field(tmp_path: Path, row: dict[str, str], message: str) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        prepare_gsm8k(source, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()  # nothing half-written
    assert final_answer("x\n#### 1,234", "s") == "1234"


def test_prepare_script_exit_codes(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = ROOT / "scripts" / "prepare_gsm8k.py"
    ok = subprocess.run([sys.executable, str(script), str(SHIPPED), str(tmp_path / "p.jsonl"), "--limit", "3"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0 and "3 problems ->" in ok.stdout
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "none.parquet"), str(tmp_path / "q.jsonl")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr
