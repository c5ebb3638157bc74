"""app.run.dynamic_sampling: which groups DAPO keeps, round after round, and what it logs."""

from __future__ import annotations

import pytest

from app.run.dynamic_sampling import GroupFilter, rewards_in_row_order, select_call

pytestmark = pytest.mark.unit


def test_groups_with_distinct_rewards_are_kept_until_the_batch_is_full() -> None:
    kept = GroupFilter(n_groups=3, group_size=2, max_rounds=4)
    assert not kept.add_round([1.0, 1.0, 0.0, 0.5, 0.2, 0.2])  # group 1 kept; 0 and 2 all equal
    assert kept.add_round([0.0, 1.0, 0.3, 0.3, 0.1, 0.9])  # groups 0 and 2 of round 1: 3 kept
    assert kept.batch_groups == [(0, 1), (1, 0), (1, 2)]
    assert kept.keep_rows() == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 4), (1, 5)]
    metrics = kept.metrics()
    assert metrics["rollout/reward_mean"] == pytest.approx(sum([1, 1, 0, .5, .2, .2, 0, 1, .3, .3, .1, .9]) / 12)
    assert metrics["dynamic_sampling/rounds"] == 2.0 and metrics["dynamic_sampling/kept_fraction"] == 0.5
    assert metrics["dynamic_sampling/filled_groups"] == 0.0


def test_after_the_last_round_dropped_groups_fill_the_batch() -> None:
    kept = GroupFilter(n_groups=2, group_size=2, max_rounds=2)
    assert not kept.add_round([0.0, 0.0, 0.0, 0.0])
    assert kept.add_round([0.0, 1.0, 0.0, 0.0])
    assert kept.batch_groups == [(1, 0), (0, 0)]  # the kept one, then the earliest dropped
    assert kept.metrics()["dynamic_sampling/filled_groups"] == 1.0
    with pytest.raises(ValueError, match="3 rewards"):
        GroupFilter(2, 2, 1).add_round([0.0, 1.0, 0.0])


def test_rewards_come_from_the_owners_in_row_order() -> None:
    metas = [{"owner": True, "row_start": 2, "rewards": [0.5, 0.25]}, {"owner": False},
             {"owner": True, "row_start": 0, "rewards": [1.0, 0.0]}]
    assert rewards_in_row_order(metas, 4) == [1.0, 0.0, 0.5, 0.25]
    with pytest.raises(ValueError, match=r"rows \[4\]"):
        rewards_in_row_order(metas, 5)


def test_select_call_runs_on_one_gpu() -> None:
    kept = GroupFilter(n_groups=1, group_size=2, max_rounds=1)
    kept.add_round([0.0, 1.0])
    spec = select_call(3, rank=2, gpus_per_node=4, input_rounds=[0, 0], round_rows=2, kept=kept)
    assert list(spec.placement.mesh.gpus) == [2] and spec.op == "select_rows" and spec.n_rows == 2
    assert spec.params["keep"] == [(0, 0), (0, 1)] and spec.iteration == 3
