"""Benchmark of the plan search (CPU only): quality against brute force, speedup over the
symmetric baseline, convergence at 1024 GPUs, and plan evaluations per second.

    python benchmarks/search_bench.py                  # every part, full budgets
    python benchmarks/search_bench.py --quick          # every part, small budgets (about a minute)
    python benchmarks/search_bench.py --part c --plot convergence.png

Parts:
  a  PPO, 7B actor + 7B critic, 1x8 h100-80g: exhaustive optimum vs MCMC (10 s budget) on the
     same candidate space; target: within 2%.
  b  PPO, 70B actor + 7B critic, 16x8 h100-80g: MCMC for 60 s vs the symmetric baseline;
     target: >= 1.3x. --hardware / --profile / --seconds vary the cluster, feed a measured
     profile and set the budget.
  c  PPO, 70B actor + 7B critic, 128x8 h100-80g: MCMC for 300 s; when the best plan stopped
     improving, and a plot of best estimated iteration time vs search time (--plot).
  d  plan evaluations per second (warm caches, no memoisation) on the PPO graphs of a and b;
     target: >= 5000/s.
The last thing printed is a table of the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planning.algorithm_graphs import ppo_graph  # noqa: E402
from planning.candidates import CandidateOptions, call_candidates, feasible_classes  # noqa: E402
from planning.cost import PlanningProblem, rlhf_problem  # noqa: E402
from planning.dataflow import BatchShape  # noqa: E402
from planning.efficiency import OpEfficiency  # noqa: E402
from planning.hardware import hardware_preset  # noqa: E402
from planning.layout import ClusterSpec  # noqa: E402
from planning.models import model_preset  # noqa: E402
from planning.plan_space import CallCostCache, PlanSpace, ReallocCache  # noqa: E402
from planning.search import SearchResult, plan_energy, search_plan  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One line of the final table."""

    part: str
    measure: str
    value: str
    target: str
    met: bool | None


def ppo_problem(nodes: int, actor: str, critic: str, batch: BatchShape, hardware: str = "h100-80g",
                profile: str | None = None) -> PlanningProblem:
    """PPO on nodes x 8 GPUs of `hardware`; `profile` (a `python -m app profile` JSON) replaces the
    preset's figures and supplies the measured op efficiencies."""
    spec = hardware_preset(hardware)
    efficiency = OpEfficiency()
    if profile is not None:
        spec = spec.with_profile(profile)
        efficiency = OpEfficiency(**json.loads(Path(profile).read_text()).get("efficiency", {}))
    cluster = ClusterSpec(nodes, 8, spec)
    return rlhf_problem(ppo_graph(batch), cluster, model_preset(actor), critic=model_preset(critic),
                        efficiency=efficiency)


def part_a(quick: bool, seed: int) -> list[Row]:
    problem = ppo_problem(1, "llama-7b", "llama-7b", BatchShape(512, 512, 512))
    # The restricted space the exhaustive search can cover: ~5e3 plans (quick) or ~2e5. PPO has seven
    # calls since the actor's logprob recompute (actor_inf); max_classes=5 would be 2.2e6 plans, over
    # the exhaustive limit.
    options = CandidateOptions(max_classes=3) if quick else CandidateOptions(max_classes=4)
    t0 = time.perf_counter()
    exact = search_plan(problem, "exhaustive", options=options)
    exhaustive_s = time.perf_counter() - t0
    budget = 3.0 if quick else 10.0
    mcmc = search_plan(problem, "search", seconds=budget, seed=seed, options=options)
    gap = mcmc.est_iteration_s / exact.est_iteration_s - 1.0
    reach = _time_to_within(mcmc, exact.est_iteration_s * 1.02)
    wide = search_plan(problem, "search", seconds=budget, seed=seed)
    print(f"[a] exhaustive: {exact.evaluated_plans} plans in {exhaustive_s:.1f} s -> {exact.est_iteration_s:.3f} s/iter "
          f"(baseline {exact.baseline_iteration_s:.3f})")
    print(f"[a] MCMC {budget:.0f} s: {mcmc.est_iteration_s:.3f} s/iter, gap {gap * 100:+.2f}%, "
          f"{mcmc.evaluated_plans} proposals; within 2% after {reach:.2f} s")
    print(f"[a] MCMC on the default (unrestricted) candidates: {wide.est_iteration_s:.3f} s/iter, "
          f"speedup over baseline {wide.speedup:.2f}x")
    _print_plan(wide)
    return [
        Row("a", "exhaustive optimum (s/iter)", f"{exact.est_iteration_s:.3f} ({exact.evaluated_plans} plans, {exhaustive_s:.0f} s)", "", None),
        Row("a", f"MCMC gap after {budget:.0f} s", f"{gap * 100:+.2f}% (2% reached at {reach:.2f} s)", "<= 2% in < 10 s",
            gap <= 0.02 and reach < 10.0),
        Row("a", "speedup vs symmetric (default space)", f"{wide.speedup:.2f}x", "", None),
    ]


