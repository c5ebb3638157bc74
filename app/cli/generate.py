"""`python -m app generate --model HF_DIR --data prompts.jsonl --out out.jsonl [options]`.

Batch generation for users. Each input line is a JSON object with a `prompt` string; each output
line is `{"prompt", "response", "response_tokens", "logprobs"}` in input order.
`--temperature 0` means greedy. The tokenizer is `AutoTokenizer` from HF_DIR.

The layout (`--layout tp2,pp1`, dp allowed too) runs as Ray workers, one per rank
(app.run.jobs: a local Ray with virtual GPUs on CPU, or the cluster at RAY_ADDRESS). With
`--local` it runs through processes started here instead (torch.multiprocessing, gloo on CPU,
nccl on GPU, one process per GPU; a 1-rank layout in this process, on `--device`): every dp
replica generates its share of the prompts and the (tp 0, pp 0) rank of each replica writes its
results to a scratch file that this process merges, decodes and writes out.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli.inputs import check_at_least, check_inputs, check_sampling, checkpoint_and_layout
from app.data import read_text_column
from planning.layout import Layout
from planning.models import ModelSpec

if TYPE_CHECKING:  # torch-importing modules stay out of `python -m app plan`'s start-up
    from actors.generation import SamplingParams


def add_parser(subparsers: Any) -> None:
    """Register the `generate` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "generate", help="batch generation from a JSONL file of prompts with an HF checkpoint",
        description="Generate a response for every `prompt` of a JSONL file; write one JSON object per line.",
    )
    parser.add_argument("--model", required=True, metavar="HF_DIR",
                        help="HF checkpoint directory (config, weights, tokenizer)")
    parser.add_argument("--data", required=True, metavar="PROMPTS.jsonl",
                        help="one JSON object with a `prompt` per line")
    parser.add_argument("--out", required=True, metavar="OUT.jsonl", help="where to write the results")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="tp1,pp1", help="e.g. tp2,pp1 or dp2tp1pp2 (one process per rank)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generation call per dp replica")
    parser.add_argument("--local", action="store_true",
                        help="run the layout's ranks as local processes instead of Ray workers")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device of the local processes (with --local)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Validate (before torch or any worker starts), tokenize, generate (in this process or in one
    process per rank), write."""
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_sampling(args.temperature, args.top_p, args.top_k)
    check_at_least("--batch-size", args.batch_size, 1)
    check_at_least("--seed", args.seed, 0)
    out_path = check_inputs(args.data, args.out)
    model_dir, spec, layout = checkpoint_and_layout(args.model, args.layout)
    prompts = read_text_column(args.data, "prompt")

    import torch
    from transformers import AutoTokenizer

    from actors.generation import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < layout.world_size:
        raise ValueError(f"--layout {args.layout}: needs {layout.world_size} GPUs, {torch.cuda.device_count()} visible")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_ids = [tokenizer(text)["input_ids"] for text in prompts]
    empty = [i + 1 for i, ids in enumerate(token_ids) if not ids]
    if empty:
        raise ValueError(f"{args.data}: lines {empty} tokenize to no tokens")
    job = GenerationJob(str(model_dir), token_ids, args.max_new_tokens, sampling, args.seed,
                        tokenizer.eos_token_id, tokenizer.pad_token_id or 0, args.batch_size, device)
    if not args.local:  # one Ray worker per rank (app.run.jobs); the same sampling parameters
        from app.run import generate_on_ray

        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                  "top_p": args.top_p, "seed": args.seed, "eos_token_id": job.eos_token_id, "pad_token_id": job.pad_token_id}
        results = generate_on_ray(str(model_dir), spec, layout, token_ids, params, args.batch_size)
    else:
        with tempfile.TemporaryDirectory(prefix="realray-generate-") as scratch:
            run_layout(layout, job, scratch)
            results = merge_results(Path(scratch), layout.dp)
    with out_path.open("w") as sink:
        for prompt, (tokens, logprobs) in zip(prompts, results):
            record = {"prompt": prompt, "response": tokenizer.decode(tokens, skip_special_tokens=True),
                      "response_tokens": tokens, "logprobs": logprobs}
            sink.write(json.dumps(record) + "\n")
    print(f"wrote {len(results)} responses to {out_path}")
    return 0


def run_layout(layout: Layout, job: GenerationJob, scratch: str) -> None:
    """Run every rank of `layout` (here, or one spawned process per rank). A rank that runs out
    of memory or fails is reported as one ValueError line (exit status 2 at the CLI)."""
    import torch.multiprocessing as mp

    from actors.engine import free_port

    try:
        if layout.world_size == 1:
            generate_rank(0, layout, job, scratch, None)
        else:
            mp.spawn(generate_rank, args=(layout, job, scratch, free_port()), nprocs=layout.world_size, join=True)
    except MemoryError as exc:
        raise ValueError(str(exc)) from None
    except mp.ProcessRaisedException as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise ValueError(f"a generation process failed: {lines[-1] if lines else exc}") from None


@dataclass(frozen=True)
class GenerationJob:
    """Everything a rank needs (plain values, picklable for spawned processes)."""

    model_dir: str
    token_ids: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    eos_token_id: int | None
    pad_token_id: int
    batch_size: int
    device: str


def generate_rank(rank: int, layout: Layout, job: GenerationJob, scratch: str, port: int | None) -> None:
    """One rank: join the world (if several), load its shard, generate its dp share in batches."""
    import torch
    import torch.distributed as dist

    from actors.engine import ParallelGroups, build_model_shard, build_parallel_groups, load_hf_checkpoint
    from actors.generation import GenerationConfig, generate

    if port is not None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if job.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if job.device == "cuda" else "gloo", rank=rank, world_size=layout.world_size)
    groups = build_parallel_groups(layout) if port is not None else ParallelGroups.serial()
    device = torch.device(job.device, rank) if job.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if job.device == "cuda" else torch.float32
    spec = ModelSpec.from_hf_config(job.model_dir)
    coords = (groups.dp_rank, groups.tp_rank, groups.pp_rank)
    model_groups = groups if port is not None else None
    model = build_model_shard(spec, False, layout, coords, model_groups, device, torch.float32, seed=None)
    load_hf_checkpoint(job.model_dir, spec, False, model, groups.tp_rank, layout.tp)
    model = model.to(dtype).eval()
    config = GenerationConfig(job.max_new_tokens, job.sampling, seed=job.seed, eos_token_id=job.eos_token_id,
                              pad_token_id=job.pad_token_id, use_cuda_graph=job.device == "cuda")
    mine = list(range(groups.dp_rank, len(job.token_ids), layout.dp))  # this replica's prompts
    results: dict[int, tuple[list[int], list[float]]] = {}
    for start in range(0, len(mine), job.batch_size):
        chunk = mine[start:start + job.batch_size]
        prompts = [torch.tensor(job.token_ids[i], dtype=torch.int64, device=device) for i in chunk]
        out = generate(model, prompts, config, groups if port is not None else None)
        for i, tokens, logprobs in zip(chunk, out.responses(), out.response_logprobs()):
            results[i] = (tokens.tolist(), logprobs.tolist())
    if groups.tp_rank == 0 and groups.pp_rank == 0:
        Path(scratch, f"dp{groups.dp_rank}.json").write_text(json.dumps({str(k): v for k, v in results.items()}))
    if port is not None:
        dist.destroy_process_group()


def merge_results(scratch: Path, dp: int) -> list[tuple[list[int], list[float]]]:
    """Results of every dp replica, back in input order."""
    merged: dict[int, tuple[list[int], list[float]]] = {}
    for d in range(dp):
        part = json.loads((scratch / f"dp{d}.json").read_text())
        merged.update({int(k): (v[0], v[1]) for k, v in part.items()})
    return [merged[i] for i in range(len(merged))]


__all__ = ["add_parser", "merge_results", "run"]
