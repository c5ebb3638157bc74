"""`python -m app score --model HF_DIR --data texts.jsonl --layout tp2,pp2 --out out.jsonl` on Ray.

Per-token logprobs of given texts under an HF checkpoint, computed by one Ray worker per rank of
the layout (virtual GPUs on CPU when there is no CUDA; the cluster at `RAY_ADDRESS` otherwise).
Each input line is a JSON object with a `text` string; each output line, in input order, is
`{"text", "tokens", "logprobs"}`: the token ids of the text tokenised without adding special
tokens, and log p(token_i | tokens_<i) for every token after the first (so one fewer than
tokens; a one-token text has none).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from app.cli.inputs import check_at_least, check_inputs, checkpoint_and_layout
from app.data import read_text_column
from planning.layout import Layout
from planning.models import ModelSpec


def add_parser(subparsers: Any) -> None:
    """Register the `score` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "score", help="per-token logprobs of texts under an HF checkpoint, on Ray",
        description="Write the token ids and per-token logprobs of every `text` of a JSONL file.",
    )
    parser.add_argument("--model", required=True, metavar="HF_DIR", help="HF checkpoint directory (config, weights, tokenizer)")
    parser.add_argument("--data", required=True, metavar="TEXTS.jsonl", help="one JSON object with a `text` per line")
    parser.add_argument("--out", required=True, metavar="OUT.jsonl", help="where to write the results")
    parser.add_argument("--layout", default="tp1,pp1", help="e.g. tp2,pp2 or dp2tp1pp1 (one worker per rank)")
    parser.add_argument("--batch-size", type=int, default=64, help="texts per call")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Validate everything before Ray starts, then score in batches and write the results."""
    check_at_least("--batch-size", args.batch_size, 1)
    out_path = check_inputs(args.data, args.out)
    model_dir, spec, layout = checkpoint_and_layout(args.model, args.layout)
    texts = read_text_column(args.data, "text")
    if args.batch_size < layout.dp:
        raise ValueError(f"--batch-size={args.batch_size}: must be >= dp={layout.dp}")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    logprobs = score_tokens(str(model_dir), spec, layout, tokens, args.batch_size)
    with out_path.open("w") as sink:
        for text, ids, values in zip(texts, tokens, logprobs):
            sink.write(json.dumps({"text": text, "tokens": ids, "logprobs": values}) + "\n")
    print(f"wrote {len(texts)} scored texts to {out_path}")
    return 0


def score_tokens(model_dir: str, spec: ModelSpec, layout: Layout, tokens: list[list[int]],
                 batch_size: int) -> list[list[float]]:
    """Logprobs of tokens[1:] of every token list (empty for lists shorter than 2), on Ray."""
    import torch

    from app.run import LayoutJob, column

    # A text is scored as prompt = its first token, response = the rest: the worker's logprobs op.
    scored = [i for i, ids in enumerate(tokens) if len(ids) >= 2]
    out: list[list[float]] = [[] for _ in tokens]
    if not scored:
        return out
    with LayoutJob(model_dir, spec, layout) as job:
        for start in range(0, len(scored), batch_size):
            chunk = scored[start:start + batch_size]
            if len(chunk) < layout.dp:  # the last chunk: every dp rank needs a row
                chunk = scored[max(len(scored) - layout.dp, 0):]
            rows = {"prompt_ids": [torch.tensor(tokens[i][:1]) for i in chunk],
                    "response_ids": [torch.tensor(tokens[i][1:]) for i in chunk]}
            shards = job.run("score", "inference", rows, {"op": "logprobs", "temperature": 1.0, "out_key": "logprobs"})
            for i, values in zip(chunk, column(shards, "logprobs")):
                out[i] = [float(v) for v in values.tolist()]
    return out


__all__ = ["add_parser", "run", "score_tokens"]