def part_b(quick: bool, seed: int, hardware: str = "h100-80g", profile: str | None = None,
           seconds: float | None = None) -> list[Row]:
    problem = ppo_problem(16, "llama-70b", "llama-7b", BatchShape(2048, 512, 512), hardware, profile)
    budget = seconds or (10.0 if quick else 60.0)
    result = search_plan(problem, "search", seconds=budget, seed=seed)
    print(f"[b] 70B+7B on 128 GPUs: {result.est_iteration_s:.2f} s/iter vs symmetric {result.baseline_iteration_s:.2f} "
          f"({result.speedup:.2f}x) in {result.search_s:.1f} s, {result.evaluated_plans} proposals")
    _print_plan(result)
    bound = actor_cycle_bound(problem)
    print(f"[b] lower bound of any plan (actor cycle gen -> slowest inference -> train, each call at its fastest "
          f"placement, no reallocation): {bound:.2f} s -> at most {result.baseline_iteration_s / bound:.2f}x")
    relaxed = search_plan(problem, "search", seconds=budget, seed=seed, space_type=RelaxedPlanSpace)
    print(f"[b] relaxed model (nothing resident between calls, reallocation free): {relaxed.est_iteration_s:.2f} s "
          f"({relaxed.speedup:.2f}x)")
    _print_plan(relaxed)
    return [
        Row("b", "search time", f"{result.search_s:.1f} s", "<= 60 s", result.search_s <= 61.0),
        Row("b", "speedup vs symmetric", f"{result.speedup:.2f}x ({result.est_iteration_s:.2f} vs "
            f"{result.baseline_iteration_s:.2f} s)", ">= 1.3x", result.speedup >= 1.3),
        Row("b", "speedup bound (actor cycle)", f"{result.baseline_iteration_s / bound:.2f}x ({bound:.2f} s)", "", None),
        Row("b", "speedup, relaxed model", f"{relaxed.speedup:.2f}x ({relaxed.est_iteration_s:.2f} s)", "", None),
    ]


class RelaxedPlanSpace(PlanSpace):
    """A what-if evaluator for an upper bound on what memory management can buy: every call
    has its GPUs' whole memory to itself (as if every idle model, copy and optimizer state were
    offloaded to CPU and brought back for free) and every reallocation takes no time. Call times
    and the dataflow are unchanged, so a plan space that cannot reach a speedup here cannot reach
    it through offloading, other memory levels or faster reallocation either."""

    def resident_terms(self, state: list[int]) -> list[tuple[int, int, float]]:
        return []

    def realloc_s(self, c: int, k: int, k_home: int) -> float | str:
        found = super().realloc_s(c, k, k_home)
        return found if isinstance(found, str) else 0.0


def actor_cycle_bound(problem: PlanningProblem) -> float:
    """A lower bound on the steady-state iteration time of any PPO plan: actor_gen(i), then the
    inferences on its output (the slowest of them), then actor_train(i), which gen(i+1) waits
    for, each at its fastest feasible placement on otherwise empty GPUs."""
    costs = CallCostCache(problem)
    fastest = {m.name: feasible_classes(problem, m, costs)[0][0][2] for m in problem.graph.mfcs}
    inferences = [m.name for m in problem.graph.mfcs if m.kind == "inference"]
    return fastest["actor_gen"] + max(fastest[n] for n in inferences) + fastest["actor_train"]


