"""What the multi-turn decode loop asks of whoever answers a trajectory's turns.

The generation engine knows nothing of environments, tools or chat templates: a trajectory that
ended a turn is paused ("here are the ids it sampled this turn"), and later it is either resumed
("append these observation ids at its length, then keep decoding") or ended. `TurnSource` is that
contract; `app.envs.sessions.EnvSessions` implements it with user environments stepping in a thread
pool beside the decode loop (this package never imports it: the worker builds it from a name).

Rows are the call's sequence indices 0..B-1 (the order of the prompts the loop was given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TurnResult:
    """The answer to one paused trajectory: observation ids to append and resume with, or the end.

    row: the sequence index. observation_ids: token ids to append at the trajectory's length
    (already truncated by the source to its observation limit); ignored when `done`.
    done: the trajectory ends here (the environment said so, failed, timed out, or max_turns).
    """

    row: int
    observation_ids: tuple[int, ...] = ()
    done: bool = False


class TurnSource(Protocol):
    """The environments of one generation call, one trajectory per row."""

    def prompts(self) -> list[list[int]]:
        """Prompt ids of every row (the environments' first observations, templated)."""
        ...

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        """Row ended a turn with these sampled ids (this turn's only); answer it later via `poll`.
        last: the loop cannot continue this trajectory (its length budget is spent), so the
        source should still score the action but must answer with done=True."""
        ...

    def poll(self, wait_s: float) -> list[TurnResult]:
        """Answers ready now; waits up to wait_s seconds for at least one when none is ready."""
        ...

    def pending(self) -> int:
        """Rows submitted and not yet answered."""
        ...


__all__ = ["TurnResult", "TurnSource"]
