"""The fast plan evaluator shared by the simulator and the search.

A `PlanSpace` holds, for every call of the graph, a list of candidate placements with everything
the schedule needs precomputed into plain lists (GPU bitmask, resident bytes, and the call's
memory levels as (transient bytes, seconds) pairs); a plan is then just a list of candidate
indices, one per call. `call_levels` gives each call the fastest level that fits beside the
resident weights on its GPUs, and `schedule` runs the list schedule of `planning.simulate`
with those durations, with no object creation beyond a few floats and lists. Call costs are cached by
(call, mesh size, layout), since the cost model does not depend on where a mesh starts, and
reallocation times by (role, source, destination) up to a shift by whole nodes
(`planning.plan_caches`). With optimizer offload, the host bytes of each trained role's train
mesh must fit its nodes' host memory (`planning.offload.node_host_excess`), a memory excess like
a GPU's.

Schedule (see `planning.simulate` for the contract): calls are dispatched in
`Graph.dispatch_order` (iteration after iteration in graph order when on-policy; with bounded
staleness k, the generation of iteration j + k + 1 right after the training of iteration j);
every GPU runs what it is given in dispatch order. A call starts when its data parents (same
iteration) and version parents (`Graph.version_lag` iterations back) have finished and every GPU
of its mesh is free. A trained role's non-train call whose placement differs from
the train call's is preceded by a reallocation task on the union of both meshes.
"""

from __future__ import annotations

import math

from planning.cost import PlanningProblem
from planning.offload import node_host_excess
from planning.plan import CallExecution, Placement
from planning.plan_caches import CallCostCache, ReallocCache

# A record of one scheduled task: (name, kind, iteration, gpu bitmask, start_s, end_s).
TaskRecord = tuple[str, str, int, int, float, float]

# Distinct resident placements remembered by one PlanSpace (a few hundred bytes each).
RESIDENT_MEMO_SIZE = 65536


def same_placement(cands: list[Placement], home_cands: list[Placement]) -> list[int]:
    """Per candidate, the index of the equal placement among home_cands, or -1. A call's
    candidates are distinct placements (`planning.candidates.call_candidates` drops repeats), so
    the index is the only one."""
    index = {p: j for j, p in enumerate(home_cands)}
    return [index.get(p, -1) for p in cands]


def fullest_resident(static: list[tuple[int, int, float]], lo: int, hi: int) -> float:
    """Bytes resident on the fullest GPU of [lo, hi), given resident terms (lo, hi, bytes per
    GPU): that GPU is at lo or where a resident range starts inside [lo, hi)."""
    resident = 0.0
    for point in [lo] + [a for a, _, _ in static if lo < a < hi]:
        total = 0.0
        for a, b, v in static:
            if a <= point < b:
                total += v
        if total > resident:
            resident = total
    return resident


