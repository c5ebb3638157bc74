"""Multi-turn generation against single-turn generation of the same sampled tokens (issue 24).

    python benchmarks/multiturn_bench.py              # one H200: Llama-3.2-1B shape, bf16, CUDA graphs
    python benchmarks/multiturn_bench.py --tiny       # seconds on CPU (checks the script)
    python benchmarks/multiturn_bench.py --spread     # + trajectories of 1..4 turns, finished ones dropped or kept

The issue's target shape: 64 prompts x 8 trajectories, 4 turns of up to 128 sampled tokens (EOS
ignored, so every turn samples exactly 128), 32-token observations from an environment that sleeps
20 ms per step (app.envs.sessions.EnvSessions with the toy character tokenizer, so observations
are 32 ids; a thread per trajectory). Beside it, single-turn generation (`generate`) of the same
prompts sampling 4 x 128 = 512 tokens each: the same sampled tokens, no observations, no waits.

Reported: seconds of each, their ratio (target <= 1.3), the decode loop's counters (decode steps,
observation prefills) and the GPU idle gaps: the loop blocks in `poll` only while no trajectory is
decoding, so the longest such wait is the longest gap with nothing for the GPU to do (target: no
gap longer than one environment step plus the loop's own latency). Random weights; one warm-up
call of each before the timed ones.

--spread (issue 27, finished rows leave the decode step): trajectory i's environment ends it after
1 + i % turns turns, so a quarter of the rows stop after each turn; the multi-turn call is timed
keeping every row in the decode step (compact_fraction 0) and dropping the finished ones (0.75).

--read-lags 0,2: the multi-turn call timed with the host reading each decode step's ids
immediately (0: it waits for step k before it queues step k+1) and up to 2 steps later (the
loop's default, `READ_LAG`): the same ids either way, and how much of the call the host's stalls
cost the GPU. With --mean-turn-len N those calls (last, after the rest) run on weights with an EOS
planted (benchmarks/planted_eos.py): turns end at EOS after about N tokens (cut at --turn-tokens),
so trajectories pause and resume at different steps, as an agent's tool calls do.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from actors.generation import generate, generate_turns
from actors.generation.decoding import GenerationConfig
from actors.generation.multiturn import READ_LAG
from actors.generation.sampling import SamplingParams
from app.data.toy_task import CharTokenizer
from app.envs.sessions import EnvSessions
from benchmarks.generate_bench import build_random_model
from benchmarks.planted_eos import plant_eos
from planning.layout import Layout
from planning.models import model_preset

H200_BANDWIDTH = 4.3e12


class WideTokenizer(CharTokenizer):
    """The toy character tokenizer, decoding any id of a large vocabulary (ids past 255 as "~"),
    so random actions of a 128k-vocabulary model reach the environment as text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode([int(t) if int(t) < 256 else ord("~") for t in ids], skip_special_tokens)


