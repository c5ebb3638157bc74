"""Bounded staleness (`run.max_staleness` = k): what the driver submits next, and what it logs.

The calls of an iteration split into its rollout stage (generation, `Graph.is_rollout`) and its
train stage (everything else: rewards, reference, critic, the actor's own logprobs, training).
Generation of iteration j reads the weights after training iteration j - k - 1, so the driver
submits in `Graph.dispatch_order`: the rollout stages of iterations 0..k first, then each
iteration's train stage followed by the rollout stage k + 1 iterations ahead. Because every worker
runs its tasks in submission order, and the weights reach the generation mesh by a reallocation
submitted right after the training it follows, generation of iteration j + k + 1 sees exactly the
weights of training j, and at most k generated batches wait for training at any time. On
disjoint meshes the generation of the next batches runs while the current one trains.

k = 0 is the on-policy order: one unit per iteration holding all its calls, in graph order.

Logged per iteration (k > 0): rollout/staleness (how many training steps the weights that
generated the batch lag behind the weights that train on it: min(iteration, k)) and
rollout/weights_version (the training iteration whose weights generated it; -1: the initial ones).
The importance weights that correct for the lag are the actor train call's actor/rollout_is_*.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.dataflow import Graph


@dataclass(frozen=True)
class Unit:
    """Calls of one iteration submitted together; `completes`: the last unit of that iteration."""

    iteration: int
    calls: tuple[str, ...]
    completes: bool


def submission_units(graph: Graph, iterations: int) -> list[Unit]:
    """`graph.dispatch_order(iterations)` cut into runs of one iteration's calls."""
    units: list[Unit] = []
    current: list[str] = []
    order = graph.dispatch_order(iterations)
    for position, (iteration, name) in enumerate(order):
        current.append(name)
        following = order[position + 1][0] if position + 1 < len(order) else None
        if following != iteration:
            # The unit that submits an iteration's train stage (or its only unit) completes it.
            completes = not all(graph.is_rollout(n) for n in current) or graph.max_staleness == 0
            units.append(Unit(iteration, tuple(current), completes))
            current = []
    return units


class StageSchedule:
    """The units of a run, handed out in order (`next_unit`)."""

    def __init__(self, graph: Graph, iterations: int, start: int = 0) -> None:
        """Units of iterations start..iterations-1; a run resumed at `start` begins as a fresh one
        would (its first k + 1 rollouts from the resumed weights, staleness 0 at first)."""
        if not 0 <= start < iterations:
            raise ValueError(f"start={start}: must be in [0, {iterations})")
        self.max_staleness = graph.max_staleness
        self._units = [Unit(u.iteration + start, u.calls, u.completes)
                       for u in submission_units(graph, iterations - start)]
        self._next = 0

    @property
    def remaining(self) -> int:
        return len(self._units) - self._next

    def next_unit(self) -> Unit:
        if not self.remaining:
            raise RuntimeError("StageSchedule: every unit of the run was already submitted")
        unit = self._units[self._next]
        self._next += 1
        return unit


def staleness_metrics(iteration: int, max_staleness: int, start: int = 0) -> dict[str, float]:
    """rollout/staleness and rollout/weights_version of an iteration (see the module docstring);
    start: the iteration the run (re)started at, whose generation used the weights of start - 1."""
    if max_staleness == 0:
        return {}
    version = max(iteration - max_staleness - 1, start - 1)
    return {"rollout/staleness": float(iteration - 1 - version), "rollout/weights_version": float(version)}


__all__ = ["StageSchedule", "Unit", "staleness_metrics", "submission_units"]