class PlanSpace:
    """Candidate placements per call (graph order) and a fast evaluator of index vectors."""

    def __init__(
        self, problem: PlanningProblem, candidates: list[list[Placement]], iterations: int = 3,
        costs: CallCostCache | None = None, reallocs: ReallocCache | None = None,
        pinned: list[CallExecution | None] | None = None,
    ) -> None:
        """pinned: per call, an execution every candidate of that call must run (None: the
        fastest level that fits is chosen per plan)."""
        graph = problem.graph
        if len(candidates) != len(graph.mfcs):
            raise ValueError(f"PlanSpace: {len(candidates)} candidate lists for {len(graph.mfcs)} calls")
        self.pinned = list(pinned) if pinned is not None else [None] * len(graph.mfcs)
        if len(self.pinned) != len(graph.mfcs):
            raise ValueError(f"PlanSpace: {len(self.pinned)} pinned executions for {len(graph.mfcs)} calls")
        if iterations < 1:
            raise ValueError(f"iterations={iterations}: must be >= 1")
        self.problem = problem
        self.iterations = iterations
        self.names = [m.name for m in graph.mfcs]
        self.candidates = candidates
        self.costs = costs or CallCostCache(problem)
        self.reallocs = reallocs or ReallocCache(problem)
        self.mem_limit = problem.mem_limit_bytes
        index = {name: i for i, name in enumerate(self.names)}
        self.data_parents = [[index[p] for p in graph.data_parents(n)] for n in self.names]
        self.version_parents = [[index[p] for p in graph.version_parents(n)] for n in self.names]
        self.version_lag = [graph.version_lag(n) for n in self.names]
        # With staleness k the generation of k iterations beyond the last measured one is already
        # running in steady state: simulate k more iterations so the window holds it.
        self.simulated_iterations = iterations + graph.max_staleness
        self.order = [(it, index[name]) for it, name in graph.dispatch_order(self.simulated_iterations)]
        trained = set(graph.trained_roles)
        homes = {m.role: index[m.name] for m in reversed(graph.mfcs) if m.kind == "train"}
        self.roles = [m.role for m in graph.mfcs]
        # home[c]: index of the train call whose copy call c is reallocated from, or -1.
        self.home = [homes[m.role] if m.role in trained and homes[m.role] != c else -1 for c, m in enumerate(graph.mfcs)]
        self.is_home = [m.role in trained and homes[m.role] == c for c, m in enumerate(graph.mfcs)]
        self._precompute()
        self._realloc_s: dict[tuple[int, int, int], float | str] = {}
        # The calls whose placements decide the resident bytes (trained roles' homes, never-trained
        # roles): states that agree on them share their resident terms and, per GPU range, the
        # bytes resident on its fullest GPU (`_residents`), which is most of `call_levels`' work.
        self._resident_calls = [c for c in range(len(self.names)) if self.is_home[c] or self.home[c] < 0]
        # twin[c][k]: the home call's candidate index with the same placement as candidate k of
        # call c (-1: none), so that `call_levels` tells a reallocated copy by comparing ints.
        self.twin = [same_placement(cands, self.candidates[h]) if h >= 0 else []
                     for h, cands in zip(self.home, self.candidates)]
        self._resident_memo: dict[tuple[int, ...], tuple[list[tuple[int, int, float]], dict[tuple[int, int], float],
                                                          float]] = {}
        self.offloads = any(b > 0 for row in self.host for b in row)  # any host bytes to check

    # ---- precomputation --------------------------------------------------------------------------
    def _precompute(self) -> None:
        """Per call and candidate: GPU range and mask, resident bytes, and the memory levels as
        (transient bytes, seconds) pairs, leanest first, each faster than every leaner one."""
        self.mask: list[list[int]] = []
        self.lo: list[list[int]] = []
        self.hi: list[list[int]] = []
        self.weights: list[list[float]] = []  # bf16 weights per GPU
        self.optimizer: list[list[float]] = []  # optimizer state per GPU (train calls)
        self.host: list[list[float]] = []  # optimizer state per GPU in host memory (offloading train calls)
        self.level_bytes: list[list[list[float]]] = []  # transient: beyond resident weights + optimizer
        self.level_s: list[list[list[float]]] = []
        self.level_exec: list[list[list[CallExecution | None]]] = []
        self.reason: list[list[str]] = []
        for name, cands, pinned in zip(self.names, self.candidates, self.pinned):
            if not cands:
                raise ValueError(f"PlanSpace: call {name} has no candidate placement")
            self.mask.append([((1 << p.mesh.size) - 1) << p.mesh.start for p in cands])
            self.lo.append([p.mesh.start for p in cands])
            self.hi.append([p.mesh.start + p.mesh.size for p in cands])
            weights, optimizer, host, level_bytes, level_s, level_exec, reasons = [], [], [], [], [], [], []
            for p in cands:
                levels = self.costs.levels(name, p, pinned)
                resident = levels[0].breakdown.get("weights_bytes", 0.0) + levels[0].breakdown.get("optimizer_bytes", 0.0)
                weights.append(levels[0].breakdown.get("weights_bytes", 0.0))
                optimizer.append(levels[0].breakdown.get("optimizer_bytes", 0.0))
                host.append(levels[0].host_bytes)
                pareto: list[tuple[float, float, CallExecution | None]] = []
                for level in sorted(levels, key=lambda c: (c.mem_bytes, c.time_s)):
                    if math.isfinite(level.time_s) and (not pareto or level.time_s < pareto[-1][1]):
                        pareto.append((level.mem_bytes - resident, level.time_s, level.execution))
                reasons.append("" if pareto else levels[0].reason)
                pareto = pareto or [(math.inf, math.inf, None)]
                level_bytes.append([b for b, _, _ in pareto])
                level_s.append([t for _, t, _ in pareto])
                level_exec.append([e for _, _, e in pareto])
            self.weights.append(weights)
            self.optimizer.append(optimizer)
            self.host.append(host)
            self.level_bytes.append(level_bytes)
            self.level_s.append(level_s)
            self.level_exec.append(level_exec)
            self.reason.append(reasons)

    def realloc_s(self, c: int, k: int, k_home: int) -> float | str:
        """Seconds of the reallocation before call c on candidate k from its home on k_home
        (0.0 when the placements are equal), or the reason it is impossible."""
        key = (c, k, k_home)
        found = self._realloc_s.get(key)
        if found is None:
            h = self.home[c]
            src, dst = self.candidates[h][k_home], self.candidates[c][k]
            found = 0.0 if src == dst else self.reallocs.seconds(self.roles[c], src, dst)
            self._realloc_s[key] = found
        return found

    @property
    def size(self) -> int:
        return math.prod(len(c) for c in self.candidates)

    # ---- evaluation ------------------------------------------------------------------------------
    def resident_terms(self, state: list[int]) -> list[tuple[int, int, float]]:
        """Resident bytes as (lo, hi, bytes per GPU): each trained role's weights + optimizer on
        its train mesh; each never-trained role's weights on every placement it runs on."""
        static: list[tuple[int, int, float]] = []
        seen: set[tuple[str, Placement]] = set()
        for c, k in enumerate(state):
            if self.is_home[c]:
                static.append((self.lo[c][k], self.hi[c][k], self.weights[c][k] + self.optimizer[c][k]))
            elif self.home[c] < 0:
                key = (self.roles[c], self.candidates[c][k])
                if key not in seen:
                    seen.add(key)
                    static.append((self.lo[c][k], self.hi[c][k], self.weights[c][k]))
        return static

    def host_excess(self, state: list[int]) -> tuple[float, str]:
        """(bytes by which the fullest node's host memory overflows, <= 0 when it fits; why):
        the offloaded optimizer state of each trained role on its train mesh's GPUs, per node."""
        if not self.offloads:
            return -math.inf, ""
        terms = [(self.lo[c][k], self.hi[c][k], self.host[c][k], self.roles[c])
                 for c, k in enumerate(state) if self.is_home[c] and self.host[c][k] > 0]
        cluster = self.problem.cluster
        return node_host_excess(terms, cluster.gpus_per_node, cluster.hardware)

    def _residents(self, state: list[int]) -> tuple[list[tuple[int, int, float]], dict[tuple[int, int], float], float]:
        """`resident_terms(state)`, a memo of fullest-GPU resident bytes per GPU range and the
        host memory excess (`host_excess`), shared by every state with the same resident
        placements (cleared past RESIDENT_MEMO_SIZE)."""
        key = tuple([state[c] for c in self._resident_calls])
        found = self._resident_memo.get(key)
        if found is None:
            if len(self._resident_memo) >= RESIDENT_MEMO_SIZE:
                self._resident_memo.clear()
            found = self._resident_memo[key] = (self.resident_terms(state), {}, self.host_excess(state)[0])
        return found

    def call_levels(self, state: list[int], picks: list[int] | None = None,
                    peaks: list[float] | None = None) -> tuple[list[float], list[float], float]:
        """(seconds per call, transient bytes per call, worst memory excess). Each call takes its
        fastest level that fits beside the resident bytes of its GPUs (plus its own reallocated
        weights when it runs away from its train placement); a call with no fitting level takes
        its leanest and the excess says by how much the plan overflows (<= 0: it fits), on a GPU
        or in a node's host memory (offloaded optimizer state, `host_excess`).
        picks / peaks, when given, receive each call's level index and its estimated peak bytes
        on its fullest GPU (resident + own copy + transient)."""
        static, fullest, excess = self._residents(state)
        limit = self.mem_limit
        seconds: list[float] = []
        transient: list[float] = []
        for c, k in enumerate(state):
            lo, hi = self.lo[c][k], self.hi[c][k]
            resident = fullest.get((lo, hi))
            if resident is None:
                resident = fullest[(lo, hi)] = fullest_resident(static, lo, hi)
            h = self.home[c]
            own = self.weights[c][k] if h >= 0 and self.twin[c][k] != state[h] else 0.0
            budget = limit - resident - own
            sizes, times = self.level_bytes[c][k], self.level_s[c][k]
            # Levels are leanest first and ever faster: the fastest that fits is the last one.
            pick = len(sizes) - 1
            while pick >= 0 and sizes[pick] > budget:
                pick -= 1
            if pick < 0:
                pick = 0
                if sizes[0] - budget > excess:
                    excess = sizes[0] - budget
            seconds.append(times[pick])
            transient.append(sizes[pick] + own)
            if picks is not None:
                picks.append(pick)
            if peaks is not None:
                peaks.append(resident + own + sizes[pick])
        return seconds, transient, excess

    def executions(self, state: list[int]) -> list[CallExecution | None]:
        """The execution each call of `state` runs (the level `call_levels` picks)."""
        picks: list[int] = []
        self.call_levels(state, picks)
        return [self.level_exec[c][k][pick] for c, (k, pick) in enumerate(zip(state, picks))]

    def call_peak_bytes(self, state: list[int]) -> list[float]:
        """Estimated peak bytes per call on the fullest GPU of its mesh while it runs."""
        peaks: list[float] = []
        self.call_levels(state, peaks=peaks)
        return peaks

    def memory_per_segment(self, state: list[int]) -> tuple[list[int], list[int], list[float]]:
        """Peak bytes per maximal GPU range [lo, hi) on which the set of meshes is constant."""
        static = self.resident_terms(state)
        _, chosen, _ = self.call_levels(state)
        transient = [(self.lo[c][k], self.hi[c][k], chosen[c]) for c, k in enumerate(state)]
        bounds = sorted({b for lo, hi, _ in static + transient for b in (lo, hi)})
        los, his, peaks = [], [], []
        for lo, hi in zip(bounds, bounds[1:]):
            resident = sum(v for a, b, v in static if a <= lo and hi <= b)
            work = max((v for a, b, v in transient if a <= lo and hi <= b), default=0.0)
            los.append(lo)
            his.append(hi)
            peaks.append(resident + work)
        return los, his, peaks

    def evaluate(self, state: list[int], record: list[TaskRecord] | None = None) -> tuple[float, str]:
        """(steady-state seconds per iteration, reason the plan is infeasible or '')."""
        for c, k in enumerate(state):
            if self.reason[c][k]:
                return math.inf, f"{self.names[c]}: {self.reason[c][k]}"
        seconds, _, excess = self.call_levels(state)
        if excess > 0:
            return math.inf, self._memory_reason(state)
        return self.schedule(state, seconds, record)

    def _memory_reason(self, state: list[int]) -> str:
        """Which call overflows its GPU, by its estimated peak against the usable memory (or,
        when every GPU fits, which node's host memory the offloaded optimizer state overflows)."""
        peaks = self.call_peak_bytes(state)
        c = max(range(len(peaks)), key=lambda i: peaks[i])
        if peaks[c] <= self.mem_limit:
            return f"host memory overflows: {self.host_excess(state)[1]}"
        hw = self.problem.cluster.hardware
        margin = f", {self.problem.memory_margin:.0%} kept free" if self.problem.memory_margin else ""
        return (f"peak memory exceeds the GPU: call {self.names[c]} needs an estimated {peaks[c] / 2**30:.2f} GiB per "
                f"GPU of {self.mem_limit / 2**30:.2f} GiB usable ({hw.name}: {hw.mem_bytes / 2**30:.1f} GiB{margin})")

    def schedule(self, state: list[int], seconds: list[float], record: list[TaskRecord] | None = None) -> tuple[float, str]:
        """List-schedule the iterations with the given call durations, in dispatch order; steady
        state = (end of iteration `iterations` - 1 - end of the first) / (iterations - 1), or the
        first iteration's time when there is one. (With staleness k, k more iterations are
        scheduled: the window between those two ends then holds as many rollout stages as
        train stages.)"""
        n = len(state)
        task_masks: list[int] = []
        task_ends: list[float] = []
        ends = [[0.0] * n for _ in range(self.simulated_iterations)]
        mask, home = self.mask, self.home
        for it, c in self.order:
            k = state[c]
            version_ready = 0.0
            source = it - self.version_lag[c]  # the iteration whose training made the weights c reads
            if source >= 0:
                for v in self.version_parents[c]:
                    if ends[source][v] > version_ready:
                        version_ready = ends[source][v]
            ready = version_ready
            for p in self.data_parents[c]:
                if ends[it][p] > ready:
                    ready = ends[it][p]
            m = mask[c][k]
            h = home[c]
            if h >= 0:
                moving = self.realloc_s(c, k, state[h])
                if isinstance(moving, str):
                    return math.inf, f"reallocation for {self.names[c]}: {moving}"
                if moving > 0.0:
                    rm = m | mask[h][state[h]]
                    start = version_ready
                    for tm, te in zip(task_masks, task_ends):
                        if te > start and tm & rm:
                            start = te
                    task_masks.append(rm)
                    task_ends.append(start + moving)
                    if record is not None:
                        record.append((f"realloc:{self.names[h]}->{self.names[c]}", "realloc", it, rm, start, start + moving))
                    if start + moving > ready:
                        ready = start + moving
            start = ready
            for tm, te in zip(task_masks, task_ends):
                if te > start and tm & m:
                    start = te
            end = start + seconds[c]
            task_masks.append(m)
            task_ends.append(end)
            ends[it][c] = end
            if record is not None:
                record.append((self.names[c], "call", it, m, start, end))
        iter_ends = [max(row) for row in ends]
        if self.iterations == 1:
            return iter_ends[0], ""
        return (iter_ends[self.iterations - 1] - iter_ends[0]) / (self.iterations - 1), ""