class SleepyEnv:
    """Sleeps `sleep_s` per step and answers `obs_chars` digits; never done (max_turns ends it)."""

    def __init__(self, sleep_s: float = 0.02, obs_chars: int = 32, spread: int = 0) -> None:
        self.sleep_s, self.obs_chars, self.spread = float(sleep_s), int(obs_chars), int(spread)
        self.turn, self.last = 0, None

    def reset(self, sample: dict) -> str:
        # spread: sample i ends after 1 + i % spread turns (0: never done, max_turns ends it).
        self.turn, self.last = 0, (1 + int(sample["prompt"]) % self.spread) if self.spread else None
        return "x" * 8

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        time.sleep(self.sleep_s)
        self.turn += 1
        return "7" * self.obs_chars, 0.0, self.last is not None and self.turn >= self.last, {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny model and shape (checks the script)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--obs-tokens", type=int, default=32)
    parser.add_argument("--env-sleep-s", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-graph", action="store_true", help="eager decode steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--spread", action="store_true", help="also time trajectories of 1..turns turns with "
                        "finished rows kept in the decode step and dropped (compact_fraction 0 / 0.75)")
    parser.add_argument("--read-lags", default="", help="comma-separated read_lag values to time the multi-turn "
                        "call with (e.g. 0,2); the default run uses the loop's READ_LAG")
    parser.add_argument("--mean-turn-len", type=float, default=0.0, help="with --read-lags: plant an EOS so turns "
                        "end after about this many tokens (0: every turn samples --turn-tokens)")
    parser.add_argument("--profile", action="store_true", help="after the timed calls, profile one multi-turn call "
                        "and print its kernels by device time")
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.group, args.prompt_len, args.turn_tokens, args.obs_tokens = 4, 2, 8, 6, 4
        args.repeats = 1
    return args


def sessions(args: argparse.Namespace, n: int, turns: int | None = None, spread: int = 0) -> EnvSessions:
    """The call's environments: SleepyEnv through the real EnvSessions (threads, timeouts), reset."""
    source = EnvSessions(
        env=f"{Path(__file__).resolve()}:SleepyEnv", samples=[{"prompt": str(i)} for i in range(n)],
        tokenizer=f"{Path(__file__).resolve()}:WideTokenizer", chat_template=False, observation_role="user",
        max_turns=turns or args.turns, max_observation_tokens=args.obs_tokens, env_timeout_s=30.0, env_workers=n,
        reward_discount=1.0, env_kwargs={"sleep_s": args.env_sleep_s, "obs_chars": args.obs_tokens, "spread": spread},
    )
    source.prompts()  # resets the environments; the trajectories start from the single-turn prompts
    return source


def timed(fn, device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def cache_error(model: torch.nn.Module, prompts: list[torch.Tensor], out: object, rows: int = 8) -> float:
    """Largest |logprob| difference on sampled positions between the loop (observations prefilled on
    each trajectory's cache) and one fresh forward over the whole conversation, for a few rows."""
    from actors.engine.packing import pack_sequences

    worst = 0.0
    for i in range(min(rows, len(prompts))):
        seq = torch.cat([prompts[i].cpu(), out.responses[i]]).to(prompts[i].device)
        tokens, batch = pack_sequences([seq])
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens, batch).float(), dim=-1)
        p = prompts[i].numel()
        positions = torch.arange(p - 1, seq.numel() - 1, device=seq.device)
        fresh = logp[positions, seq[positions + 1]].cpu()
        mask = out.response_masks[i].bool()
        worst = max(worst, float((fresh[mask] - out.logprobs[i][mask]).abs().max()))
    return worst


def profile_call(name: str, fn, device: torch.device, table: bool) -> None:
    """One call under torch.profiler: how much of its time the device was busy, its idle gaps by
    size, and (table) the 15 kernels and ops with the most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds, _ = timed(fn, device)
    if device.type == "cuda":
        spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                       if e.device_type() == torch.autograd.DeviceType.CUDA)
        busy, gaps, end = 0, [], spans[0][0] if spans else 0
        for start, stop in spans:  # union of the device's intervals; the holes between them
            if start > end:
                gaps.append((start - end) / 1e9)
            busy += max(0, stop - max(start, end))
            end = max(end, stop)
        small = [g for g in gaps if g < 1e-3]
        large = [g for g in gaps if g >= 1e-3]
        print(f"{name}: {seconds:.3f} s under the profiler, device busy {busy / 1e9:.3f} s; idle gaps < 1 ms: "
              f"{len(small)} ({sum(small) * 1000:.0f} ms), >= 1 ms: {len(large)} ({sum(large) * 1000:.0f} ms, "
              f"longest {max(large, default=0) * 1000:.1f} ms)")
    if table:
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def profile_calls(args: argparse.Namespace, model: torch.nn.Module, prompts: list[torch.Tensor],
                  single_cfg: GenerationConfig, turn_cfg: GenerationConfig, budget: int) -> None:
    """--profile: one single-turn call, one multi-turn call (with its kernel table) and the loop
    alone, each under torch.profiler."""
    device, n = prompts[0].device, len(prompts)
    profile_call("single-turn", lambda: generate(model, prompts, single_cfg), device, table=False)
    profile_call("multi-turn", lambda: generate_turns(model, prompts, turn_cfg, budget, sessions(args, n)), device,
                 table=True)
    profile_call("loop alone", lambda: generate_turns(model, prompts, single_cfg, args.turns * args.turn_tokens + 1,
                                                      sessions(args, n, turns=1)), device, table=False)


def median_turns_call(args: argparse.Namespace, model: torch.nn.Module, prompts: list[torch.Tensor],
                      config: GenerationConfig, budget: int, spread: int = 0,
                      read_lag: int = READ_LAG) -> tuple[float, object]:
    """Median seconds of `--repeats` multi-turn calls after a warm-up (environments reset outside
    the timing), and the last call's output."""
    seconds = []
    for repeat in range(args.repeats + 1):
        source = sessions(args, len(prompts), spread=spread)
        elapsed, out = timed(lambda: generate_turns(model, prompts, config, budget, source, read_lag=read_lag),
                             prompts[0].device)
        source.close()
        if repeat:  # the first is a warm-up
            seconds.append(elapsed)
    return statistics.median(seconds), out


