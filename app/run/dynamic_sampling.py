"""DAPO's dynamic sampling (Yu et al. 2025): keep only the prompts whose sampled responses got
different rewards, and generate more until the batch is full.

A group whose rewards are all equal has zero advantage under group normalisation, so it adds
nothing but noise to the step. Per iteration the driver runs the generation and reward calls in
rounds, each on a fresh batch of prompts, reads the rewards from the reward call's metadata and
hands them to `GroupFilter.add_round`; once `batch.prompts` groups with distinct rewards are kept
(or after dapo.max_gen_rounds rounds, filling the rest with dropped groups, earliest first) a
`select_rows` call on one worker gathers the kept rows from the rounds' shards into the batch
that the reference and training calls read, renumbering prompt_index by kept group. Only lists of
rewards pass through here, never tensors.

Metrics: rollout/reward_mean over EVERY generated response (the policy's reward, not the kept
batch's), dynamic_sampling/rounds, dynamic_sampling/kept_fraction (kept groups / generated),
dynamic_sampling/filled_groups (dropped groups used to fill the batch after the last round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.worker import CallSpec
from planning.layout import Layout, Mesh
from planning.plan import Placement

SELECT_CALL = "dyn_select"


@dataclass
class GroupFilter:
    """The kept groups of one iteration, round after round.

    n_groups: prompts per batch; group_size: responses per prompt (consecutive rows, as
    generation writes them); max_rounds: generation rounds at most.
    """

    n_groups: int
    group_size: int
    max_rounds: int
    kept: list[tuple[int, int]] = field(default_factory=list)  # (round, group) with distinct rewards
    dropped: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        if self.n_groups < 1 or self.group_size < 2 or self.max_rounds < 1:
            raise ValueError(f"GroupFilter(n_groups={self.n_groups}, group_size={self.group_size}, "
                             f"max_rounds={self.max_rounds}): need >= 1, >= 2, >= 1")

    def add_round(self, rewards: list[float]) -> bool:
        """Record one round's rewards (one per row, rows in order); True once the batch is full or
        the rounds are spent."""
        if len(rewards) != self.n_groups * self.group_size:
            raise ValueError(f"dynamic sampling: {len(rewards)} rewards in round {self.rounds}; expected "
                             f"{self.n_groups} groups x {self.group_size}")
        for g in range(self.n_groups):
            group = rewards[g * self.group_size:(g + 1) * self.group_size]
            (self.kept if max(group) > min(group) else self.dropped).append((self.rounds, g))
        self.rewards += rewards
        self.rounds += 1
        return len(self.kept) >= self.n_groups or self.rounds >= self.max_rounds

    @property
    def batch_groups(self) -> list[tuple[int, int]]:
        """(round, group) of the batch: the first n_groups kept, then dropped ones to fill it."""
        chosen = self.kept[:self.n_groups]
        return chosen + self.dropped[:self.n_groups - len(chosen)]

    def keep_rows(self) -> list[tuple[int, int]]:
        """(round, row) of every row of the batch, group after group."""
        return [(r, g * self.group_size + k) for r, g in self.batch_groups for k in range(self.group_size)]

    def metrics(self) -> dict[str, float]:
        generated = self.rounds * self.n_groups
        return {
            "rollout/reward_mean": sum(self.rewards) / len(self.rewards),
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/kept_fraction": len(self.kept) / generated,
            "dynamic_sampling/filled_groups": float(max(0, self.n_groups - len(self.kept))),
        }


def select_call(iteration: int, rank: int, gpus_per_node: int, input_rounds: list[int], round_rows: int,
                kept: GroupFilter) -> CallSpec:
    """The select_rows call (actors.worker.select) gathering the kept rows, on GPU `rank` alone;
    input_rounds: the round of each producer shard it is given, in order."""
    placement = Placement(Mesh(rank, 1, gpus_per_node), Layout())
    params = {"op": "select_rows", "input_rounds": input_rounds, "round_rows": round_rows,
              "keep": kept.keep_rows(), "group_size": kept.group_size}
    return CallSpec(SELECT_CALL, "reward", "inference", placement, iteration, len(params["keep"]), params)


def rewards_in_row_order(metas: list[dict], n_rows: int) -> list[float]:
    """The rewards of a reward call's data owners' metadata (`rewards`, `row_start`), by row."""
    by_row: dict[int, float] = {}
    for meta in metas:
        if isinstance(meta, dict) and meta.get("owner", True) and "rewards" in meta:
            for offset, value in enumerate(meta["rewards"]):
                by_row[int(meta.get("row_start", 0)) + offset] = float(value)
    missing = [r for r in range(n_rows) if r not in by_row]
    if missing:
        raise ValueError(f"dynamic sampling: the reward call reported no reward for rows {missing[:8]}")
    return [by_row[r] for r in range(n_rows)]


__all__ = ["GroupFilter", "SELECT_CALL", "rewards_in_row_order", "select_call"]
