"""What it costs a shard to go from one call to the next on one worker, through Ray's object store.

    python3 benchmarks/shard_hop_bench.py                  # the peer bench's 64 prompts x 8 of 128 + 512 tokens
    python3 benchmarks/shard_hop_bench.py --prompts 2 --group 2 --hops 3   # a quick check

One Ray actor plays the peer bench's step on its host (no model, no GPU): `generate` returns a
shard of the generation call's shape (prompt ids, response ids and logprobs as `RowTensors`,
prompt texts, flags), `reward` reads it on the worker's model-free concurrency group as the rule
reward does and returns a reward per row, and `train` reads both. Each call stamps its start or
end, as `actors.worker.calls.timed` does, and the table gives, over the hops after `--warmup`:

* generation's end -> the reward call's start (the generation shard pickled, stored, fetched and
  unpickled);
* the reward call's start -> the training call's start (the generation shard unpickled again,
  the reward shard beside it).

The rest of the real calls (the model, the rule) is left out: docs/benchmarks.md, issue 27,
thirtieth step, has these hops before and after shards' columns went out of band.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray
import torch

from actors.worker.data import make_shard, merge_shards
from benchmarks.peer_setup import add_shape_arguments, require_positive

MODEL_FREE = "model_free"


def generation_shard(prompts: int, group: int, prompt_len: int, gen_len: int) -> dict[str, Any]:
    """A generation call's shard: each prompt's rows share its ids tensor, as generation hands them over."""
    gen = torch.Generator().manual_seed(0)
    rows = prompts * group
    distinct = [torch.randint(0, 128_000, (prompt_len,), generator=gen) for _ in range(prompts)]
    return make_shard(0, {
        "prompt_ids": [distinct[r // group] for r in range(rows)],
        "response_ids": [torch.randint(0, 128_000, (gen_len,), generator=gen) for _ in range(rows)],
        "logprobs": [torch.randn(gen_len, generator=gen) for _ in range(rows)],
        "no_eos": [True] * rows,
        "prompt_index": [r // group for r in range(rows)],
        "prompt": [f"prompt {r // group} " + "word " * prompt_len for r in range(rows)],
    })


@ray.remote(concurrency_groups={MODEL_FREE: 1})
class HopWorker:
    """Three calls of one worker, each stamping wall-clock seconds as the real calls do."""

    def generate(self, prompts: int, group: int, prompt_len: int, gen_len: int) -> tuple[dict[str, float], dict]:
        shard = generation_shard(prompts, group, prompt_len, gen_len)
        return {"end": time.time()}, shard

    @ray.method(concurrency_group=MODEL_FREE)
    def reward(self, shard: dict[str, Any]) -> tuple[dict[str, float], dict]:
        start = time.time()
        n = int(shard["n"])
        cols = merge_shards([shard], range(n), ["response_ids"], optional=["prompt", "prompt_index"])
        return {"start": start}, make_shard(0, {"rewards": [float(len(r)) for r in cols["response_ids"]]})

    def train(self, generated: dict[str, Any], rewarded: dict[str, Any]) -> dict[str, float]:
        start = time.time()
        merge_shards([generated, rewarded], range(int(generated["n"])), ["prompt_ids", "response_ids", "rewards"])
        return {"start": start}


def measure_hops(worker: Any, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(generation end -> reward start, reward start -> training start) seconds of every hop."""
    hops = []
    for _ in range(args.warmup + args.hops):
        meta_gen, shard = worker.generate.options(num_returns=2).remote(args.prompts, args.group, args.prompt_len,
                                                                        args.gen_len)
        meta_reward, rewards = worker.reward.options(num_returns=2).remote(shard)
        meta_train = worker.train.remote(shard, rewards)
        gen, reward, train = ray.get([meta_gen, meta_reward, meta_train])
        hops.append((reward["start"] - gen["end"], train["start"] - reward["start"]))
    return hops[args.warmup:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--hops", type=int, default=10, help="timed hops")
    parser.add_argument("--warmup", type=int, default=2, help="hops run first, not timed")
    args = parser.parse_args(argv)
    require_positive(parser, args, ("prompts", "group", "prompt_len", "gen_len", "hops"))
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}: must be >= 0")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        hops = measure_hops(HopWorker.remote(), args)
    finally:
        if started:
            ray.shutdown()
    print(f"\nshard hops on one worker: {args.prompts} prompts x {args.group} of {args.prompt_len} + "
          f"{args.gen_len} tokens, {args.hops} hops after {args.warmup}")
    print(f"{'hop':<34} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, k in (("generation end -> reward start", 0), ("reward start -> training start", 1)):
        ms = [1e3 * hop[k] for hop in hops]
        print(f"{name:<34} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