def spread_calls(args: argparse.Namespace, model: torch.nn.Module, prompts: list[torch.Tensor],
                 turn_cfg: GenerationConfig, budget: int) -> list[str]:
    """Table rows: trajectories of 1..turns turns, keeping and dropping the finished rows (median
    seconds of the repeats after a warm-up of each); both must sample the same ids."""
    rows, outputs = [], {}
    for fraction in (0.0, 0.75):
        config = dataclasses.replace(turn_cfg, compact_fraction=fraction)
        seconds, out = median_turns_call(args, model, prompts, config, budget, spread=args.turns)
        outputs[fraction] = out
        rows.append(f"| 1..{args.turns} turns, compact_fraction {fraction} ({out.stats['compactions']:.0f} "
                    f"compactions, {out.stats['decode_steps']:.0f} steps) | {seconds:.3f} s |")
    same = sum(a.tolist() == b.tolist() for a, b in zip(outputs[0.0].responses, outputs[0.75].responses))
    rows.append(f"| 1..{args.turns} turns: trajectories the same either way | {same}/{len(prompts)} |")
    return rows


def lag_calls(args: argparse.Namespace, model: torch.nn.Module, prompts: list[torch.Tensor],
              turn_cfg: GenerationConfig, budget: int) -> list[str]:
    """Table rows: the multi-turn call at each --read-lags value (median seconds of the repeats
    after a warm-up of each; sessions reset outside the timing); all must sample the same ids.
    --mean-turn-len plants an EOS in `model` first (it stays planted)."""
    rows, outputs = [], []
    if args.mean_turn_len:
        eos = model.spec.eos_token_id if model.spec.eos_token_id is not None else 1
        plant_eos(model, eos, args.mean_turn_len)
        turn_cfg = dataclasses.replace(turn_cfg, ignore_eos=False, eos_token_id=eos)
    for lag in [int(x) for x in args.read_lags.split(",")]:
        seconds, out = median_turns_call(args, model, prompts, turn_cfg, budget, read_lag=lag)
        outputs.append(out)
        sampled = sum(int(m.sum()) for m in out.response_masks)
        eos = f", EOS planted: {sampled} sampled" if args.mean_turn_len else ""
        rows.append(f"| multi-turn generation, read_lag {lag}{' (default)' if lag == READ_LAG else ''}{eos} | "
                    f"{seconds:.3f} s (host waited {out.stats['device_wait_s']:.3f} s, "
                    f"{out.stats['decode_steps']:.0f} steps) |")
    same = sum(all(a.tolist() == b.tolist() for a, b in zip(o.responses, outputs[0].responses)) for o in outputs)
    rows.append(f"| read lags sampling the first lag's ids | {same}/{len(outputs)} |")
    return rows