def part_c(quick: bool, seed: int, plot: str | None) -> list[Row]:
    problem = ppo_problem(128, "llama-70b", "llama-7b", BatchShape(8192, 512, 512))
    budget = 30.0 if quick else 300.0
    result = search_plan(problem, "search", seconds=budget, seed=seed)
    ranked = result.history[:-1]
    last_gain = next(t for t, v in ranked if v == ranked[-1][1])
    print(f"[c] 1024 GPUs: {result.est_iteration_s:.2f} s/iter vs symmetric {result.baseline_iteration_s:.2f} "
          f"({result.speedup:.2f}x); last improvement at {last_gain:.1f} s of {result.search_s:.1f} s")
    _print_plan(result)
    if plot:
        _plot(result, plot, "PPO 70B+7B on 128x8 h100-80g")
        print(f"[c] plot: {plot}")
    return [
        Row("c", "converged (last improvement)", f"{last_gain:.1f} s of {result.search_s:.0f} s budget", "<= 300 s",
            last_gain <= 300.0),
        Row("c", "speedup vs symmetric", f"{result.speedup:.2f}x", "", None),
    ]


def part_d(quick: bool, seed: int) -> list[Row]:
    rows = []
    cases = [("1x8 7B+7B", ppo_problem(1, "llama-7b", "llama-7b", BatchShape(512, 512, 512))),
             ("16x8 70B+7B", ppo_problem(16, "llama-70b", "llama-7b", BatchShape(2048, 512, 512)))]
    for label, problem in cases:
        costs = CallCostCache(problem)
        space = PlanSpace(problem, call_candidates(problem, costs), 3, costs, ReallocCache(problem, exact=False))
        rng = random.Random(seed)
        states = [[rng.randrange(len(c)) for c in space.candidates] for _ in range(2000 if quick else 20000)]
        for state in states:  # warm the reallocation cache: the chain revisits the same pairs
            plan_energy(space, state)
        t0 = time.perf_counter()
        for state in states:
            plan_energy(space, state)
        rate = len(states) / (time.perf_counter() - t0)
        print(f"[d] {label}: {rate:,.0f} plan evaluations/s ({len(states)} random plans, warm caches)")
        rows.append(Row("d", f"evals/s {label}", f"{rate:,.0f}", ">= 5000", rate >= 5000))
    return rows


def _time_to_within(result: SearchResult, target: float) -> float:
    for t, value in result.history:
        if value <= target:
            return t
    return float("inf")


def _print_plan(result: SearchResult) -> None:
    for name, p in result.plan.placements:
        print(f"      {name:<14} {str(p.mesh):<10} {p.layout}")


def _plot(result: SearchResult, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for t, _ in result.history]
    values = [v for _, v in result.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(times, values, where="post", label="best plan (search estimate)")
    ax.axhline(result.baseline_iteration_s, color="gray", linestyle="--", label="symmetric baseline")
    ax.set_xlabel("search time (s)")
    ax.set_ylabel("estimated iteration time (s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["a", "b", "c", "d", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="small budgets and spaces (about a minute in all)")
    parser.add_argument("--plot", metavar="FILE.png", help="part c: save best cost vs search time here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default="h100-80g", help="part b: hardware preset of the 16x8 cluster")
    parser.add_argument("--profile", default=None, help="part b: measured profile JSON (python -m app profile)")
    parser.add_argument("--seconds", type=float, default=None, help="part b: search budget (default 60 s)")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    parts = "abcd" if args.part == "all" else args.part
    for part in parts:
        if part == "a":
            rows += part_a(args.quick, args.seed)
        elif part == "b":
            rows += part_b(args.quick, args.seed, args.hardware, args.profile, args.seconds)
        elif part == "c":
            rows += part_c(args.quick, args.seed, args.plot)
        else:
            rows += part_d(args.quick, args.seed)
    _table(rows)
    return 0


def _table(rows: list[Row]) -> None:
    header = ("part", "measure", "value", "target", "met")
    cells = [(r.part, r.measure, r.value, r.target, "" if r.met is None else ("yes" if r.met else "NO")) for r in rows]
    widths = [max(len(x[i]) for x in [header, *cells]) for i in range(len(header))]
    print()
    for line in [header, tuple("-" * w for w in widths), *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


if __name__ == "__main__":
    raise SystemExit(main())
