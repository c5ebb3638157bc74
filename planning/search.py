"""Plan search: Metropolis-Hastings over placements, brute force, and the symmetric baseline.

`search_plan(problem, mode, seconds, seed, manual)`:

* search: MCMC (Metropolis-Hastings with simulated annealing) over one candidate placement per
  call, minimising the simulated iteration time. Candidates come from `planning.candidates`;
  the chain starts from the better of the symmetric baseline and each call's fastest
  candidate. Moves: re-pick a call's (size, layout) class, shift it to another position,
  align it with another call's mesh, or re-pick two calls at once. A plan over the memory
  limit gets an inflated energy (`plan_energy`) so the chain can pass through it, but only
  feasible plans can become the best. Temperature: 5% of the starting energy, annealed as
  (1 - elapsed / budget)^2. After `stall_steps` proposals without a new best the
  chain restarts from the best plan found. Energies are cached per plan; the chain stops once
  it has seen every plan, and a space it can enumerate in half the budget is enumerated instead
  (one GPU: one plan, no budget spent; not with `max_steps`, which pins the chain). The chain ranks
  plans with the closed-form reallocation estimate (`planning.realloc_estimate`); its best
  distinct plans are then re-scored with the exact one (`realloc_plan.estimate_realloc_s`, what
  `simulate` uses), so the returned time is what `simulate` reports for the returned plan.
* exhaustive: every combination of candidates (ValueError beyond `EXHAUSTIVE_LIMIT` plans),
  re-scored the same way.
* heuristic: the symmetric baseline (DeepSpeed-Chat / OpenRLHF style): every call on all GPUs
  with one shared 3D layout, the best such layout that fits.
* manual: evaluates the given plan (ValueError naming the reason when it does not fit).

Optimizer offload (`planning.offload_search`): every mode first plans with all optimizer state
on the GPUs; only when no plan fits does it offload, the least fraction that makes one fit
(`PlanningProblem.auto_offload`; a problem or manual plan that names fractions keeps them). The
returned plans carry it (`ExecutionPlan.optimizer_offload`). "No plan fits" is an
`InfeasiblePlanError` (a ValueError).

Every returned plan names each call's execution (micro-batch token budget or generation
rounds): the level the simulator picks for it, or, in a manual plan, the one given. `start`
adds a plan (e.g. the one a run is executing, when it re-plans) as candidates and a starting
point of the chain.

Everything random goes through one `random.Random(seed)`. The budget `seconds` bounds the
MCMC's wall time, so results with the same seed agree as long as the chain does not run out of
time at different steps; `max_steps` makes a run exactly reproducible. The budget holds at any
cluster size: candidates are capped in positions (`CandidateOptions.max_positions`) and the
final re-scoring stops at the deadline once it has a feasible plan.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, replace

from planning.candidates import CandidateOptions, call_candidates
from planning.cost import PlanningProblem
from planning.layout import Layout
from planning.offload_search import InfeasiblePlanError, with_least_offload
from planning.plan import ExecutionPlan, Placement
from planning.plan_space import CallCostCache, PlanSpace, ReallocCache
from planning.simulate import complete_plan, plan_space_for, with_default_placements

MODES = ("search", "exhaustive", "heuristic", "manual")
EXHAUSTIVE_LIMIT = 2_000_000
# Search mode enumerates the candidate space instead of sampling it when seeing every plan takes
# at most half the budget (at a conservative ENUMERATE_S_PER_PLAN; ~30 us measured on a 2-core
# machine): the answer is then the optimum, found sooner, and a one-GPU cluster (one plan)
# returns at once rather than spending the whole budget revisiting it.
ENUMERATE_S_PER_PLAN = 60e-6
# Cost of an infeasible plan: far above any real iteration time, growing with the memory excess.
PENALTY_S = 1e7


@dataclass(frozen=True)
class SearchResult:
    """The chosen plan, its estimated iteration time, the baseline beside it and search stats."""

    plan: ExecutionPlan
    est_iteration_s: float
    baseline_plan: ExecutionPlan | None
    baseline_iteration_s: float
    search_s: float
    evaluated_plans: int
    history: tuple[tuple[float, float], ...]

    @property
    def speedup(self) -> float:
        """Baseline time / plan time (nan without a baseline)."""
        if self.baseline_plan is None or not math.isfinite(self.baseline_iteration_s):
            return math.nan
        return self.baseline_iteration_s / self.est_iteration_s


def symmetric_baseline(problem: PlanningProblem, iterations: int = 3) -> tuple[ExecutionPlan, float]:
    """Every call on the whole cluster with one shared layout; the fastest layout that fits.
    Raises ValueError when no layout of the full mesh fits."""
    cluster = problem.cluster
    layouts = cluster.layouts_for(cluster.full_mesh)
    options = [Placement(cluster.full_mesh, layout) for layout in layouts]
    space = PlanSpace(problem, [options] * len(problem.graph.mfcs), iterations)
    best: tuple[float, int] | None = None
    reasons = []
    for k, placement in enumerate(options):
        seconds, reason = space.evaluate([k] * len(problem.graph.mfcs))
        if reason:
            reasons.append(f"{placement.layout}: {reason}")
        elif best is None or seconds < best[0]:
            best = (seconds, k)
    if best is None:
        raise InfeasiblePlanError(f"symmetric baseline: no layout of the full {cluster.n_gpus}-GPU mesh fits "
                                  f"({'; '.join(reasons[:3])})")
    placement = options[best[1]]
    plan = ExecutionPlan(tuple((m.name, placement) for m in problem.graph.mfcs))
    executions = space.executions([best[1]] * len(problem.graph.mfcs))
    return plan.with_executions({m.name: e for m, e in zip(problem.graph.mfcs, executions) if e is not None}), best[0]


def search_plan(
    problem: PlanningProblem, mode: str = "search", seconds: float = 60.0, seed: int = 0,
    manual: ExecutionPlan | None = None, options: CandidateOptions | None = None,
    max_steps: int | None = None, iterations: int = 3, space_type: type[PlanSpace] = PlanSpace,
    start: ExecutionPlan | None = None,
) -> SearchResult:
    """Find (or, in manual mode, evaluate) a plan; see the module docstring for the modes.

    space_type: the evaluator of the search and exhaustive modes; a subclass can relax the model
    for what-if bounds (benchmarks/search_bench.py's relaxed bound). The baseline always uses
    PlanSpace itself. start: a plan the search and exhaustive modes also consider and start from.
    The returned plan carries the optimizer offload chosen (module docstring); a manual plan's own
    offload, when it names one, is kept as it is."""
    if mode not in MODES:
        raise ValueError(f"search mode {mode!r}: unknown; allowed: {', '.join(MODES)}")
    if seconds <= 0:
        raise ValueError(f"seconds={seconds}: the search budget must be positive")
    if (mode == "manual") != (manual is not None):
        raise ValueError("mode='manual' needs `manual` (an ExecutionPlan), and only it takes one")
    if manual is not None and manual.optimizer_offload:
        problem = replace(problem.with_offload(dict(manual.optimizer_offload)), auto_offload=False)

    def at_offload(p: PlanningProblem, budget: float) -> SearchResult:
        given = manual.with_offload(dict(p.optimizer_offload)) if manual is not None else None
        return _search_at(p, mode, budget, seed, given, options, max_steps, iterations, space_type, start)

    return with_least_offload(problem, at_offload, seconds, mode)


def _search_at(
    problem: PlanningProblem, mode: str, seconds: float, seed: int, manual: ExecutionPlan | None,
    options: CandidateOptions | None, max_steps: int | None, iterations: int, space_type: type[PlanSpace],
    start: ExecutionPlan | None,
) -> SearchResult:
    """`search_plan` at the problem's optimizer offload; InfeasiblePlanError when nothing fits."""
    begin = time.perf_counter()
    try:
        baseline_plan, baseline_s = symmetric_baseline(problem, iterations)
    except ValueError:
        if mode == "heuristic":
            raise
        baseline_plan, baseline_s = None, math.inf
    if mode == "heuristic":
        assert baseline_plan is not None
        return SearchResult(baseline_plan, baseline_s, baseline_plan, baseline_s, time.perf_counter() - begin, 1,
                            ((time.perf_counter() - begin, baseline_s),))
    if mode == "manual":
        assert manual is not None
        manual = with_default_placements(problem.graph, manual)
        space = plan_space_for(problem, manual, iterations)
        seconds_per_iter, reason = space.evaluate([0] * len(space.names))
        if reason:
            raise InfeasiblePlanError(f"manual plan is infeasible: {reason}")
        return SearchResult(complete_plan(problem, manual), seconds_per_iter, baseline_plan, baseline_s,
                            time.perf_counter() - begin, 1, ((time.perf_counter() - begin, seconds_per_iter),))
    costs = CallCostCache(problem)
    extra: dict[str, list[Placement]] = {}
    for given in (baseline_plan, start):
        for name, p in (given.placements if given is not None else ()):
            extra.setdefault(name, []).append(p)
    try:
        candidates = call_candidates(problem, costs, options, extra)
    except ValueError as exc:  # a call that fits nowhere
        raise InfeasiblePlanError(str(exc)) from None
    # Rank with the closed-form reallocation estimate, then re-score the best with the exact one.
    fast = space_type(problem, candidates, iterations, costs, ReallocCache(problem, exact=False))
    exact = space_type(problem, candidates, iterations, costs, ReallocCache(problem, exact=True))
    elites = _Elites()
    if mode == "exhaustive" or (max_steps is None and fast.size * ENUMERATE_S_PER_PLAN <= 0.5 * seconds):
        evaluated, history = _exhaustive(fast, begin, elites)
    else:
        chain = _Chain(fast, random.Random(seed), begin, seconds, max_steps, elites)
        evaluated, history = chain.run(_initial_states(fast, baseline_plan, start))
    state, best_s = _rescore(exact, elites.states(), begin + seconds)
    if state is None:
        # Name what stops the plan every call would pick alone (its calls' memory, a reallocation).
        _, reason = exact.evaluate(_initial_states(exact)[0])
        raise InfeasiblePlanError(f"search found no feasible plan among {evaluated} evaluated (memory or reallocation "
                         f"limits); each call's fastest placement: {reason or 'feasible alone'}")
    history.append((time.perf_counter() - begin, best_s))
    plan = ExecutionPlan(tuple((name, candidates[c][k]) for c, (name, k) in enumerate(zip(exact.names, state))))
    executions = {name: e for name, e in zip(exact.names, exact.executions(state)) if e is not None}
    return SearchResult(plan.with_executions(executions), best_s, baseline_plan, baseline_s,
                        time.perf_counter() - begin, evaluated, tuple(history))


class _Elites:
    """The `keep` best distinct feasible plans seen (by the search's energy)."""

    def __init__(self, keep: int = 24) -> None:
        self.keep = keep
        self._energy: dict[tuple[int, ...], float] = {}
        self.threshold = math.inf

    def offer(self, state: tuple[int, ...], energy: float) -> None:
        if energy >= self.threshold or state in self._energy:
            return
        self._energy[state] = energy
        if len(self._energy) >= 2 * self.keep:
            best = sorted(self._energy.items(), key=lambda kv: (kv[1], kv[0]))[: self.keep]
            self._energy = dict(best)
            self.threshold = best[-1][1]

    def states(self) -> list[list[int]]:
        ranked = sorted(self._energy.items(), key=lambda kv: (kv[1], kv[0]))[: self.keep]
        return [list(state) for state, _ in ranked]


def _rescore(exact: PlanSpace, states: list[list[int]], deadline: float = math.inf) -> tuple[list[int] | None, float]:
    """The state with the lowest exact iteration time, or (None, inf) when none is feasible.
    Past `deadline` it stops at the first feasible one (states come best first)."""
    best: tuple[float, list[int]] | None = None
    for state in states:
        if best is not None and time.perf_counter() >= deadline:
            break
        seconds, reason = exact.evaluate(state)
        if not reason and (best is None or seconds < best[0]):
            best = (seconds, state)
    return (best[1], best[0]) if best else (None, math.inf)


def plan_cost(space: PlanSpace, state: list[int]) -> float:
    """Seconds per iteration of a feasible plan; PENALTY_S and up for an infeasible one."""
    energy, feasible = plan_energy(space, state)
    return energy if feasible else PENALTY_S + energy


def plan_energy(space: PlanSpace, state: list[int]) -> tuple[float, bool]:
    """(energy, feasible) for the chain: a feasible plan's energy is its seconds per iteration;
    a plan over the memory limit is scheduled anyway and its time inflated by 1.5x plus 10x
    the fraction by which memory is exceeded, so the chain can cross a narrow infeasible
    region (e.g. moving two models to disjoint halves one at a time) at high temperature.
    A plan with an impossible reallocation has infinite energy."""
    durations, _, excess = space.call_levels(state)
    seconds, reason = space.schedule(state, durations)
    if reason:
        return math.inf, False
    if excess > 0:
        return seconds * (1.5 + 10.0 * excess / space.mem_limit), False
    return seconds, True


def _initial_states(space: PlanSpace, *plans: ExecutionPlan | None) -> list[list[int]]:
    """Starting points: each call's fastest, and the given plans (baseline, start), which are
    among the candidates."""
    fastest = [min(range(len(d)), key=lambda k, d=d: d[k][-1]) for d in space.level_s]
    states = [fastest]
    for plan in plans:
        if plan is not None:
            placements = plan.as_dict()
            states.append([cands.index(placements[name]) for name, cands in zip(space.names, space.candidates)])
    return states


def _exhaustive(space: PlanSpace, start: float, elites: _Elites) -> tuple[int, list[tuple[float, float]]]:
    if space.size > EXHAUSTIVE_LIMIT:
        sizes = " x ".join(str(len(c)) for c in space.candidates)
        raise ValueError(f"exhaustive search: {space.size} plans ({sizes}) exceed the limit of {EXHAUSTIVE_LIMIT}; "
                         "use mode='search' or fewer candidates (CandidateOptions)")
    best = math.inf
    history: list[tuple[float, float]] = []
    evaluated = 0
    for combo in itertools.product(*(range(len(c)) for c in space.candidates)):
        state = list(combo)
        evaluated += 1
        durations, _, excess = space.call_levels(state)
        if excess > 0:
            continue
        value, reason = space.schedule(state, durations)
        if reason:
            continue
        elites.offer(combo, value)
        if value < best:
            best = value
            history.append((time.perf_counter() - start, best))
    return evaluated, history


class _Chain:
    """One annealed Metropolis-Hastings chain with restarts from the best plan."""

    def __init__(self, space: PlanSpace, rng: random.Random, start: float, seconds: float, max_steps: int | None,
                 elites: _Elites, stall_steps: int = 2000) -> None:
        self.space, self.rng, self.start, self.elites = space, rng, start, elites
        # Leave a little of the budget for re-scoring the best plans with the exact estimate.
        self.deadline = start + 0.95 * seconds
        self.seconds = seconds
        self.max_steps = max_steps
        self.stall_steps = stall_steps
        self.cache: dict[tuple[int, ...], tuple[float, bool]] = {}
        self.simulated = 0  # distinct plans simulated (revisits hit the cache and are not counted)
        # Candidates of each call grouped by class (mesh size, layout) and by mesh start.
        self.classes: list[list[list[int]]] = []
        self.class_of: list[list[int]] = []
        self.by_start: list[dict[int, list[int]]] = []
        for cands in space.candidates:
            groups: dict[tuple[int, Layout], int] = {}
            members: list[list[int]] = []
            owner: list[int] = []
            starts: dict[int, list[int]] = {}
            for k, p in enumerate(cands):
                g = groups.setdefault((p.mesh.size, p.layout), len(groups))
                if g == len(members):
                    members.append([])
                members[g].append(k)
                owner.append(g)
                starts.setdefault(p.mesh.start, []).append(k)
            self.classes.append(members)
            self.class_of.append(owner)
            self.by_start.append(starts)

    def energy(self, state: list[int]) -> tuple[float, bool]:
        key = tuple(state)
        found = self.cache.get(key)
        if found is None:
            found = plan_energy(self.space, state)
            self.cache[key] = found
            self.simulated += 1
            if found[1]:
                self.elites.offer(key, found[0])
        return found

    def propose(self, state: list[int]) -> list[int]:
        rng = self.rng
        new = list(state)
        if rng.random() < 0.15:  # re-pick two calls at once: crosses pairs of coupled moves
            for c in rng.sample(range(len(state)), min(2, len(state))):
                new[c] = rng.choice(rng.choice(self.classes[c]))
            return new
        c = rng.randrange(len(state))
        move = rng.random()
        if move < 0.5:  # a new (size, layout) class, at a random position
            new[c] = rng.choice(rng.choice(self.classes[c]))
        elif move < 0.8:  # the same class elsewhere
            new[c] = rng.choice(self.classes[c][self.class_of[c][state[c]]])
        else:  # align with another call's mesh (share GPUs, or share the placement exactly)
            other = rng.randrange(len(state))
            start = self.space.lo[other][state[other]]
            options = self.by_start[c].get(start)
            new[c] = rng.choice(options) if options else rng.randrange(len(self.space.candidates[c]))
        return new

    def run(self, starts: list[list[int]]) -> tuple[int, list[tuple[float, float]]]:
        rng = self.rng
        scored = [(self.energy(s), s) for s in starts]
        (current_cost, _), current = min(scored, key=lambda x: x[0][0])
        feasible_starts = [(e, s) for (e, ok), s in scored if ok]
        best_cost, best = min(feasible_starts, key=lambda x: x[0]) if feasible_starts else (math.inf, list(current))
        history = [(time.perf_counter() - self.start, best_cost)]
        t0 = 0.05 * current_cost if math.isfinite(current_cost) else 1.0
        stall, step = 0, 0
        progress = 0.0
        while True:
            if step % 64 == 0:
                now = time.perf_counter()
                if now >= self.deadline or len(self.cache) >= self.space.size:
                    break  # out of time, or every plan of the space seen
                progress = (now - self.start) / self.seconds
            if self.max_steps is not None:
                if step >= self.max_steps:
                    break
                progress = step / self.max_steps
            step += 1
            temperature = t0 * (1.0 - progress) ** 2 + 1e-9
            proposal = self.propose(current)
            value, feasible = self.energy(proposal)
            if value <= current_cost or rng.random() < math.exp(-(value - current_cost) / temperature):
                current, current_cost = proposal, value
            if feasible and value < best_cost:
                best, best_cost, stall = list(proposal), value, 0
                history.append((time.perf_counter() - self.start, best_cost))
            else:
                stall += 1
                if stall >= self.stall_steps and math.isfinite(best_cost):
                    current, current_cost, stall = list(best), best_cost, 0
        return self.simulated, history