def loop_alone_s(args: argparse.Namespace, model: torch.nn.Module, prompts: list[torch.Tensor],
                 single_cfg: GenerationConfig) -> float:
    """Seconds of the multi-turn loop over one turn of all the tokens (its own per-step cost);
    the environments are reset outside the timing."""
    source = sessions(args, len(prompts), turns=1)
    seconds, _ = timed(lambda: generate_turns(model, prompts, single_cfg, args.turns * args.turn_tokens + 1, source),
                       prompts[0].device)
    source.close()
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu") if args.tiny or not torch.cuda.is_available() else torch.device("cuda", 0)
    spec = model_preset("tiny" if args.tiny else "llama3.2-1b")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_random_model(spec, Layout(1, 1, 1), None, device, dtype)
    n = args.prompts * args.group
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(spec.vocab_size, 256), (args.prompt_len,), generator=gen).to(device)
               for _ in range(n)]
    graph = device.type == "cuda" and not args.no_graph
    sampling = SamplingParams(temperature=1.0)
    turn_cfg = GenerationConfig(args.turn_tokens, sampling, seed=1, ignore_eos=True, use_cuda_graph=graph,
                                compile_decode=args.compile)
    single_cfg = GenerationConfig(args.turns * args.turn_tokens, sampling, seed=1, ignore_eos=True,
                                  use_cuda_graph=graph, compile_decode=args.compile)
    budget = args.turns * (args.turn_tokens + args.obs_tokens)
    single_s, multi_s, stats = [], [], []
    for repeat in range(args.repeats + 1):  # the first of each is a warm-up
        seconds, _ = timed(lambda: generate(model, prompts, single_cfg), device)
        source = sessions(args, n)
        m_seconds, out = timed(lambda: generate_turns(model, prompts, turn_cfg, budget, source), device)
        metrics = source.metrics()
        source.close()
        if repeat:
            single_s.append(seconds)
            multi_s.append(m_seconds)
            stats.append({**out.stats, "env_step_s": metrics.get("env/step_s_mean", 0.0),
                          "turns": metrics.get("env/turns_mean", 0.0),
                          "failures": metrics.get("env/errors", 0.0) + metrics.get("env/timeouts", 0.0)})
        sampled = sum(int(m.sum()) for m in out.response_masks)
    if args.profile:
        profile_calls(args, model, prompts, single_cfg, turn_cfg, budget)
    loop_s = loop_alone_s(args, model, prompts, single_cfg)
    single, multi = statistics.median(single_s), statistics.median(multi_s)
    error = cache_error(model, prompts, out)
    last = stats[-1]
    print(f"\n{spec.name} on {device} ({'graph' if graph else 'eager'}{'+compile' if args.compile else ''}), "
          f"{n} trajectories, {args.turns} turns x {args.turn_tokens} sampled + {args.obs_tokens} observed, "
          f"env sleep {args.env_sleep_s * 1000:.0f} ms")
    print("| what | value |\n|---|---|")
    print(f"| single-turn generation, {args.turns * args.turn_tokens} tokens | {single:.3f} s |")
    print(f"| multi-turn generation, same sampled tokens ({sampled}) | {multi:.3f} s |")
    print(f"| ratio (target <= 1.3) | {multi / single:.3f} |")
    print(f"| the multi-turn loop, one turn of {args.turns * args.turn_tokens} tokens, no environment | "
          f"{loop_s:.3f} s |")
    print(f"| decode steps / observation prefills (their device time) | {last['decode_steps']:.0f} / "
          f"{last['extensions']:.0f} ({last['extend_s'] * 1000:.1f} ms) |")
    print(f"| mean turns, env step (measured), failed steps | {last['turns']:.2f}, {last['env_step_s'] * 1000:.1f} ms, "
          f"{last['failures']:.0f} |")
    print(f"| host waiting for decode steps (device-bound share of the call) | {last['device_wait_s']:.3f} s |")
    print(f"| host in the environments' submit and poll while rows decode | {last['env_calls_s']:.3f} s |")
    print(f"| GPU idle: all waiting, total / longest gap | {last['wait_s'] * 1000:.1f} / "
          f"{last['max_wait_s'] * 1000:.1f} ms |")
    print(f"| max logprob diff, loop vs fresh forward (8 rows) | {error:.4f} |")
    if args.spread:
        print("\n".join(spread_calls(args, model, prompts, turn_cfg, budget)))
    if args.read_lags:
        print("\n".join(lag_calls(args, model, prompts, turn_cfg, budget)))


if __name__ == "__main__":
    main()
