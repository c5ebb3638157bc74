#!/usr/bin/env python3
"""Turn GSM8K (the Parquet files of `hf download openai/gsm8k --repo-type dataset`, or any
JSONL / Parquet with `question` and `answer` ending in `#### N`) into the prompt JSONL that
`python -m app train` reads (data.path): one {"prompt", "answer", "ground_truth"} object a line.

    python3 scripts/prepare_gsm8k.py data/gsm8k/main/train-00000-of-00001.parquet data/gsm8k/train.jsonl
    python3 scripts/prepare_gsm8k.py examples/data/gsm8k_tiny.jsonl /tmp/gsm8k_tiny_prompts.jsonl --limit 16

Bad input exits with status 2 and one line naming the file, the line and the field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

from app.data import GSM8K_INSTRUCTION, prepare_gsm8k  # after the path line above: this checkout's app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GSM8K Parquet or JSONL file (question, answer)")
    parser.add_argument("target", help="prompt JSONL to write")
    parser.add_argument("--limit", type=int, help="keep only the first N problems")
    parser.add_argument("--instruction", default=GSM8K_INSTRUCTION,
                        help=f"text appended to every question (default: {GSM8K_INSTRUCTION!r})")
    args = parser.parse_args(argv)
    try:
        written = prepare_gsm8k(args.source, args.target, args.instruction, args.limit)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{written} problems -> {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
