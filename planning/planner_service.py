"""PlannerService: runs the plan search in its own process so a long search never blocks the driver.

A plain class like ModelWorker: the driver wraps it with `ray.remote(num_cpus=...)` (no GPU) and
calls `search.remote(problem, ...)` while the workers start; tests call it in-process. It only
forwards to `planning.search.search_plan`, after checking the arguments so that a bad request
fails with a message naming the field instead of deep inside the search.
"""

from __future__ import annotations

import time

from planning.candidates import CandidateOptions
from planning.cost import PlanningProblem
from planning.plan import ExecutionPlan
from planning.search import MODES, SearchResult, search_plan


class PlannerService:
    """Plan searches on request; remembers how many it ran and how long they took."""

    def __init__(self) -> None:
        self.searches = 0
        self.busy_s = 0.0

    def search(self, problem: PlanningProblem, mode: str = "search", seconds: float = 60.0, seed: int = 0,
               manual: ExecutionPlan | None = None, options: CandidateOptions | None = None,
               max_steps: int | None = None, start: ExecutionPlan | None = None) -> SearchResult:
        """`search_plan(problem, mode, seconds, seed, manual, ..., start=start)`: see planning/search.py
        for the modes (`start`: a plan to search from, e.g. the one a run executes when it re-plans)."""
        if not isinstance(problem, PlanningProblem):
            raise TypeError(f"problem: expected a planning.cost.PlanningProblem, got {type(problem).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed: {', '.join(MODES)}")
        if not seconds > 0:
            raise ValueError(f"seconds={seconds}: the search budget must be positive")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps={max_steps}: must be >= 1 or None")
        began = time.perf_counter()
        try:
            return search_plan(problem, mode, seconds, seed, manual, options, max_steps, start=start)
        finally:
            self.searches += 1
            self.busy_s += time.perf_counter() - began

    def stats(self) -> dict[str, float]:
        """Searches run so far and the seconds spent in them."""
        return {"searches": float(self.searches), "busy_s": self.busy_s}


__all__ = ["PlannerService"]
