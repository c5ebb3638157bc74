"""Candidate placements per call for the search, precomputed and pruned.

A call's cost depends on its mesh size and layout, not on where the mesh starts, so candidates
are chosen as (mesh size, layout) classes and then expanded to every legal position of that
size. Pruning, per call:

1. drop classes that do not fit in memory or cannot shard the model (infeasible);
2. keep the `layouts_per_size` fastest layouts of each mesh size;
3. drop a mesh size whose best time is no better than that of a smaller mesh size (dominated:
   more GPUs for nothing);
4. with more than `max_sizes` mesh sizes left, keep the sub-node ones and node counts of the
   form 2^k or 3 * 2^k (1, 2, 3, 4, 6, 8, 12, 16, 24 ...) plus the largest: small meshes stay
   available, so small calls can run beside big ones;
5. drop classes slower than both `max_slowdown` x the call's fastest and the slowest call's
   fastest time (a small call may be slow on few GPUs if it runs concurrently), then keep the
   `max_classes` fastest;
6. add back the classes kept for the same role's train call (when they are feasible here), so a
   call may share the train placement and skip the reallocation;
7. expand each class to at most `max_positions` positions, evenly spread over the cluster
   (always the first): on a big cluster every size-1 mesh of every GPU would make the search's
   precomputation alone outgrow its budget (100,000 GPUs: minutes), and positions of one class
   differ only in which calls they share GPUs with.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.cost import PlanningProblem
from planning.dataflow import MFC
from planning.layout import ClusterSpec, Layout, Mesh
from planning.plan import Placement
from planning.plan_space import CallCostCache


@dataclass(frozen=True)
class CandidateOptions:
    """How many placements the search considers per call (see the module docstring)."""

    layouts_per_size: int = 3
    max_slowdown: float = 8.0
    max_classes: int = 64
    max_sizes: int = 16
    drop_dominated: bool = True
    max_positions: int = 256

    def __post_init__(self) -> None:
        for name in ("layouts_per_size", "max_classes", "max_sizes", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"CandidateOptions.{name}={getattr(self, name)}: must be >= 1")
        if self.max_slowdown < 1.0:
            raise ValueError(f"CandidateOptions.max_slowdown={self.max_slowdown}: must be >= 1")


# One class of placements: (mesh size, layout, estimated seconds).
PlacementClass = tuple[int, Layout, float]


def mesh_starts(cluster: ClusterSpec) -> dict[int, range]:
    """Per legal mesh size (smallest first), the starting GPUs of its meshes in increasing order
    (the positions of `ClusterSpec.meshes`, without building every Mesh of a big cluster)."""
    m = cluster.gpus_per_node
    out: dict[int, range] = {}
    size = 1
    while size < m:
        if m % size == 0:
            out[size] = range(0, cluster.n_gpus, size)
        size *= 2
    for n in range(1, cluster.nodes + 1):
        out[n * m] = range(0, (cluster.nodes - n + 1) * m, m)
    return out


def meshes_by_size(problem: PlanningProblem, limit: int | None = None) -> dict[int, list[Mesh]]:
    """Legal meshes of the cluster grouped by size, positions in increasing order: all of them,
    or at most `limit` per size, evenly spread (the first always kept)."""
    m = problem.cluster.gpus_per_node
    out = {}
    for size, starts in mesh_starts(problem.cluster).items():
        count = len(starts) if limit is None else min(limit, len(starts))
        picked = [starts[k * len(starts) // count] for k in range(count)]
        out[size] = [Mesh(start, size, m) for start in picked]
    return out


def feasible_classes(problem: PlanningProblem, mfc: MFC, costs: CallCostCache) -> tuple[list[PlacementClass], list[str]]:
    """Every feasible (size, layout, seconds) of a call, fastest first, and the reasons of the rest."""
    classes: list[PlacementClass] = []
    reasons: list[str] = []
    for size, meshes in meshes_by_size(problem, limit=1).items():
        mesh = meshes[0]
        for layout in problem.cluster.layouts_for(mesh):
            cost = costs.cost(mfc.name, Placement(mesh, layout))
            if cost.feasible:
                classes.append((size, layout, cost.time_s))
            else:
                reasons.append(f"{layout} on {size} GPUs: {cost.reason}")
    classes.sort(key=lambda c: (c[2], c[0]))
    return classes, reasons


def prune_classes(
    classes: list[PlacementClass], options: CandidateOptions, gpus_per_node: int = 8, slow_ok_s: float = 0.0,
) -> list[PlacementClass]:
    """Steps 2-5 of the module docstring on one call's feasible classes (fastest first);
    `slow_ok_s` is the time below which no class counts as too slow (step 5)."""
    per_size: dict[int, list[PlacementClass]] = {}
    for cls in classes:
        kept = per_size.setdefault(cls[0], [])
        if len(kept) < options.layouts_per_size:
            kept.append(cls)
    best_smaller = float("inf")
    sizes = []
    for size in sorted(per_size):
        best = per_size[size][0][2]
        if not options.drop_dominated or best < best_smaller:
            sizes.append(size)
        best_smaller = min(best_smaller, best)
    if len(sizes) > options.max_sizes:
        sizes = [s for s in sizes if s < gpus_per_node or _round_nodes(s // gpus_per_node) or s == sizes[-1]]
    out = [cls for size in sizes for cls in per_size[size]]
    limit = max(options.max_slowdown * min(c[2] for c in out), slow_ok_s)
    out = sorted((c for c in out if c[2] <= limit), key=lambda c: (c[2], c[0]))
    return out[: options.max_classes]


def _round_nodes(n: int) -> bool:
    """n = 2^k or 3 * 2^k."""
    while n % 2 == 0:
        n //= 2
    return n in (1, 3)


def call_candidates(
    problem: PlanningProblem, costs: CallCostCache, options: CandidateOptions | None = None,
    extra: dict[str, list[Placement]] | None = None,
) -> list[list[Placement]]:
    """Candidate placements per call in graph order; `extra` placements are always included
    (e.g. the baseline's, so the search can start from it). Raises ValueError when a call has
    no feasible placement at all."""
    options = options or CandidateOptions()
    graph = problem.graph
    feasible: dict[str, list[PlacementClass]] = {}
    for mfc in graph.mfcs:
        classes, reasons = feasible_classes(problem, mfc, costs)
        if not classes:
            shown = "; ".join(reasons[:4])
            raise ValueError(f"call {mfc.name}: no placement fits on this cluster ({len(reasons)} tried, e.g. {shown})")
        feasible[mfc.name] = classes
    slowest_call_s = max(classes[0][2] for classes in feasible.values())
    m = problem.cluster.gpus_per_node
    kept = {name: prune_classes(classes, options, m, slowest_call_s) for name, classes in feasible.items()}
    train_of = {m.role: m.name for m in graph.mfcs if m.kind == "train"}
    by_size = meshes_by_size(problem, options.max_positions)
    out: list[list[Placement]] = []
    for mfc in graph.mfcs:
        classes = list(kept[mfc.name])
        home = train_of.get(mfc.role)
        if home is not None and home != mfc.name:
            have = {(s, lay) for s, lay, _ in classes}
            for size, layout, _ in kept[home]:
                cost = costs.cost(mfc.name, Placement(by_size[size][0], layout))
                if (size, layout) not in have and cost.feasible:
                    classes.append((size, layout, cost.time_s))
        placements = [Placement(mesh, layout) for size, layout, _ in classes for mesh in by_size[size]]
        for p in (extra or {}).get(mfc.name, []):
            if p not in placements:
                placements.append(p)
        out.append(placements)
    return out
