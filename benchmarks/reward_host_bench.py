"""Host seconds of the reward calls that run no GPU work of their own, at the peer bench's shape.

    python3 benchmarks/reward_host_bench.py                 # 64 prompts x 8 of 128 + 512 tokens
    python3 benchmarks/reward_host_bench.py --prompts 2 --group 2 --vocab 1024 --repeats 1   # a quick check

Two calls of a worker's host (CPU only; no model, no Ray), with the peer bench's tokenizer (the
byte-level BPE of benchmarks/peer_setup.py, 128,256 tokens by default) and random ids:

* `rule_reward`: `ModelWorker.run_call` of the op the peer bench's rew_inf runs (decode every
  prompt and response with the actor's tokenizer, then benchmarks/peer_reward.py's length rule per
  row under the reward time limit), beside the cost model's price of it
  (planning.cost_terms.BYTE_TABLE_S_PER_TOKEN per response token, as preflight prices a
  byte-level tokenizer's rule reward);
* `RewardText.rows`: what a reward model with another tokenizer does before its forward (decode,
  render, re-tokenize; here the same tokenizer on both sides and no chat template);
* the responses' decoding alone, both ways: the tokenizers backend's `decode_batch` (the path of
  tokenizers without a byte-level decoder) and the byte table (actors.worker.byte_level), which
  the calls above take with this byte-level tokenizer.

Each is run once to warm up, then `--repeats` times; the table gives the median and the range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from benchmarks.peer_setup import SPECIALS, add_shape_arguments, byte_level_bpe, require_positive


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of `repeats` runs of fn after one warm-up run."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--vocab", type=int, default=128_256, help="the tokenizer's size (peer bench: 128,256)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    require_positive(parser, args, ("prompts", "group", "prompt_len", "gen_len", "repeats"))
    if args.vocab < 1024:
        parser.error(f"--vocab={args.vocab}: must be >= 1024 (the byte alphabet, specials and merges)")

    from transformers import PreTrainedTokenizerFast

    from actors.worker import CallSpec, ModelWorker
    from actors.worker.texts import byte_table
    from app.data.tokenizers import RewardText
    from planning.cost_terms import BYTE_TABLE_S_PER_TOKEN
    from planning.layout import Layout, Mesh
    from planning.plan import Placement

    rows = args.prompts * args.group
    gen = torch.Generator().manual_seed(0)
    top = args.vocab - 256  # ids below the specials
    prompts = [torch.randint(0, top, (args.prompt_len,), generator=gen) for _ in range(args.prompts)]
    # The samples of one prompt share its tensor, as generation hands them over.
    shard = {"row_start": 0, "n": rows, "prompt_ids": [prompts[i // args.group] for i in range(rows)],
             "response_ids": [torch.randint(0, top, (args.gen_len,), generator=gen) for _ in range(rows)],
             "prompt_index": [i // args.group for i in range(rows)]}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(args.vocab), bos_token=SPECIALS[0],
                                            eos_token=SPECIALS[1], pad_token=SPECIALS[2])
        tokenizer.save_pretrained(tmp)
        worker = ModelWorker(0, 1, "cpu")
        call = CallSpec("rew_inf", "reward", "inference", Placement(Mesh(0, 1, 1), Layout()), 0, rows,
                        {"op": "rule_reward", "reward_fn": "benchmarks.peer_reward:response_length", "tokenizer": tmp})
        rule = timings(lambda: worker.run_call(call, shard), args.repeats)
        bridge = RewardText(tmp, tmp, chat_template=False, max_length=args.prompt_len + args.gen_len + 16)
        prompt_ids = [t.tolist() for t in shard["prompt_ids"]]
        response_ids = [t.tolist() for t in shard["response_ids"]]
        retokenize = timings(lambda: bridge.rows([None] * rows, prompt_ids, response_ids), args.repeats)
        table = byte_table(tokenizer)
        if table is None:
            raise SystemExit("reward_host_bench: the byte-level tokenizer has no byte table (its probe failed)")
        backend = timings(lambda: tokenizer.backend_tokenizer.decode_batch(response_ids, skip_special_tokens=True),
                          args.repeats)
        through_table = timings(lambda: table.decode_tensors(shard["response_ids"]), args.repeats)

    estimate = rows * args.gen_len * BYTE_TABLE_S_PER_TOKEN  # what preflight prices a byte-level tokenizer's call at
    print(f"\nreward host work: {args.prompts} prompts x {args.group} of {args.prompt_len} + {args.gen_len} tokens, "
          f"vocabulary {args.vocab}, median of {args.repeats} after a warm-up")
    print(f"{'call':<18} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'plan est ms':>11}")
    for name, seconds, est in (("rule_reward", rule, f"{1e3 * estimate:.3g}"), ("RewardText.rows", retokenize, "-"),
                               ("decode: backend", backend, "-"), ("decode: byte table", through_table, "-")):
        ms = [1e3 * s for s in seconds]
        print(f"{name:<18} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f} {est:>11}")


if __name__ == "__main__":
    main()
